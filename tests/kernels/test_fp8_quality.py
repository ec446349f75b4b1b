"""FP8 quality that means the same on every machine: each FP8 GEMM (forward, dgrad, wgrad, and the autograd
FP8GroupedLinear that composes them) against float64 on the same inputs, with bounds from the number formats.

An FP8 GEMM's result has two error sources, bounded separately:

1. Quantisation. The e4m3 operands are fixed by the spec (kernels/quant_ref.py's docstring): per 1x128
   activation tile / 128x128 weight block, scale = amax / 448 and q = clamp(x / scale, +-448) cast to e4m3.
   `spec_cast` and the three tilings below are this test's own version of it (torch's cast, no project
   code); the op must use exactly those operands, so a wrong scale, a wrong tile shape or a skipped
   quantisation moves operands by e4m3 steps (2**-4 relative) or more, far outside bound 2.
2. Arithmetic given the operands. The products of e4m3 values times fp32 scales accumulate in fp32 ("fp32
   promotion"). The textbook bound of any fp32 summation order (Higham, Accuracy and Stability, 3.1) is
   |out - exact| <= gamma(n) * (|A| @ |B|) elementwise, gamma(n) = n*u / (1 - n*u), u = 2**-24, n the
   reduction length; n + 4 here covers the dequantisation and scale products. For n <= 512 that is
   <= 3.1e-5 of |A| @ |B|. No ATen kernel choice (ATEN_CPU_CAPABILITY=default|avx2|avx512, MKL's own
   dispatch) can leave it; accumulating in bf16 anywhere ("skipped promotion", u = 2**-8) cannot stay in it.
   Measured: the worst element uses 0.2%-1.9% of the bound, under each of the three settings.

Planted bugs these catch (each passed tests/kernels/test_grouped_gemm.py's calc_diff < 1e-3 checks):
the reference GEMM multiplying in bf16 (off by up to 0.3 where the bound is 3e-3), the weight quantiser
handing each 128-row block the other block's scale.

These hold on CPU tensors (the torch reference, and Triton in its interpreter). Hopper's tensor cores keep
~14 bits inside a 128-slice before promotion; GPU runs need their own bound and are not tested here.
"""

import pytest
import torch

import kernels
from tests.kernels.helpers import GROUP_SIZES, bounds, inputs

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448, from torch, not from the code under test
U32 = 2.0 ** -24
BACKENDS = ["torch", "triton"]
SHAPES = [(256, 128), (208, 96), (160, 208)]  # (K, N), multiples of 16 (Triton TMA); ragged last tiles in the last two,
# and the last has 2 weight blocks along N


def gamma(n: int) -> float:
    """Higham's gamma_n for fp32: the relative bound of an n-term fp32 dot product in any order."""
    return n * U32 / (1 - n * U32)


