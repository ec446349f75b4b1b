"""The fp8 payload codec is the kernels' quantiser: it equals the plain formula bit for bit, the old
dispatch rule wherever the two rules agreed (every block with amax >= SCALE_EPS), and the kernels'
documented rule where they did not (single process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dispatch.fp8 import decode_fp8, dequantize_fp8, encode_fp8, quantize_fp8
from kernels.quant_ref import SCALE_EPS

CHUNK_ROWS = 256  # the old codec's chunk: sizes around it still cover partial and whole chunks


def _plain_quantize(x: torch.Tensor, old_rule: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula in one pass over fp32 copies: scale = max(block amax, SCALE_EPS) / 448, q = clamp(x / scale);
    old_rule: the old dispatch codec's scale = amax / 448, or 1 for an all-zero (or NaN) block."""
    rows, hidden = x.shape
    blocks = -(-hidden // 128)
    xf = F.pad(x.float(), (0, blocks * 128 - hidden)).view(rows, blocks, 128)
    amax = xf.abs().amax(-1)
    if old_rule:
        scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    else:
        scales = amax.clamp(min=SCALE_EPS) / 448.0
    q = (xf / scales.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(rows, blocks * 128)[:, :hidden], scales


def _plain_dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, hidden = q.shape
    xf = F.pad(q.float(), (0, scales.shape[1] * 128 - hidden)).view(rows, scales.shape[1], 128) * scales.unsqueeze(-1)
    return xf.view(rows, scales.shape[1] * 128)[:, :hidden].to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits_nan_as_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b equal bit for bit, except that any NaN equals any NaN (sign and payload free): a NaN's payload
    is whatever the CPU kernel torch dispatched to makes of it (the generic kernels' fp8 -> fp32 cast of code
    0x7f gives 0x7ff00000, the AVX2/AVX-512 ones 0x7fc00000), while every other value has one right pattern.
    NaNs are replaced by one NaN pattern on integer views (exact under any kernel) before comparing bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = _SAME_WIDTH_INT[a.element_size()]
    canonical = torch.tensor(float("nan"), dtype=a.dtype).view(ints)

    def canon(t: torch.Tensor) -> torch.Tensor:
        return torch.where(t.isnan(), canonical, t.contiguous().view(ints))

    return torch.equal(canon(a), canon(b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("rows, hidden", [(0, 256), (1, 128), (2 * CHUNK_ROWS + 3, 300), (CHUNK_ROWS, 1024)])
def test_codec_equals_the_plain_formula_bitwise(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
         * 10.0 ** torch.randint(-6, 7, (rows, 1), generator=gen)).to(dtype)
    if rows > 2:
        x[1] = 0.0
        x[2, 5] = float("nan")  # a NaN makes its block's scale and values NaN
    q, scales = quantize_fp8(x)
    want_q, want_scales = _plain_quantize(x)
    assert _same_bits_nan_as_nan(q, want_q) and _same_bits_nan_as_nan(scales, want_scales)
    back = dequantize_fp8(q, scales, dtype)
    assert _same_bits_nan_as_nan(back, _plain_dequantize(want_q, want_scales, dtype))
    wire = encode_fp8(x)  # e4m3 bytes then fp32 scale bytes
    assert wire.dtype == torch.uint8 and wire.shape == (rows, hidden + 4 * want_scales.shape[1])
    assert _same_bits_nan_as_nan(wire[:, :hidden].contiguous().view(torch.float8_e4m3fn), want_q)
    assert _same_bits_nan_as_nan(wire[:, hidden:].contiguous().view(torch.float32), want_scales)
    assert _same_bits_nan_as_nan(decode_fp8(wire, hidden, dtype), back)


def test_every_fp8_code_decodes_like_a_cast():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(2, 128)
    got = dequantize_fp8(codes, torch.ones(2, 1), torch.float32)
    assert _same_bits_nan_as_nan(got, codes.float())  # NaN codes decode to NaN (of any payload)
    assert got.isnan().sum() == 2 and got.view(-1)[[0x7F, 0xFF]].isnan().all()


def test_old_rule_and_new_rule_agree_except_on_blocks_below_the_scale_floor():
    """Rows of 3 blocks: normal values, all zeros, and a tiny block (amax 1e-20 < SCALE_EPS)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 384, generator=gen)
    x[:, 128:256] = 0.0
    x[:, 256:] *= 1e-20
    q, scales = quantize_fp8(x)
    old_q, old_scales = _plain_quantize(x, old_rule=True)
    agree = slice(0, 128)
    assert torch.equal(_bits(q[:, agree]), _bits(old_q[:, agree])) and torch.equal(scales[:, 0], old_scales[:, 0])
    # all-zero block: the old rule's scale 1, the kernels' SCALE_EPS / 448; both give zero codes and decode to 0
    assert torch.equal(old_scales[:, 1], torch.ones(4)) and torch.equal(scales[:, 1], torch.full((4,), SCALE_EPS / 448))
    assert not q[:, 128:256].float().any() and not old_q[:, 128:256].float().any()
    assert not dequantize_fp8(q, scales, torch.float32)[:, 128:256].any()
    # below the floor the scale stays SCALE_EPS / 448, so values this small flush to e4m3 zero instead of
    # the old rule's amax / 448 (which underflows to a zero scale, and x / 0, for amax below ~6e-43)
    assert torch.equal(scales[:, 2], torch.full((4,), SCALE_EPS / 448)) and not q[:, 256:].float().any()
    assert (old_scales[:, 2] < SCALE_EPS / 448).all()  # the old rule scaled them up to +-448
