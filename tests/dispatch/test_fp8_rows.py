"""fp8 payload into fp8 experts: the received e4m3 rows and scales feed the grouped GEMM as they are (FP8Rows).

Against the old route (dequantise on arrival to the model dtype, then the experts requantise) the
results are bitwise equal whenever the sent rows were in the model dtype: the tile maximum a decodes to
dtype(448 * fl(a / 448)) = a (a is a dtype value and the product is within 2^-24 of it), so the requantised
scale is fl(a / 448) again, and every other value q * scale, rounded to the dtype (relative 2^-9 for bf16),
is far inside half an e4m3 step (2^-5) of q * scale, so its code is q again. Tested with power-of-two
scales (where q * scale is exact) and with generic scales over six decades; the old route's extra work is
the only difference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dispatch import EPDispatcher
from dispatch.fp8 import quantize_fp8
from launch.parallel.spawn import run_processes
from dispatch.synthetic import synthetic_routing
from kernels import FP8Rows, calc_diff, fp8_grouped_linear
from moe.config import ModelConfig
from moe.experts import GroupedExperts
from moe.layer import MoELayer
from tests.dispatch.test_segment_ops import one_rank  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

HIDDEN, FFN, EXPERTS, TOP_K = 256, 128, 4, 2


def _power_of_two_tiles(rows: int, gen: torch.Generator) -> torch.Tensor:
    """Rows whose 1x128 tiles are e4m3 values times 2^k with one element at 448: every scale is 2^k."""
    codes = torch.randn(rows, HIDDEN, generator=gen).mul(100).clamp(-447, 447).to(torch.float8_e4m3fn).float()
    codes[:, ::128] = 448.0
    return codes * 2.0 ** torch.randint(-12, -4, (rows, HIDDEN // 128), generator=gen).repeat_interleave(128, 1)


def _run(dtype: torch.dtype, fp8_rows: bool, x: torch.Tensor, indices, weights, experts: GroupedExperts):
    dispatcher = EPDispatcher(EXPERTS, payload="fp8", fp8_rows=fp8_rows)
    x = x.to(dtype).requires_grad_()
    w = weights.clone().requires_grad_()
    experts.zero_grad()
    recv, info, handle = dispatcher.dispatch(x, indices, w)
    assert isinstance(recv, FP8Rows) == fp8_rows
    out = dispatcher.combine(experts(recv, info.tokens_per_local_expert), handle)
    out.float().square().sum().backward()
    return [out, x.grad, w.grad, experts.w_gate_up.grad, experts.w_down.grad]


def _check_routes_equal(x: torch.Tensor, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Outputs and all grads of the FP8Rows route equal the old route's bit for bit (and are not all zero)."""
    indices, weights = synthetic_routing(x.shape[0], EXPERTS, TOP_K, generator=gen)
    torch.manual_seed(0)
    experts = GroupedExperts(EXPERTS, HIDDEN, FFN, precision="fp8").to(dtype)
    direct = _run(dtype, True, x, indices, weights, experts)
    old = _run(dtype, False, x, indices, weights, experts)
    for got, want in zip(direct, old):
        assert got.abs().sum() > 0 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_equal_dequantise_requantise_bitwise_when_scales_are_powers_of_two(one_rank, dtype):
    gen = torch.Generator().manual_seed(1)
    _check_routes_equal(_power_of_two_tiles(40, gen), dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_equal_dequantise_requantise_bitwise_for_generic_scales(one_rank, dtype):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(64, HIDDEN, generator=gen) * 10.0 ** torch.randint(-3, 3, (64, 1), generator=gen)).to(dtype)
    q, scale = quantize_fp8(x)
    q2, scale2 = quantize_fp8((q.float() * scale.repeat_interleave(128, 1)).to(dtype))  # the old route's requantise
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2)
    _check_routes_equal(x, dtype, gen)


def test_fp8_rows_need_fp8_payload_and_fp8_experts(one_rank):
    with pytest.raises(ValueError, match="fp8_rows = True needs payload = 'fp8'"):
        EPDispatcher(EXPERTS, payload="bf16", fp8_rows=True)
    layer = MoELayer(ModelConfig(hidden_size=128, num_experts=EXPERTS, top_k=TOP_K, expert_ffn_size=FFN))
    with pytest.raises(ValueError, match="need expert_precision = 'fp8'"):
        layer.to_expert_parallel(EPDispatcher(EXPERTS, payload="fp8", fp8_rows=True))


