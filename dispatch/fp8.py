"""FP8 (e4m3) payload codec: one fp32 scale per 128 channels, packed with the fp8 bytes in one uint8 row."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 128
E4M3_MAX = 448.0
CHUNK_ROWS = 256  # rows converted at a time: fp32 temporaries stay cache-sized


def scale_blocks(hidden: int) -> int:
    """Number of 128-channel scale blocks of a row of width hidden (the last may be partial)."""
    return math.ceil(hidden / BLOCK)


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one packed fp8 row: hidden e4m3 values plus one fp32 scale per block."""
    return hidden + 4 * scale_blocks(hidden)


def _blocked(x: Tensor) -> Tensor:
    """x [n, H] as [n, blocks, 128], zero-padded only when H is not a multiple of 128."""
    pad = scale_blocks(x.shape[1]) * BLOCK - x.shape[1]
    return (F.pad(x, (0, pad)) if pad else x).view(x.shape[0], scale_blocks(x.shape[1]), BLOCK)


def _quantize_into(q: Tensor, scales: Tensor, x: Tensor) -> None:
    """q [n, H] e4m3 (any row stride), scales [n, blocks] <- x scaled per block, a chunk of rows at a time."""
    x, hidden = x.contiguous(), x.shape[1]
    for start in range(0, x.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        values = _blocked(x[rows].float())  # fp64 is rounded to fp32 first; narrower floats convert exactly
        amax = values.abs().amax(-1)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        scaled = torch.div(values, scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX)
        q[rows].copy_(scaled.view(scaled.shape[0], -1)[:, :hidden])
        scales[rows] = scale


def _dequantize_into(out: Tensor, q: Tensor, scales: Tensor) -> None:
    """out [n, H] <- e4m3 q [n, H] (any row stride) * scale per block, computed in fp32 a chunk at a time.

    On CPU fp8 -> fp32 goes through a 256-entry table (CPU casts fp8 one element at a time, 6x slower);
    elsewhere it is the native cast. Both are exact.
    """
    hidden = q.shape[1]
    on_cpu = q.device.type == "cpu"
    table = torch.arange(256, dtype=torch.uint8, device=q.device).view(torch.float8_e4m3fn).float() if on_cpu else None
    for start in range(0, q.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        if on_cpu:
            codes = q[rows].view(torch.uint8).reshape(-1).long()
            decoded = table.index_select(0, codes).view(-1, hidden)
        else:
            decoded = q[rows].float()
        values = _blocked(decoded).mul_(scales[rows].unsqueeze(-1))
        out[rows].copy_(values.view(values.shape[0], -1)[:, :hidden])


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [n, H] -> (e4m3 [n, H], fp32 scales [n, ceil(H/128)]), scaling each block's amax to 448."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[0], scale_blocks(x.shape[1]), device=x.device)
    _quantize_into(q, scales, x)
    return q, scales


def dequantize_fp8(q: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of quantize_fp8, returned in dtype."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    _dequantize_into(out, q, scales)
    return out


def encode_fp8(x: Tensor) -> Tensor:
    """x [n, H] -> uint8 [n, fp8_row_bytes(H)]: e4m3 bytes then fp32 scale bytes (any transport carries it)."""
    rows, hidden = x.shape
    wire = torch.empty(rows, fp8_row_bytes(hidden), dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, scale_blocks(hidden), device=x.device)
    _quantize_into(wire[:, :hidden].view(torch.float8_e4m3fn), scales, x)
    wire[:, hidden:] = scales.view(torch.uint8).view(rows, 4 * scales.shape[1])
    return wire


def decode_fp8(wire: Tensor, hidden: int, dtype: torch.dtype) -> Tensor:
    """uint8 rows from encode_fp8 -> [n, hidden] in dtype."""
    scales = wire[:, hidden:].contiguous().view(torch.float32)
    return dequantize_fp8(wire[:, :hidden].view(torch.float8_e4m3fn), scales, dtype)
