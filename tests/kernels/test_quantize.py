"""FP8 quantisation: Triton (interpreter) and the torch reference give the bits of a plain torch cast."""

import pytest
import torch

import kernels
from kernels.quant_ref import FP8_MAX, SCALE_EPS, quantize_activation_ref, quantize_weight_ref
from tests.kernels.helpers import GROUP_SIZES, bounds, offsets, same_bits


def cast_tile(tile: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: scale = max(amax, eps) / 448, q = clamp(x / scale, +-448) cast to e4m3."""
    scale = tile.float().abs().max().clamp(min=SCALE_EPS) / FP8_MAX
    return (tile.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def awkward_activations() -> torch.Tensor:
    """Magnitudes from 1e-8 to 1e3 per column, a zero tile, an outlier row, a partial last tile (K=300)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(70, 300, generator=gen) * torch.logspace(-8, 3, 300)
    x[3, :128] = 0.0
    x[5, 5] = 1e30
    x[6, 200:] = -7.0
    return x


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_activation_tiles_equal_a_torch_cast_per_1x128_tile(backend):
    x = awkward_activations()
    q, scale = kernels.quantize_activation(x, backend=backend)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (70, 3) and scale.dtype == torch.float32
    for row in (0, 3, 5, 6, 69):
        for t, (start, end) in enumerate([(0, 128), (128, 256), (256, 300)]):
            expected_q, expected_scale = cast_tile(x[row, start:end])
            assert same_bits(q[row, start:end], expected_q)
            assert scale[row, t] == expected_scale


def test_triton_activation_quantisation_is_bitwise_the_reference():
    x = awkward_activations().bfloat16()
    q, scale = kernels.quantize_activation(x, backend="triton")
    ref_q, ref_scale = quantize_activation_ref(x)
    assert same_bits(q, ref_q) and torch.equal(scale, ref_scale)


def test_every_rounding_case_of_e4m3_matches_torch():
    """Scale 1 (tile amax 448): every e4m3 value, every midpoint (ties to even) and its neighbours,
    subnormals, values that saturate at 448, signed zeros."""
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = finite[finite.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    cases = torch.cat([values, mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1),
                       torch.tensor([1e-30, 2.0**-10, 1e-45, -0.0, 0.0, 447.9, 448.0])])
    cases = torch.cat([cases, -cases])
    rows = -(-cases.numel() // 127)
    body = torch.zeros(rows * 127)
    body[:cases.numel()] = cases
    x = torch.cat([torch.full((rows, 1), FP8_MAX), body.view(rows, 127)], dim=1)
    q, scale = kernels.quantize_activation(x, backend="triton")
    assert torch.equal(scale, torch.ones_like(scale))
    assert same_bits(q, x.to(torch.float8_e4m3fn))


def test_tile_maximum_saturates_to_448_not_nan():
    x = torch.tensor([[3.0e5, -1.0, 2.0e5]])  # x / scale rounds to 448.00003 before the clamp
    q, scale = kernels.quantize_activation(x, backend="triton")
    assert q.float()[0, 0] == FP8_MAX and not q.float().isnan().any()
    assert same_bits(q, quantize_activation_ref(x)[0])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_weight_blocks_equal_a_torch_cast_per_128x128_block(backend):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(2, 200, 300, generator=gen) * torch.logspace(-3, 2, 300)
    q, scale = kernels.quantize_weight(w.bfloat16(), backend=backend)
    assert q.shape == w.shape and scale.shape == (2, 2, 3)
    for g in range(2):
        for i, (r0, r1) in enumerate([(0, 128), (128, 200)]):
            for j, (c0, c1) in enumerate([(0, 128), (128, 256), (256, 300)]):
                expected_q, expected_scale = cast_tile(w.bfloat16()[g, r0:r1, c0:c1])
                assert same_bits(q[g, r0:r1, c0:c1], expected_q)
                assert scale[g, i, j] == expected_scale


def test_triton_weight_quantisation_is_bitwise_the_reference_for_2d_and_3d():
    w = torch.randn(3, 130, 260)
    for weight in (w, w[0]):
        q, scale = kernels.quantize_weight(weight, backend="triton")
        ref_q, ref_scale = quantize_weight_ref(weight)
        assert same_bits(q, ref_q) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_kgrouped_tiles_run_along_tokens_and_restart_at_every_group(backend):
    """Group g's j-th tile is x_g^T's 1x128 tile j, at tile column g + (start_g + 128 j) // 128."""
    x = torch.randn(sum(GROUP_SIZES), 200)
    offs = offsets(GROUP_SIZES)
    q_t, scale = kernels.quantize_activation_kgrouped(x, offs, backend=backend)
    columns = -(-x.shape[0] // 128) + len(GROUP_SIZES)
    assert q_t.shape == (200, 128 * columns) and scale.shape == (200, columns)
    for g, (start, end) in enumerate(bounds(GROUP_SIZES)):
        for j, row in enumerate(range(start, end, 128)):
            column = g + row // 128
            rows = min(128, end - row)
            tile = slice(128 * column, 128 * column + 128)
            for k in (0, 77, 199):
                expected_q, expected_scale = cast_tile(x[row:row + rows, k])
                assert same_bits(q_t[k, tile][:rows], expected_q)
                assert torch.all(q_t[k, tile][rows:].float() == 0)
                assert scale[k, column] == expected_scale
    # e4m3 keeps 3 mantissa bits (relative error <= 2**-4); subnormals are steps of 2**-9 * scale
    torch.testing.assert_close(kernels.dequantize_kgrouped(q_t, scale, offs, x.shape[0]), x, rtol=2**-4,
                               atol=2**-9 * float(scale.max()))


def test_triton_kgrouped_quantisation_is_bitwise_the_reference():
    x = torch.randn(sum(GROUP_SIZES), 200).bfloat16()
    offs = offsets(GROUP_SIZES)
    q_t, scale = kernels.quantize_activation_kgrouped(x, offs, backend="triton")
    ref_q, ref_scale = kernels.quantize_activation_kgrouped(x, offs, backend="torch")
    assert same_bits(q_t, ref_q) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_transposed_weight_blocks_are_the_same_codes_and_scales_k_major(backend):
    """quantize_weight(transposed=True) (dgrad's operand, written so by the quantiser) holds exactly the forward's
    codes transposed, with the very same block scales: dgrad's numerics are those of the old per-call transpose."""
    w = torch.randn(3, 200, 144)
    for weight in (w, w[0]):
        q, scale = kernels.quantize_weight(weight, backend=backend)
        q_t, scale_t = kernels.quantize_weight(weight, transposed=True, backend=backend)
        assert q_t.shape == (*weight.shape[:-2], 144, 200) and q_t.is_contiguous()
        assert same_bits(q_t, q.transpose(-2, -1).contiguous()) and torch.equal(scale_t, scale)