def test_fp8_linear_checks_fp8_rows():
    q, scale = quantize_fp8(torch.randn(8, HIDDEN))
    w, offs = torch.randn(2, 16, HIDDEN), torch.tensor([3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="x.scale must have shape"):
        fp8_grouped_linear(FP8Rows(q, scale[:, :1], torch.zeros(8, HIDDEN)), w, offs)
    with pytest.raises(ValueError, match="rows mismatch"):
        fp8_grouped_linear(FP8Rows(q, scale, torch.zeros(7, HIDDEN)), w, offs)


# A 2-process EP layer, fp8 payload + fp8 experts, against the 1-process fp8-expert layer. The payload's
# quantiser is the experts' own, so the first GEMM sees the 1-process layer's operands: outputs and input grads
# agree up to the GEMMs' summation order, which the CPU's BLAS picks by shape and by CPU (an expert holds both
# ranks' rows under EP, this rank's only in one process; bitwise equal on an AVX2 EPYC, calc_diff up to 1.1e-10 on
# an AVX-512 Xeon, where a last-bit difference before the down projection's FP8 quantisation can flip one e4m3
# rounding). The weight grads differ by FP8 rounding: EP quantises the wgrad operand from the received e4m3 rows
# (the 1-process layer from x itself) and its 128-token tiles hold other tokens (both ranks' rows per expert);
# measured calc_diff 2.9e-4..9.4e-4.
WORLD, TOKENS = 2, (24, 13)
EP_OUT_TOL = 1e-8
EP_WGRAD_TOL = 2e-3


def _cfg() -> ModelConfig:
    return ModelConfig(hidden_size=HIDDEN, num_experts=EXPERTS, top_k=TOP_K, expert_ffn_size=FFN,
                       num_shared_experts=0, expert_precision="fp8")


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randn(TOKENS[rank], HIDDEN, generator=gen), torch.randn(TOKENS[rank], HIDDEN, generator=gen)


def _ep_vs_one(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    full = MoELayer(_cfg())
    ep = MoELayer(_cfg())
    ep.load_state_dict(full.state_dict())
    ep.to_expert_parallel(EPDispatcher(EXPERTS, group=dist.group.WORLD, payload="fp8", fp8_rows=True))
    x, grad_out = _tokens(rank)
    x_ep = x.clone().requires_grad_()
    out_ep = ep(x_ep)[0]
    (out_ep * grad_out).sum().backward()
    x_full = x.clone().requires_grad_()
    out_full = full(x_full)[0]
    (out_full * grad_out).sum().backward()
    for other in range(world_size):  # the full layer's expert grads see every rank's tokens
        if other != rank:
            y, g = _tokens(other)
            (full(y)[0] * g).sum().backward()
    block = slice(rank * EXPERTS // world_size, (rank + 1) * EXPERTS // world_size)
    return {"out": (out_ep.detach(), out_full.detach()), "x": (x_ep.grad, x_full.grad),
            "w_gate_up": (ep.experts.w_gate_up.grad, full.experts.w_gate_up.grad[block]),
            "w_down": (ep.experts.w_down.grad, full.experts.w_down.grad[block]),
            "router": (ep.router.weight.grad, full.router.weight.grad)}


def test_two_process_fp8_dispatch_into_fp8_experts_matches_one_process_within_fp8_tolerance():
    results = run_processes(_ep_vs_one, WORLD, timeout_s=240)
    for rank, res in enumerate(results):
        for name in ("out", "x"):
            got, want = res[name]
            assert got.shape == want.shape and want.abs().sum() > 0, (rank, name)
            assert calc_diff(got, want) <= EP_OUT_TOL, (rank, name, calc_diff(got, want))
        for name in ("w_gate_up", "w_down"):
            got, want = res[name]
            assert got.shape == want.shape and want.abs().sum() > 0, (rank, name)
            assert 0 < calc_diff(got, want) <= EP_WGRAD_TOL, (rank, name, calc_diff(got, want))
    # EP: each rank's router grad is from its own tokens; the full layer's saw every rank's
    assert calc_diff(sum(res["router"][0] for res in results), results[0]["router"][1]) <= 1e-10
