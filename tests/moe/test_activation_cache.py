"""model.activation_cache = "fp8": what the SwiGLUs and the routed slots keep for backward, and their numerics.

Saved bytes: a GroupedExperts / MoELayer forward keeps, per routed row, the expert input's e4m3 tiles, gate|up's
e4m3 tiles with fp32 scales, the fp32 routing weight and the dispatch's two int64 row ids; nothing in the run's
dtype of width F or 2F, no expert output in combine; the totals equal moe-plan's fused-fp8 per-token terms.

Numerics, bounds derived first (u = 2^-53 for float64; e4m3 keeps 3 mantissa bits: round-to-nearest is off by at
most 2^-4 of a value, normal range, and by half a subnormal step, 2^-10 * scale = amax * 2^-10 / 448, below it):
- the fold (routing weight applied before the down projection) only reorders float64 roundings: every output and
  grad entry is a sum of at most n = max(H, 2F, rows) + 8 rounded products, so the two orders differ by at most
  2 n u times the sum of the magnitudes of its terms; the test measures entries against 2 n u * max|entry| (a
  sum's magnitudes are within a small factor of max|entry| here: no cancellation in these positive-weight sums);
- the FP8 cache leaves the forward bitwise unchanged (it only feeds backward) and rounds gate|up by <= 2^-4
  relative: a grad built from it is off by <= c * 2^-4 per entry, c the sensitivity of silu(g) * u and its
  derivative to g and u (<= 2 for |g| <= 4), so calc_diff = (1/2) mean squared relative error <= (1/2)(2 * 2^-4)^2
  = 2^-7; the mean of uniform rounding errors is a fifth of that (E[delta^2] = 2^-8 / 3 * E[1/m^2], m the mantissa).
Measured over seeds 0-4 x ATEN_CPU_CAPABILITY=default|avx2|native (fold_errors, fp8_errors per seed): the fold's
largest error is 0.044 of n u max|entry| (bound FOLD_ULPS = 2; the routing weights' grads, fp32, came out equal),
the same under every capability to 3 digits; the FP8 cache's largest calc_diff is 2.37e-3 (router.weight; x 5.7e-4,
routing weights 1.8e-3, experts 1.5e-3 and 1.8e-3, shared 4e-4 and 8.9e-4), identical under the three capabilities,
against the bound 2^-7 = 7.8e-3; the output's calc_diff 1.7e-14 against (n 2^-24)^2 / 2 = 1.2e-10. The tests run
two of those seeds (TEST_SEEDS) to stay fast.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from dispatch.fp8 import quantize_fp8
from kernels import FP8_DTYPE, calc_diff, dequantize_activation
from launch.plan.memory import FP8_CACHED, ActivationModel
from launch.plan.params import count_params
from moe.config import ModelConfig
from moe.experts import GroupedExperts, SwiGLU, swiglu_down
from moe.layer import MoELayer
from moe.model import MoETransformer

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 256, 128, 4, 2, 24
SEEDS = range(5)  # the seeds the spreads were measured over
TEST_SEEDS = SEEDS[:2]
FOLD_ULPS = 2  # the fold's bound: FOLD_ULPS * n * u * max|entry| (module doc)
FP8_BOUND = 2.0 ** -7  # the FP8 cache's derived calc_diff bound (module doc)


def config(**overrides) -> ModelConfig:
    settings = {"hidden_size": HIDDEN, "num_experts": EXPERTS, "top_k": TOP_K, "expert_ffn_size": FFN,
                "num_shared_experts": 1}
    return ModelConfig(**{**settings, **overrides})


def saved_storages(run) -> dict[int, torch.Tensor]:
    """The tensors autograd keeps for backward while run() executes, one per storage, parameters left out."""
    seen: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(t.untyped_storage()._cdata, t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    params = {p.untyped_storage()._cdata for p in run.params}
    return out, {k: t for k, t in seen.items() if k not in params}


class Run:
    """A forward of module(*args) whose parameters saved_storages leaves out."""

    def __init__(self, module: torch.nn.Module, *args) -> None:
        self.module, self.args, self.params = module, args, list(module.parameters())

    def __call__(self):
        return self.module(*self.args)


def nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def plan(cfg: ModelConfig, itemsize: int) -> ActivationModel:
    return ActivationModel(cfg, count_params(cfg).attention, itemsize, kernels="fused-fp8")


def test_grouped_experts_keep_only_e4m3_tiles_and_the_row_weight():
    torch.manual_seed(0)
    experts = GroupedExperts(EXPERTS, HIDDEN, FFN, precision="fp8", activation_cache="fp8").bfloat16()
    rows = TOKENS * TOP_K
    counts = torch.tensor([10, 0, 23, rows - 33])
    x = torch.randn(rows, HIDDEN).bfloat16().requires_grad_()
    weight = torch.rand(rows, requires_grad=True)
    out, saved = saved_storages(Run(experts, x, counts, weight))
    kept = [t for t in saved.values() if t.dtype != torch.int32]  # int32: the group offsets, one per expert
    wide = [t for t in kept if t.is_floating_point() and t.dtype != FP8_DTYPE and t.shape[-1] in (HIDDEN, FFN, 2 * FFN)]
    assert not wide, [(t.dtype, t.shape) for t in wide]  # no row in the run's dtype: not x, gate|up nor the product
    assert sorted(str((t.dtype, tuple(t.shape))) for t in kept) == sorted(map(str, [
        (FP8_DTYPE, (rows, HIDDEN)), (torch.float32, (rows, HIDDEN // 128)), (FP8_DTYPE, (rows, 2 * FFN)),
        (torch.float32, (rows, 2 * FFN // 128)), (torch.float32, (rows,))]))
    row_ids = 16  # the dispatch's, not the experts'
    assert nbytes(kept) == rows * (plan(config(), 2)._slot() - row_ids)
    assert nbytes(kept) == rows * ((HIDDEN + 2 * FFN) * FP8_CACHED + 4)
    out.float().sum().backward()  # what was kept is enough for every grad
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (x, weight, experts.w_gate_up, experts.w_down))


@pytest.mark.parametrize("precision", ["fp8", "native"])
def test_moe_layer_keeps_the_plans_bytes_and_no_expert_output(precision):
    """The layer keeps, besides its input and what its router keeps of it, the plan's top_k slots per token (fp8
    experts; native ones keep their input rows in the run's dtype) and the shared expert's gate|up cache."""
    torch.manual_seed(0)
    cfg = config(activation_cache="fp8", expert_precision=precision)
    layer = MoELayer(cfg).bfloat16()
    x = torch.randn(TOKENS, HIDDEN).bfloat16().requires_grad_()
    _, saved = saved_storages(Run(layer, x))
    _, routed = saved_storages(Run(layer.router, x))
    kept = [t for t in saved.values() if t.dtype != torch.int32]  # int32: the group offsets, one per expert
    rows = [t for t in kept if t.shape == (TOKENS * TOP_K, HIDDEN) and t.dtype != FP8_DTYPE]
    assert len(rows) == (precision == "native")  # native experts keep their input rows; nobody an expert output
    model = plan(cfg, 2)  # the plan's slot has an FP8 expert input; native experts keep theirs in bf16
    slot = model._slot() + (HIDDEN * (2 - FP8_CACHED) if precision == "native" else 0)
    assert x.untyped_storage()._cdata in routed  # the router keeps its input as given (moe.router.promoted_linear),
    # as do the shared expert's first linear: the plan counts it with the FFN norm
    assert nbytes(kept) - nbytes(routed.values()) == TOKENS * (TOP_K * slot + model._swiglu(FFN))


@pytest.mark.parametrize("shape", [(TOKENS, HIDDEN), (2, TOKENS // 2, HIDDEN)])
def test_an_fp8_dense_swiglu_keeps_its_input_and_gate_up_tiles_only(shape):
    """A dense or shared SwiGLU with FP8 linears (model.linear_precision) and the FP8 cache: its down projection is
    handed the product's e4m3 tiles, rebuilt in backward from the gate|up cache, so it keeps no tiles of its own; what
    stays is gate_up's input tiles and the gate|up cache (2-D rows, and a dense layer's [B, S, H])."""
    torch.manual_seed(0)
    mlp = SwiGLU(HIDDEN, FFN, precision="fp8").bfloat16()
    mlp.activation_cache = "fp8"
    x = torch.randn(shape).bfloat16().requires_grad_()
    _, saved = saved_storages(Run(mlp, x))
    rows = x.numel() // HIDDEN
    assert sorted(str((t.dtype, tuple(t.shape))) for t in saved.values() if t.dtype != torch.int32) == sorted(map(str, [
        (FP8_DTYPE, (rows, HIDDEN)), (torch.float32, (rows, HIDDEN // 128)),
        (FP8_DTYPE, (rows, 2 * FFN)), (torch.float32, (rows, 2 * FFN // 128))]))
    mlp(x).float().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (x, mlp.gate_up.weight, mlp.down.weight))


def test_native_cache_keeps_what_it_kept():
    """activation_cache "native": the combine keeps each expert output, the SwiGLU its product (as before)."""
    torch.manual_seed(0)
    layer = MoELayer(config()).bfloat16()
    x = torch.randn(TOKENS, HIDDEN).bfloat16().requires_grad_()
    _, saved = saved_storages(Run(layer, x))
    shapes = [tuple(t.shape) for t in saved.values() if t.dtype == torch.bfloat16]
    assert shapes.count((TOKENS * TOP_K, FFN)) >= 2 and (TOKENS * TOP_K, HIDDEN) in shapes


def layer_grads(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor, weights: list) -> dict[str, torch.Tensor]:
    """Output, grads of x, of every parameter and of the routing weights (captured from the router's result)."""
    router = layer.router

    def keep(module, args, route):
        route.weights.retain_grad()
        weights.append(route.weights)
    handle = router.register_forward_hook(keep)
    try:
        x = x.detach().requires_grad_()
        out, _ = layer(x)
        out.backward(dy)
    finally:
        handle.remove()
    grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "x": x.grad, "routing weights": weights[-1].grad, **grads}


