"""FP8Linear (and FP8GroupedLinear's saved tiles): every GEMM against the float64 product of its quantised operands.

Each path's operands are rebuilt here in float64 from the e4m3 tiles the kernel must have used (x in 1x128 rows for
Fprop, dy in 1x128 rows and w in 128x128 blocks for Dgrad, both re-tiled along tokens for Wgrad), so the only
difference left is the kernel's fp32 arithmetic: products of two e4m3 numbers are exact in fp32, the sums of K terms
round at 2^-24 each, |error| <= K 2^-24 sum|a b| ~ K 2^-24 |out| for same-signed worst cases and ~ sqrt(K) 2^-24
|out| typically; calc_diff ~ (relative error)^2 / 2. Derived bound for K <= 416: (416 * 2^-24)^2 / 2 = 3e-10 worst
case; measured (5 seeds x ATEN_CPU_CAPABILITY = default, avx2, native) 1.5e-14..3.5e-14, so each test asserts 1e-12; a
wrong tiling or stale scale (relative error ~2^-5, calc_diff ~1e-4) fails it by eight orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kernels
from kernels.quant_ref import (dequantize_activation, dequantize_kgrouped, dequantize_weight,
                               quantize_activation_kgrouped_ref)
from kernels.wgrad_defer import WeightGradStore
from tests.syncs import SyncDetector

BOUND = 1e-12  # see the module doc: derived worst case 3e-10, measured <= 3.5e-14
SEEDS = range(5)
M, K, N = 150, 208, 96  # rows over two token tiles, K over two hidden tiles, neither a multiple of 128
PADDING_GAP = 2e-5  # relative to the largest value: a padded call's fp32 sums (K or M terms) may be ordered otherwise
# by the CPU GEMM picking kernels by row count, K 2^-24 = 1.2e-5 at K = 208; measured 0 (5 seeds x ATEN_CPU_CAPABILITY
# = default, avx2, native: bit for bit)


def _data(seed: int, m: int = M) -> tuple[torch.Tensor, kernels.FP8Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=gen) * torch.rand(m, 1, generator=gen) * 4  # rows of unequal scale
    linear = kernels.FP8Linear(K, N)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(N, K, generator=gen) * 0.05)
    return x, linear, torch.randn(m, N, generator=gen)



def _f64_rows(t: torch.Tensor) -> torch.Tensor:
    """t quantised in 1x128 rows and dequantised, in float64."""
    return dequantize_activation(*kernels.quantize_activation(t)).double()


def _f64_kgrouped(t: torch.Tensor) -> torch.Tensor:
    """t quantised in 1x128 tiles along its rows (one group) and dequantised, in float64."""
    offs = torch.tensor([t.shape[0]], dtype=torch.int32)
    return dequantize_kgrouped(*quantize_activation_kgrouped_ref(t, offs), offs, t.shape[0]).double()


def _f64_weight(w: torch.Tensor) -> torch.Tensor:
    return dequantize_weight(*kernels.quantize_weight(w.detach())).double()


def expected(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, retiled: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, dx, dw) as float64 products of the quantised operands; retiled: the wgrad's x is the forward's e4m3
    rows re-tiled along tokens (else x quantised along tokens directly, keep_input's immediate wgrad)."""
    x_rows = dequantize_activation(*kernels.quantize_activation(x))
    x_t = _f64_kgrouped(x_rows if retiled else x)
    return (_f64_rows(x) @ _f64_weight(w).t(), _f64_rows(dy) @ _f64_weight(w), _f64_kgrouped(dy).t() @ x_t)


def path_errors(seed: int) -> dict[str, float]:
    """calc_diff of every path against its float64 product (the measurement behind BOUND)."""
    x, linear, dy = _data(seed)
    want_out, want_dx, want_dw = expected(x, linear.weight, dy)
    errors = {}
    for name, make in (("plain", lambda: x.clone()), ("rows", lambda: kernels.FP8Rows(*kernels.quantize_activation(x), x.clone()))):
        inp = make()
        leaf = inp if isinstance(inp, torch.Tensor) else inp.rows
        leaf.requires_grad_()
        linear.weight.grad = None
        out = linear(inp)
        out.backward(dy)
        errors |= {f"{name} forward": kernels.calc_diff(out, want_out), f"{name} dgrad": kernels.calc_diff(leaf.grad, want_dx),
                   f"{name} wgrad": kernels.calc_diff(linear.weight.grad, want_dw)}
    linear.weight.grad = None
    store = WeightGradStore()
    with store.capture(0):
        linear(x).backward(dy)
    store.run(0)
    errors["deferred wgrad"] = kernels.calc_diff(linear.weight.grad, want_dw)
    heads = x.view(M, 8, 26).requires_grad_()
    linear.weight.grad = None
    linear(heads, fold=2, keep_input=True).backward(dy)
    errors["keep_input wgrad"] = kernels.calc_diff(linear.weight.grad, expected(x, linear.weight, dy, retiled=False)[2])
    return errors