def spec_cast(tile: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """One tile (amax broadcast over it) quantised per the spec and dequantised exactly, in float64:
    scale = amax / 448 in fp32, q = clamp(x / scale, +-448).to(e4m3), x ~= q * scale."""
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tile.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.double() * scale.double()


def spec_activation(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] in 1x128 tiles along each row (the last one partial)."""
    return torch.cat([spec_cast(t, t.float().abs().amax(dim=1, keepdim=True)) for t in x.split(128, dim=1)], dim=1)


def spec_weight(w: torch.Tensor) -> torch.Tensor:
    """w [G, N, K] in 128x128 blocks of every w[g] (edge blocks partial)."""
    return torch.stack([torch.cat([torch.cat([spec_cast(b, b.float().abs().amax()) for b in band.split(128, dim=1)],
                                             dim=1) for band in wg.split(128, dim=0)]) for wg in w])


def spec_kgrouped(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The wgrad operand x [M, K]: 128x1 tiles along tokens (one scale per column per 128 rows), restarting
    at every group's first row."""
    return torch.cat([spec_cast(t, t.float().abs().amax(dim=0, keepdim=True))
                      for s, e in bounds(sizes) if e > s for t in x[s:e].split(128, dim=0)])


def grouped64(a, b, sizes):
    """out[rows of g] = a[rows of g] @ b[g].T and |a| @ |b[g]|.T, float64."""
    parts = [(a[s:e] @ b[g].t(), a[s:e].abs() @ b[g].abs().t()) for g, (s, e) in enumerate(bounds(sizes))]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def wgrad64(a, b, sizes):
    """dw[g] = a[rows of g].T @ b[rows of g] and its |.| product, float64."""
    parts = [(a[s:e].t() @ b[s:e], a[s:e].abs().t() @ b[s:e].abs()) for s, e in bounds(sizes)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def assert_within_fp32_gemm_bound(got, want, magnitude, n, what, extra_rel=0.0):
    """|got - want| <= gamma(n + 4) * magnitude (+ extra_rel * |want| for a rounded output), elementwise."""
    slack = gamma(n + 4) * magnitude + extra_rel * want.abs()
    excess = (got.double() - want).abs() - slack
    worst = int(excess.flatten().argmax())
    assert float(excess.max()) <= 0, (
        f"{what}: element {worst} is off by {float((got.double() - want).abs().flatten()[worst]):.3e}, over the fp32 "
        f"bound {float(slack.flatten()[worst]):.3e} (gamma({n + 4}) = {gamma(n + 4):.2e} of |A|@|B| = "
        f"{float(magnitude.flatten()[worst]):.3e}); {int((excess > 0).sum())} of {excess.numel()} elements over")


def padded(n: int) -> int:
    return -(-n // 128) * 128


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_forward_dgrad_wgrad_are_fp32_exact_on_the_spec_e4m3_operands(backend, k, n):
    x, w, dy, offs = inputs(GROUP_SIZES, k, n, seed=11)
    out = kernels.fp8_grouped_gemm(*kernels.quantize_activation(x), *kernels.quantize_weight(w), offs, backend=backend)
    want, mag = grouped64(spec_activation(x), spec_weight(w), GROUP_SIZES)
    assert_within_fp32_gemm_bound(out, want, mag, padded(k), "forward")

    dx = kernels.fp8_grouped_gemm_dgrad(*kernels.quantize_activation(dy), *kernels.quantize_weight(w, transposed=True),
                                        offs, backend=backend)
    want, mag = grouped64(spec_activation(dy), spec_weight(w).transpose(1, 2), GROUP_SIZES)
    assert_within_fp32_gemm_bound(dx, want, mag, padded(n), "dgrad")

    dw = kernels.fp8_grouped_gemm_wgrad(*kernels.quantize_activation_kgrouped(dy, offs),
                                        *kernels.quantize_activation_kgrouped(x, offs), offs, backend=backend)
    want, mag = wgrad64(spec_kgrouped(dy, GROUP_SIZES), spec_kgrouped(x, GROUP_SIZES), GROUP_SIZES)
    assert_within_fp32_gemm_bound(dw, want, mag, padded(max(GROUP_SIZES)), "wgrad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_output_adds_only_its_own_rounding(backend):
    """bf16 in, bf16 out (the GPU dtype): the fp32 bound plus one bf16 rounding of the result: 2**-8 relative
    rounding to nearest (torch, and Triton's compiled cast); Triton 3.9's interpreter casts fp32 -> bf16
    toward zero (measured: its result equals the truncated bits), so there one bf16 step, 2**-7."""
    x, w, _, offs = inputs(GROUP_SIZES, 256, 128, seed=12)
    x, w = x.bfloat16(), w.bfloat16()
    out = kernels.fp8_grouped_gemm(*kernels.quantize_activation(x), *kernels.quantize_weight(w), offs,
                                   out_dtype=torch.bfloat16, backend=backend)
    assert out.dtype == torch.bfloat16
    want, mag = grouped64(spec_activation(x), spec_weight(w), GROUP_SIZES)
    bf16_step = 2.0 ** (-8 if backend == "torch" else -7)
    assert_within_fp32_gemm_bound(out, want, mag, 256, "bf16 forward", extra_rel=bf16_step)


@pytest.mark.slow  # takes seconds
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_grouped_linear_output_and_both_grads_are_the_spec_products(backend):
    """The autograd op wires the right operands: out = x_q @ w_q^T, dx = dy_q @ w_q (the forward's 128x128
    blocks, transposed), dw[g] = dy_g^T @ x_g with both in 128-token tiles restarting at every group, x's re-tiled
    from the forward's 1x128 rows (kernels.linear: the e4m3 tiles are what the op keeps)."""
    x, w, dy, offs = inputs(GROUP_SIZES, 208, 96, seed=13)
    x.requires_grad_()
    w.requires_grad_()
    out = kernels.fp8_grouped_linear(x, w, offs, backend=backend)
    out.backward(dy)
    xd, wd = x.detach(), w.detach()
    want, mag = grouped64(spec_activation(xd), spec_weight(wd), GROUP_SIZES)
    assert_within_fp32_gemm_bound(out.detach(), want, mag, padded(208), "linear forward")
    want, mag = grouped64(spec_activation(dy), spec_weight(wd).transpose(1, 2), GROUP_SIZES)
    assert_within_fp32_gemm_bound(x.grad, want, mag, padded(96), "linear dx")
    want, mag = wgrad64(spec_kgrouped(dy, GROUP_SIZES), spec_kgrouped(spec_activation(xd), GROUP_SIZES), GROUP_SIZES)
    assert_within_fp32_gemm_bound(w.grad, want, mag, padded(max(GROUP_SIZES)), "linear dw")


@pytest.mark.parametrize("k,n", SHAPES)
def test_error_against_the_unquantised_product_is_e4m3_rounding_error(k, n):
    """FP8 vs the fp32/float64 product of the unquantised inputs, for each GEMM.

    Bound from the format: round-to-nearest to e4m3's 3 mantissa bits gives each operand a relative error
    d with |d| <= 2**-4 and, for mantissas spread log-uniformly, E[d**2] = (2**-3)**2 / 12 * E[1/m**2]
    = 0.0013 * 0.541 = 7.0e-4. Two independently rounded operands give a relative error variance of
    1.4e-3 in each product term, so calc_diff (~ |err|**2 / (2 |exact|**2)) ~ 7e-4 for these standard-normal
    inputs (measured 6.4e-4..6.9e-4 for every GEMM and shape here, the same under ATEN_CPU_CAPABILITY=default,
    avx2 and avx512). Upper bound 1e-3 (1.4x the model); lower bound 1e-4: an FP8 path that silently ran
    in fp32 would sit near 1e-14.
    """
    x, w, dy, offs = inputs(GROUP_SIZES, k, n, seed=14)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    fwd = kernels.fp8_grouped_gemm(*kernels.quantize_activation(x), *kernels.quantize_weight(w), offs)
    dgrad = kernels.fp8_grouped_gemm_dgrad(*kernels.quantize_activation(dy),
                                           *kernels.quantize_weight(w, transposed=True), offs)
    wgrad = kernels.fp8_grouped_gemm_wgrad(*kernels.quantize_activation_kgrouped(dy, offs),
                                           *kernels.quantize_activation_kgrouped(x, offs), offs)
    for name, got, exact in (("forward", fwd, grouped64(x64, w64, GROUP_SIZES)[0]),
                             ("dgrad", dgrad, grouped64(dy64, w64.transpose(1, 2), GROUP_SIZES)[0]),
                             ("wgrad", wgrad, wgrad64(dy64, x64, GROUP_SIZES)[0])):
        diff = kernels.calc_diff(got.double(), exact)
        assert 1e-4 < diff < 1e-3, (name, diff)
