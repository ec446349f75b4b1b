"""FP8 (e4m3) payload codec: one fp32 scale per 128 channels, packed with the fp8 bytes in one uint8 row."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 128
E4M3_MAX = 448.0


def scale_blocks(hidden: int) -> int:
    """Number of 128-channel scale blocks of a row of width hidden (the last may be partial)."""
    return math.ceil(hidden / BLOCK)


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one packed fp8 row: hidden e4m3 values plus one fp32 scale per block."""
    return hidden + 4 * scale_blocks(hidden)


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [n, H] -> (e4m3 [n, H], fp32 scales [n, ceil(H/128)]), scaling each block's amax to 448."""
    rows, hidden = x.shape
    blocks = scale_blocks(hidden)
    xf = F.pad(x.float(), (0, blocks * BLOCK - hidden)).view(rows, blocks, BLOCK)
    amax = xf.abs().amax(-1)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (xf / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(rows, blocks * BLOCK)[:, :hidden], scales


def dequantize_fp8(q: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of quantize_fp8, returned in dtype."""
    rows, hidden = q.shape
    blocks = scales.shape[1]
    xf = F.pad(q.float(), (0, blocks * BLOCK - hidden)).view(rows, blocks, BLOCK) * scales.unsqueeze(-1)
    return xf.view(rows, blocks * BLOCK)[:, :hidden].to(dtype)


def encode_fp8(x: Tensor) -> Tensor:
    """x [n, H] -> uint8 [n, fp8_row_bytes(H)]: e4m3 bytes then fp32 scale bytes (any transport carries it)."""
    q, scales = quantize_fp8(x)
    return torch.cat([q.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8)], dim=1)


def decode_fp8(wire: Tensor, hidden: int, dtype: torch.dtype) -> Tensor:
    """uint8 rows from encode_fp8 -> [n, hidden] in dtype."""
    q = wire[:, :hidden].contiguous().view(torch.float8_e4m3fn)
    scales = wire[:, hidden:].contiguous().view(torch.float32)
    return dequantize_fp8(q, scales, dtype)