@pytest.mark.parametrize("pre_quantised", [False, True], ids=["tensor", "fp8-rows"])
def test_forward_dgrad_wgrad_equal_the_float64_products_of_their_tiles(pre_quantised):
    for seed in SEEDS:
        x, linear, dy = _data(seed)
        want_out, want_dx, want_dw = expected(x, linear.weight, dy)
        leaf = x.clone().requires_grad_()
        inp = kernels.FP8Rows(*kernels.quantize_activation(x), leaf) if pre_quantised else leaf
        out = linear(inp)
        out.backward(dy)
        assert out.dtype == torch.float32 and out.shape == (M, N)
        assert kernels.calc_diff(out, want_out) < BOUND
        assert kernels.calc_diff(leaf.grad, want_dx) < BOUND
        assert kernels.calc_diff(linear.weight.grad, want_dw) < BOUND


def test_retiling_costs_a_second_rounding_of_the_wgrad_input():
    """The re-tiled wgrad's x (the forward's rows requantised along tokens) against x quantised along tokens once,
    both against the exact fp64 dy^T x. With s2 the mean squared relative rounding of one e4m3 quantisation (derived
    <= 9.4e-4 for 3 mantissa bits, measured ~6.2e-4), calc_diff ~ (s2 of x + s2 of dy) / 2: direct ~ s2, re-tiled
    ~ 1.5 s2 (x rounded twice), derived bound 1.5 x 9.4e-4 = 1.4e-3. Measured over 5 seeds x ATEN_CPU_CAPABILITY
    = default, avx2, native: direct 6.1e-4..6.4e-4, re-tiled 9.2e-4..9.6e-4, re-tiled vs direct 8.8e-4..9.4e-4."""
    for seed in SEEDS:
        x, linear, dy = _data(seed)
        retiled, direct = expected(x, linear.weight, dy)[2], expected(x, linear.weight, dy, retiled=False)[2]
        exact = dy.double().t() @ x.double()
        assert kernels.calc_diff(direct, exact) < kernels.calc_diff(retiled, exact) < 1.4e-3
        assert 0 < kernels.calc_diff(retiled, direct) < 2 * 1.4e-3


def test_deferred_wgrad_holds_e4m3_tiles_and_merges_chunks():
    x, linear, dy = _data(1)
    x2, _, dy2 = _data(2, m=70)
    store = WeightGradStore()
    for key, (rows, grad) in enumerate(((x, dy), (x2, dy2))):
        with store.capture(key):
            linear(rows.clone().requires_grad_()).backward(grad)
    assert linear.weight.grad is None and store.pending() == 2
    q_bytes = M * K + M * 2 * 4 + 70 * K + 70 * 2 * 4  # e4m3 rows and their fp32 scales (2 tiles per row)
    assert store.held_bytes == q_bytes + (M + 70) * N * 4  # and dy; never a dequantised x
    store.run(0, 1)  # one W action for both chunks: one GEMM over their 220 rows
    merged = expected(torch.cat((x, x2)), linear.weight, torch.cat((dy, dy2)))[2]
    assert kernels.calc_diff(linear.weight.grad, merged) < BOUND
    single = linear.weight.grad.clone()
    linear.weight.grad = None
    for key, (rows, grad) in enumerate(((x, dy), (x2, dy2))):
        with store.capture(key):
            linear(rows).backward(grad)
        store.run(key)  # unmerged W actions: one GEMM each, summed
    separate = expected(x, linear.weight, dy)[2] + expected(x2, linear.weight, dy2)[2]
    assert kernels.calc_diff(linear.weight.grad, separate) < BOUND
    assert not torch.equal(single, linear.weight.grad)  # merged tiles span both chunks' rows


def test_keep_input_saves_the_view_and_quantises_it_along_tokens():
    x, linear, dy = _data(3)
    base = x.view(M, 8, 26).clone().requires_grad_()  # [tokens, heads, D], as out's input is of the core's output
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = linear(base, fold=2, keep_input=True)
    assert [t.dtype for t in saved if t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()] == [torch.float32]
    assert not any(t.dtype == kernels.FP8_DTYPE for t in saved)
    out.backward(dy)
    want = expected(x, linear.weight, dy, retiled=False)
    assert kernels.calc_diff(out, want[0]) < BOUND and kernels.calc_diff(linear.weight.grad, want[2]) < BOUND
    linear.weight.grad = None
    store = WeightGradStore()
    with store.capture(0):
        linear(base, fold=2, keep_input=True).backward(dy)
    assert store.held_bytes == M * K + M * 2 * 4 + M * N * 4  # the W action holds e4m3 rows, not the core's output
    store.run(0)
    assert kernels.calc_diff(linear.weight.grad, expected(x, linear.weight, dy)[2]) < BOUND


