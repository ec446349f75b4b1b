"""retile_kgrouped: the forward's e4m3 rows re-tiled into the k-grouped wgrad layout, bit for bit what
dequantize_activation followed by quantize_activation_kgrouped gave (the reference, Triton, and the meta shapes)."""

import pytest
import torch

import kernels
from kernels.quant_ref import (
    dequantize_activation,
    quantize_activation_kgrouped_ref,
    retile_kgrouped_ref,
)
from tests.kernels.helpers import GROUP_SIZES, offsets, same_bits

# (group sizes, K): K not a multiple of 128, empty groups (first, middle, last), M not a multiple of 128
SHAPES = [(GROUP_SIZES, 300), ([0, 5, 0], 77), ([128, 0, 129, 3], 256), ([1], 130)]


def e4m3_rows(sizes: list[int], k: int, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_q, x_scale of rows whose 128-blocks of K differ in magnitude by up to 1e11 (a wrong block's scale shows),
    with a zero tile, an outlier and tiny values (e4m3 subnormals), and offs."""
    gen = torch.Generator().manual_seed(k + sum(sizes))
    x = torch.randn(sum(sizes), k, generator=gen) * torch.logspace(-8, 3, k)
    if x.shape[0] > 6:
        x[3, :min(k, 128)] = 0.0
        x[5, k // 2] = 1e30
        x[6, :16] *= 1e-6
    x_q, x_scale = kernels.quantize_activation(x, backend=backend)  # Triton's scales are stored tile-major
    return x_q, x_scale, offsets(sizes)


@pytest.mark.parametrize(("sizes", "k"), SHAPES)
def test_reference_is_dequantise_then_quantise_kgrouped(sizes, k):
    x_q, x_scale, offs = e4m3_rows(sizes, k)
    q_t, scale = retile_kgrouped_ref(x_q, x_scale, offs)
    want_q, want_scale = quantize_activation_kgrouped_ref(dequantize_activation(x_q, x_scale), offs)
    assert same_bits(q_t, want_q) and torch.equal(scale, want_scale)
    q_t, scale = kernels.retile_kgrouped(x_q, x_scale, offs)  # the public op on CPU tensors: the reference
    assert same_bits(q_t, want_q) and torch.equal(scale, want_scale)


@pytest.mark.parametrize(("sizes", "k"), SHAPES)
@pytest.mark.parametrize("scales_from", ["torch", "triton"])
def test_triton_retiling_is_bitwise_the_reference(sizes, k, scales_from):
    x_q, x_scale, offs = e4m3_rows(sizes, k, scales_from)
    q_t, scale = kernels.retile_kgrouped(x_q, x_scale, offs, backend="triton")
    ref_q, ref_scale = retile_kgrouped_ref(x_q, x_scale, offs)
    assert same_bits(q_t, ref_q) and torch.equal(scale, ref_scale)


def test_triton_decodes_every_finite_e4m3_code_as_torch_does():
    """All 254 finite codes (subnormals and -0 included) in two groups, with scales that are not powers of two."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[codes.view(torch.float8_e4m3fn).float().isfinite()]
    pairs = finite.view(127, 2).t().repeat(1, 2)  # [2, 254]
    x_q = torch.cat([pairs, pairs.flip(1)]).view(torch.float8_e4m3fn)  # [4, 254]
    x_scale = torch.tensor([[0.3, 7.0], [1.0, 1e-3], [3.1, 2.0**-20], [448.0, 5.5]])
    offs = offsets([3, 1])
    q_t, scale = kernels.retile_kgrouped(x_q, x_scale, offs, backend="triton")
    ref_q, ref_scale = retile_kgrouped_ref(x_q, x_scale, offs)
    assert same_bits(q_t, ref_q) and torch.equal(scale, ref_scale)


def test_meta_outputs_are_the_references():
    x_q, x_scale, offs = e4m3_rows(GROUP_SIZES, 300)
    real = kernels.retile_kgrouped(x_q, x_scale, offs)
    meta = kernels.retile_kgrouped(*(t.to("meta") for t in (x_q, x_scale, offs)))
    assert [(t.shape, t.dtype, t.device.type) for t in meta] == [(t.shape, t.dtype, "meta") for t in real]


def test_bad_inputs_are_named():
    x_q, x_scale, offs = e4m3_rows([3, 4], 200)
    with pytest.raises(ValueError, match="x_q has dtype"):
        kernels.retile_kgrouped(x_q.float(), x_scale, offs)
    with pytest.raises(ValueError, match=r"x_scale must have shape \(7, 2\)"):
        kernels.retile_kgrouped(x_q, x_scale[:, :1], offs)
    with pytest.raises(ValueError, match="offs must end at most at the number of rows M = 7"):  # (fewer: padding)
        kernels.retile_kgrouped(x_q, x_scale, offsets([3, 5]))
