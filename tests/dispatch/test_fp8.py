"""The chunked fp8 codec equals the plain formula bit for bit (single process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dispatch.fp8 import CHUNK_ROWS, decode_fp8, dequantize_fp8, encode_fp8, quantize_fp8


def _plain_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula in one pass over fp32 copies: scale = block amax / 448, q = clamp(x / scale)."""
    rows, hidden = x.shape
    blocks = -(-hidden // 128)
    xf = F.pad(x.float(), (0, blocks * 128 - hidden)).view(rows, blocks, 128)
    amax = xf.abs().amax(-1)
    scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (xf / scales.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(rows, blocks * 128)[:, :hidden], scales


def _plain_dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, hidden = q.shape
    xf = F.pad(q.float(), (0, scales.shape[1] * 128 - hidden)).view(rows, scales.shape[1], 128) * scales.unsqueeze(-1)
    return xf.view(rows, scales.shape[1] * 128)[:, :hidden].to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("rows, hidden", [(0, 256), (1, 128), (2 * CHUNK_ROWS + 3, 300), (CHUNK_ROWS, 1024)])
def test_codec_equals_the_plain_formula_bitwise(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
         * 10.0 ** torch.randint(-6, 7, (rows, 1), generator=gen)).to(dtype)
    if rows > 2:
        x[1] = 0.0
        x[2, 5] = float("nan")  # NaN stays NaN (its block's scale too)
    q, scales = quantize_fp8(x)
    want_q, want_scales = _plain_quantize(x)
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(_bits(scales), _bits(want_scales))
    back = dequantize_fp8(q, scales, dtype)
    assert torch.equal(_bits(back), _bits(_plain_dequantize(want_q, want_scales, dtype)))
    wire = encode_fp8(x)
    assert torch.equal(wire, torch.cat([_bits(want_q), _bits(want_scales)], 1))
    assert torch.equal(_bits(decode_fp8(wire, hidden, dtype)), _bits(back))


def test_every_fp8_code_decodes_like_a_cast():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(2, 128)
    got = dequantize_fp8(codes, torch.ones(2, 1), torch.float32)
    assert torch.equal(_bits(got), _bits(codes.float()))  # NaN codes included