def test_saved_tensors_are_e4m3_tiles_never_a_float_copy_of_the_input():
    """Plain and grouped FP8 linears save their input's e4m3 tiles and fp32 scales, the weight (as is) and offs."""
    x, linear, _ = _data(4)
    grouped_w = nn.Parameter(torch.randn(3, N, K) * 0.05)
    offs = torch.tensor([50, 50, M], dtype=torch.int32)
    for run in (lambda inp: linear(inp), lambda inp: kernels.fp8_grouped_linear(inp, grouped_w, offs)):
        saved: list[torch.Tensor] = []
        inp = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            run(inp)
        by_dtype: dict[torch.dtype, int] = {}
        for t in saved:
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        weight_bytes = sum(t.nbytes for t in saved if t.dim() == 3 or t.shape == (N, K))
        assert by_dtype[kernels.FP8_DTYPE] == M * K
        assert by_dtype[torch.float32] == weight_bytes + M * 2 * 4  # the weight and the tiles' scales
        assert not any(t.shape == x.shape and t.is_floating_point() and t.dtype != kernels.FP8_DTYPE for t in saved)


def test_fp8_linear_is_an_nn_linear_without_bias():
    linear = kernels.FP8Linear(K, N)
    assert isinstance(linear, nn.Linear) and linear.bias is None and set(linear.state_dict()) == {"weight"}
    with pytest.raises(ValueError, match="no bias"):
        kernels.FP8Linear(K, N, bias=True)
    with pytest.raises(ValueError, match="input width"):
        linear(torch.randn(3, K + 1))


def test_a_grouped_linears_deferred_wgrad_holds_dy_as_its_e4m3_operand_and_equals_the_immediate_one():
    """The routed experts' W action (kernels.linear._weight_grad, grouped): dy is quantised along tokens in B, the
    tiles W reads anyway, so it holds e4m3 tiles of x and of dy (about half dy's bytes) and its dw is bitwise the
    immediate one."""
    torch.manual_seed(0)
    groups, m = 3, 300
    x = torch.randn(m, K)
    w = torch.randn(groups, N, K, requires_grad=True)
    dy = torch.randn(m, N)
    offs = torch.tensor([100, 100, 300], dtype=torch.int32)  # an empty group too
    kernels.fp8_grouped_linear(x, w, offs).backward(dy)
    immediate, w.grad = w.grad, None
    store = WeightGradStore()
    with store.capture(0):
        kernels.fp8_grouped_linear(x, w, offs).backward(dy)
    columns = kernels.quantize_activation_kgrouped(dy, offs)[1].shape[1]  # token tiles restarting at each group
    assert store.held_bytes == m * K + m * 2 * 4 + N * columns * (128 + 4)  # x's rows; dy's token tiles, not dy
    store.run(0)
    assert torch.equal(w.grad, immediate)


def test_padding_rows_past_the_last_group_are_no_data_and_nothing_is_read():
    """Issue 48: FP8 experts behind a padded exchange get rows past their last group (offs[-1] < rows). Forward, dgrad
    and wgrad take the offsets on the device and read nothing to the host (the sync detector, strict: offsets,
    scales and their checks included); the groups' rows, their input grads and the weight grad are those of the same
    rows without the padding (PADDING_GAP: the padding adds nothing to the weight grad's tiles, only the sums' length
    differs), and the padding's outputs and input grads are zero (the reference's; Triton leaves them unwritten)."""
    sizes, pad = [40, 0, 97], 30
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(sum(sizes) + pad, K, generator=gen)
    w = (torch.randn(len(sizes), N, K, generator=gen) * 0.05).requires_grad_()
    dy = torch.randn(sum(sizes) + pad, N, generator=gen)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    runs = {}
    for name, rows in (("padded", x.shape[0]), ("groups only", sum(sizes))):
        leaf = x[:rows].clone().requires_grad_()
        with SyncDetector(strict=True):
            out = kernels.fp8_grouped_linear(leaf, w, offs)
            out.backward(dy[:rows])
        runs[name] = (out.detach(), leaf.grad, w.grad)
        w.grad = None
    (out, dx, dw), (want_out, want_dx, want_dw) = runs["padded"], runs["groups only"]
    assert torch.all(out[-pad:] == 0) and torch.all(dx[-pad:] == 0)
    torch.testing.assert_close(out[:-pad], want_out, rtol=PADDING_GAP, atol=PADDING_GAP * want_out.abs().max())
    torch.testing.assert_close(dx[:-pad], want_dx, rtol=PADDING_GAP, atol=PADDING_GAP * want_dx.abs().max())
    torch.testing.assert_close(dw, want_dw, rtol=PADDING_GAP, atol=PADDING_GAP * want_dw.abs().max())