def fold_pair(seed: int, dtype: torch.dtype, **overrides) -> tuple[dict, dict]:
    """(native layer, the same layer with activation_cache "fp8") grads on the same input."""
    torch.manual_seed(seed)
    native = MoELayer(config(**overrides)).to(dtype)
    cached = copy.deepcopy(native)
    for module in (cached.experts, cached.shared):
        module.activation_cache = "fp8"
    x, dy = torch.randn(TOKENS, HIDDEN, dtype=dtype), torch.randn(TOKENS, HIDDEN, dtype=dtype)
    return layer_grads(native, x, dy, []), layer_grads(cached, x, dy, [])


def fold_errors(seed: int) -> dict[str, float]:
    """Per entry kind, max |fold - unfold| / (n u max|unfold|) in float64, the FP8 cache's rounding taken out: both
    layers keep gate|up as it is (the fold alone, swiglu_down's native cache with a row weight)."""
    torch.manual_seed(seed)
    native = MoELayer(config(num_shared_experts=0)).double()
    folded = copy.deepcopy(native)
    folded.experts.activation_cache = "native"
    folded.__class__ = FoldedLayer
    x, dy = torch.randn(TOKENS, HIDDEN, dtype=torch.float64), torch.randn(TOKENS, HIDDEN, dtype=torch.float64)
    want, got = layer_grads(native, x, dy, []), layer_grads(folded, x, dy, [])
    n = max(HIDDEN, 2 * FFN, TOKENS * TOP_K) + 8
    return {k: ((got[k] - want[k]).abs().max() / (n * 2.0 ** -53 * want[k].abs().max())).item() for k in want}


