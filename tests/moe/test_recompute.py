"""Activation recomputation (moe.recompute): every mode gives the grads of "none", with and without the B/W split,
and drops what it says it drops from the tensors saved for backward."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from moe.config import ModelConfig
from moe.model import MoETransformer
from moe.recompute import RECOMPUTE, Rebuild, recomputed
from pipeline.memory import SavedTensorMeter
from pipeline.wgrad import WeightGradStore, install_split_linear

ATTENTION = {"gqa": dict(num_heads=2, num_kv_heads=1),
             "mla": dict(num_heads=2, attention="mla", q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
                         qk_rope_head_dim=4, v_head_dim=5)}


def build(attention: str, recompute: str, dtype: torch.dtype = torch.float64, **overrides) -> MoETransformer:
    """One dense and one MoE layer (shared expert, every router loss on), O(1)-ish weights, the same for every
    mode."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, max_seq_len=16, num_layers=2, dense_ffn_size=48, num_experts=4,
                      expert_ffn_size=16, top_k=2, score_func="sigmoid", num_groups=2, topk_groups=1, init_std=0.1,
                      **{"aux_loss_coeff": 0.01, "seq_aux_loss_coeff": 0.001, "z_loss_coeff": 0.001}
                      | ATTENTION[attention] | overrides)
    return MoETransformer(cfg, recompute=recompute).to(dtype)


def grads(model: MoETransformer, split: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and every parameter's grad of two micro-batches; split: each backward inside a weight-grad capture
    (every nn.Linear split, experts deferred too) and the W actions run after both."""
    if split:
        install_split_linear([model])
    store = WeightGradStore()
    generator = torch.Generator().manual_seed(1)
    losses = []
    for chunk in range(2):
        tokens = torch.randint(0, 64, (2, 16), generator=generator)
        loss = model(tokens, labels=tokens.roll(-1, dims=1)).loss
        with store.capture(chunk) if split else torch.enable_grad():
            loss.backward()
        losses.append(loss.detach())
    if split:
        assert store.pending() > 0
        store.run(0, 1)
    return torch.stack(losses), {n: p.grad for n, p in model.named_parameters()}


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - cosine-like similarity of the design's correctness method (0 for equal tensors)."""
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    return 0.0 if denominator == 0 else float(1 - 2 * (x * y).sum() / denominator)


@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("split", [False, True], ids=["fused_bw", "split_bw"])
def test_every_mode_gives_the_grads_of_none(attention: str, split: bool) -> None:
    loss_ref, ref = grads(build(attention, "none"), split)
    for mode in RECOMPUTE[1:]:
        loss, got = grads(build(attention, mode), split)
        torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-10)
        for name, grad in ref.items():
            assert got[name] is not None, (mode, name)
            assert calc_diff(got[name], grad) < 1e-12, (mode, name)
            torch.testing.assert_close(got[name], grad, rtol=1e-10, atol=1e-12, msg=f"{mode} {name}")


def saved_peak(model: MoETransformer) -> int:
    """Bytes a forward keeps for backward (one micro-batch, float32)."""
    meter = SavedTensorMeter(params=list(model.parameters()))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with meter.hooks():
        loss = model(tokens, labels=tokens).loss
        peak = meter.live
        loss.backward()
    assert meter.live == 0
    return peak


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_each_mode_keeps_less(attention: str) -> None:
    kept = [saved_peak(build(attention, mode, torch.float32)) for mode in RECOMPUTE]
    assert kept[0] > kept[1] > kept[2], kept


def test_a_dropped_tensor_is_rebuilt_and_others_reach_the_outer_hooks() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    seen, rebuilt = [], []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t):
        with Rebuild() as rebuild:
            y = rebuild.drop(x.exp(), lambda: rebuilt.append(1) or x.detach().exp())
            out = (y.t() * y.t()).sin().sum()  # mul saves views of y (rebuilt), sin saves its input (kept)
    out.backward()
    assert rebuilt == [1, 1] and seen == [torch.Size([4, 3]), torch.Size([3, 4])]  # exp's output, sin's input
    torch.testing.assert_close(x.grad, (2 * x.exp() ** 2 * (x.exp() ** 2).cos()))


def test_recomputed_keeps_its_inputs_only_and_reaches_the_params() -> None:
    layer = torch.nn.Linear(3, 3).double()
    x = torch.randn(2, 3, dtype=torch.float64)  # an input that needs no grad: the params' grads still come
    calls = []
    layer.weight.register_post_accumulate_grad_hook(lambda _: calls.append(1))
    meter = SavedTensorMeter(params=list(layer.parameters()))
    with meter.hooks():
        (out,) = recomputed(lambda t: (layer(t).tanh(),), [x])
        assert meter.live == x.nbytes
        out.sum().backward()
    assert calls == [1]  # one post-accumulate-grad call per parameter (ZeRO-1 counts them)
    reference = torch.nn.Linear(3, 3).double()
    reference.load_state_dict(layer.state_dict())
    reference(x).tanh().sum().backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad, rtol=0, atol=0)


def test_the_mode_changes_no_state() -> None:
    # checkpoints of every mode hold the same tensors: a run may resume under another mode
    states = [build("mla", mode).state_dict() for mode in RECOMPUTE]
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        assert all(torch.equal(state[k], states[0][k]) for k in state)


def test_a_dropped_tensor_is_freed_once_the_forward_lets_go_of_it() -> None:
    # the saved tensors keep the region's hooks alive; the tensor itself must not be (the memory selective saves)
    x = torch.randn(4, 3, requires_grad=True)

    def forward() -> tuple[torch.Tensor, weakref.ref]:
        with Rebuild() as rebuild:
            y = rebuild.drop(x.sin(), lambda: x.detach().sin())  # sin keeps its input, not y
            return (y * y).sum(), weakref.ref(y)

    out, dropped = forward()
    assert dropped() is None
    out.backward()
    torch.testing.assert_close(x.grad, 2 * x.sin() * x.cos())


def test_a_branch_whose_backward_never_runs_frees_what_it_saved() -> None:
    # exp saves its own output: kept with its grad_fn, it would hold its node (and every node behind it) in a cycle
    # that only a backward through it breaks -- a router loss with a zero coefficient never gets one
    x = torch.randn(4, 3, requires_grad=True)
    with Rebuild():
        y = x.exp()
    saved = weakref.ref(y)
    del y
    assert saved() is None


@pytest.mark.parametrize("mode", RECOMPUTE)
def test_no_graph_outlives_a_backward(mode: str) -> None:
    # zero z and load-balance coefficients: their losses are statistics only; after the backward no tensor of the
    # step's graph is left (the rehearsal of DeepSeek-V3 kept every micro-batch's graph to the optimizer step)
    def graph_tensors() -> dict[int, torch.Tensor]:
        gc.collect()
        return {id(t): t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    before = set(graph_tensors())  # what other tests of the process left alive is not this test's
    model = build("mla", mode, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens, labels=tokens.roll(-1, dims=1)).loss.backward()
    assert [tuple(t.shape) for i, t in graph_tensors().items() if i not in before] == []
