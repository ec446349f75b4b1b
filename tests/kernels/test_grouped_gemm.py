"""FP8 grouped GEMMs (forward, dgrad, k-grouped wgrad) against the fp32 product of unquantised inputs."""

import pytest
import torch

import kernels
from kernels import triton_gemm
from kernels.grouped_ref import grouped_rows_matmul
from tests.kernels.helpers import GROUP_SIZES, bounds, inputs, offsets

SHAPES = [(256, 128), (208, 96)]  # (K, N); the second is not a multiple of 128 on either side


def exact_forward(x, w, sizes):
    return torch.cat([x[s:e] @ w[g].t() for g, (s, e) in enumerate(bounds(sizes))])


def exact_dgrad(dy, w, sizes):
    return torch.cat([dy[s:e] @ w[g] for g, (s, e) in enumerate(bounds(sizes))])


def exact_wgrad(dy, x, sizes):
    return torch.stack([dy[s:e].t() @ x[s:e] for s, e in bounds(sizes)])


def forward(x, w, offs, backend, **kw):
    return kernels.fp8_grouped_gemm(*kernels.quantize_activation(x), *kernels.quantize_weight(w), offs,
                                    backend=backend, **kw)


def dgrad(dy, w, offs, backend):
    return kernels.fp8_grouped_gemm_dgrad(*kernels.quantize_activation(dy),
                                          *kernels.quantize_weight(w, transposed=True), offs, backend=backend)


def wgrad(dy, x, offs, backend):
    return kernels.fp8_grouped_gemm_wgrad(*kernels.quantize_activation_kgrouped(dy, offs),
                                          *kernels.quantize_activation_kgrouped(x, offs), offs, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("k,n", SHAPES)
def test_forward_dgrad_wgrad_within_1e_3_of_fp32_with_empty_and_ragged_groups(backend, k, n):
    x, w, dy, offs = inputs(GROUP_SIZES, k, n)
    out = forward(x, w, offs, backend)
    dx = dgrad(dy, w, offs, backend)
    dw = wgrad(dy, x, offs, backend)
    assert out.shape == (x.shape[0], n) and dx.shape == x.shape and dw.shape == w.shape
    assert out.dtype == dx.dtype == dw.dtype == torch.float32
    assert kernels.calc_diff(out, exact_forward(x, w, GROUP_SIZES)) < 1e-3
    assert kernels.calc_diff(dx, exact_dgrad(dy, w, GROUP_SIZES)) < 1e-3
    assert kernels.calc_diff(dw, exact_wgrad(dy, x, GROUP_SIZES)) < 1e-3
    assert torch.all(dw[[0, 4]] == 0)  # empty groups get a zero weight gradient


@pytest.mark.parametrize("k,n", SHAPES)
def test_triton_matches_the_reference_on_the_same_fp8_operands(k, n):
    """Same quantised inputs: only the fp32 summation order differs."""
    x, w, dy, offs = inputs(GROUP_SIZES, k, n, seed=3)
    for op, args in ((forward, (x, w, offs)), (dgrad, (dy, w, offs)), (wgrad, (dy, x, offs))):
        ours, ref = op(*args, backend="triton"), op(*args, backend="torch")
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sizes", [[0, 0, 300], [300]])
def test_bf16_output_and_one_big_group_spanning_several_tiles(sizes):
    x, w, dy, offs = inputs(sizes, 256, 128, seed=4)
    out = forward(x, w, offs, "triton", out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert kernels.calc_diff(out, exact_forward(x, w, sizes)) < 1e-3
    assert kernels.calc_diff(wgrad(dy, x, offs, "triton"), exact_wgrad(dy, x, sizes)) < 1e-3


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_rows_at_all(backend):
    x, w, dy, offs = inputs([0, 0], 256, 128)
    assert forward(x, w, offs, backend).shape == (0, 128)
    assert dgrad(dy, w, offs, backend).shape == (0, 256)
    assert torch.equal(wgrad(dy, x, offs, backend), torch.zeros(2, 128, 256))


def test_offs_of_other_groups_do_not_leak_into_a_group():
    """Rows of group 1 shifted by one: each row's output uses its own group's weight only."""
    x, w, _, _ = inputs([64, 64], 256, 128, seed=5)
    a = forward(x, w, offsets([64, 64]), "triton")
    b = forward(x, w, offsets([65, 63]), "triton")
    torch.testing.assert_close(b[:64], a[:64], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(b[65:], a[65:], rtol=1e-5, atol=1e-4)
    assert kernels.calc_diff(a[64], w[1] @ x[64]) < 1e-3 and kernels.calc_diff(b[64], w[0] @ x[64]) < 1e-3


@pytest.mark.parametrize("tiles", sorted(set(triton_gemm.MGROUPED_TILES[1:] + triton_gemm.KGROUPED_TILES[1:])))
def test_every_autotune_config_matches_the_reference(monkeypatch, tiles):
    """The interpreter runs only the first config; the others (64-row / 64-column tiles) run here."""
    for kernel in (triton_gemm._mgrouped_kernel, triton_gemm._kgrouped_kernel):
        monkeypatch.setattr(kernel, "configs", [triton_gemm.config(*tiles)])
    x, w, dy, offs = inputs(GROUP_SIZES, 208, 96, seed=8)
    for op, args in ((forward, (x, w, offs)), (dgrad, (dy, w, offs)), (wgrad, (dy, x, offs))):
        torch.testing.assert_close(op(*args, backend="triton"), op(*args, backend="torch"), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_dgrad_on_the_second_orientation_is_bitwise_the_per_call_transpose(backend):
    """dgrad reads w's K-major copy from the quantiser; the old path transposed w's codes on every call. Same codes,
    same scales, same kernel: the same bits."""
    _, w, dy, offs = inputs(GROUP_SIZES, 208, 96, seed=9)
    dy_q, dy_scale = kernels.quantize_activation(dy)
    w_q, w_scale = kernels.quantize_weight(w)
    if backend == "triton":
        old = triton_gemm.mgrouped_gemm(dy_q, dy_scale, w_q.transpose(1, 2).contiguous(), w_scale.transpose(1, 2),
                                        offs, torch.float32)
    else:
        old = grouped_rows_matmul(kernels.dequantize_activation(dy_q, dy_scale),
                                  kernels.dequantize_weight(w_q, w_scale).transpose(1, 2), offs)
    assert torch.equal(dgrad(dy, w, offs, backend), old)