class FoldedLayer(MoELayer):
    """An MoELayer that folds the routing weights whatever its activation cache (the fold alone, in float64)."""

    @property
    def fold_weights(self) -> bool:
        return True


@pytest.mark.parametrize("seed", TEST_SEEDS)
def test_the_fold_equals_weighting_in_combine_up_to_float64_rounding(seed):
    errors = fold_errors(seed)
    assert set(errors) >= {"out", "x", "routing weights", "router.weight", "experts.w_gate_up", "experts.w_down"}
    assert max(errors.values()) <= FOLD_ULPS, errors


def fp8_errors(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """calc_diff of each grad (and the output) of the fp8-cached layer against the native one (fp8 experts both)."""
    want, got = fold_pair(seed, dtype, expert_precision="fp8")
    return {k: calc_diff(got[k].double(), want[k].double()) for k in want}


@pytest.mark.parametrize("seed", TEST_SEEDS)
def test_the_fp8_cache_is_within_e4m3_rounding_of_the_native_layer(seed):
    errors = fp8_errors(seed)
    assert set(errors) >= {"out", "x", "routing weights", "router.weight", "experts.w_gate_up", "experts.w_down",
                           "shared.gate_up.weight", "shared.down.weight"}
    assert errors["out"] < (264 * 2.0 ** -24) ** 2 / 2  # the cache only feeds backward; the fold reorders roundings
    assert max(errors.values()) < FP8_BOUND, errors
    assert max(errors.values()) > 2.0 ** -16, errors  # the grads did come from the e4m3 cache


def test_the_swiglu_cache_alone_gives_autograds_grads_of_the_rounded_input():
    """swiglu_down with the fp8 cache: forward bitwise the native one; backward exactly autograd's through the
    dequantised gate|up (the rounding is all the cache changes), the down projection's weight grad included."""
    torch.manual_seed(0)
    gate_up = torch.randn(6, 3, 2 * FFN, dtype=torch.float64, requires_grad=True)
    down = torch.nn.Linear(FFN, HIDDEN, bias=False).double()
    out = swiglu_down(gate_up, down, False, "fp8")
    dy = torch.randn_like(out)
    out.backward(dy)
    got = gate_up.grad, down.weight.grad
    rounded = dequantize_activation(*quantize_fp8(gate_up.detach().reshape(-1, 2 * FFN)))
    rounded = rounded.double().view(gate_up.shape).requires_grad_()
    gate, up = gate_up.detach().chunk(2, -1)
    assert torch.equal(out, down(F.silu(gate) * up))
    down.weight.grad = None
    g, u = rounded.chunk(2, -1)
    down(F.silu(g) * u).backward(dy)
    for mine, autograds in zip(got, (rounded.grad, down.weight.grad)):  # float64 roundings apart, n = 2F terms
        assert (mine - autograds).abs().max() <= 2 * 2 * FFN * 2.0 ** -53 * autograds.abs().max()


def test_bad_activation_cache_is_refused_naming_the_key_and_choices():
    with pytest.raises(ValueError, match="activation_cache = 'bf16' is not allowed; choose one of 'native', 'fp8'"):
        ModelConfig(activation_cache="bf16")
    with pytest.raises(ValueError, match="activation_cache"):
        GroupedExperts(2, 8, 8, activation_cache="e5m2")


@pytest.mark.parametrize("precision", ["fp8", "native"])
def test_the_cached_layer_runs_on_meta(precision):
    """The rehearsal's device: forward and backward with the cache and the fold make only meta tensors."""
    with torch.device("meta"):
        layer = MoELayer(config(activation_cache="fp8", expert_precision=precision)).bfloat16()
        x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    out, _ = layer(x)
    out.sum().backward()
    assert out.is_meta and x.grad.is_meta and layer.experts.w_down.grad.is_meta


class _Outputs(TorchDispatchMode):
    """Weak references to every tensor the ops under it return."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        self.made += [weakref.ref(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_a_recipe_forward_keeps_alive_only_what_autograd_saved(attention):
    """DeepSeek-V3's recipe (FP8 linears and experts, the FP8 cache, selective recompute): once forward returns,
    every tensor its ops made that is still alive is the output or shares a storage with one autograd saved --
    nothing held by a rebuild thunk's closure or a Function's context (a thunk holding the SwiGLU product kept a
    bf16 [rows, F] per layer and micro-batch, 9 GiB of the V3 rehearsal, outside every count of saved bytes)."""
    torch.manual_seed(0)
    mla = {"attention": "mla", "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
           "qk_rope_head_dim": 64, "v_head_dim": 64}
    cfg = config(num_layers=2, first_k_dense=1, num_heads=2, dense_ffn_size=FFN, vocab_size=64, max_seq_len=16,
                 activation_cache="fp8", expert_precision="fp8", linear_precision="fp8",
                 **(mla if attention == "mla" else {"num_kv_heads": 1}))
    model = MoETransformer(cfg, recompute="selective").bfloat16()
    tokens = torch.randint(0, 64, (1, 16))
    outputs = _Outputs()
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(t.untyped_storage()._cdata, t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), outputs:
        loss = model(tokens, labels=tokens.roll(-1, dims=1)).loss
    gc.collect()
    alive = [t for t in (ref() for ref in outputs.made) if t is not None and t is not loss]
    unsaved = {(tuple(t.shape), str(t.dtype), type(t.grad_fn).__name__) for t in alive
               if t.untyped_storage()._cdata not in saved and t.untyped_storage().nbytes() > 4 * 64}
    assert not unsaved
    loss.backward()
