"""FP8 (e4m3) payload codec over the kernels' one quantiser (1x128 tiles, kernels.quant_ref's rule), packed
with its fp32 scales in one uint8 row; whole tensors at once (no loop over rows)."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import FP8_DTYPE, dequantize_activation, quantize_activation
from kernels.quant_ref import num_tiles


def scale_blocks(hidden: int) -> int:
    """Number of 128-channel scale blocks of a row of width hidden (the last may be partial)."""
    return num_tiles(hidden)


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one packed fp8 row: hidden e4m3 values plus one fp32 scale per block."""
    return hidden + 4 * scale_blocks(hidden)


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [n, H] -> (e4m3 [n, H], fp32 scales [n, ceil(H/128)]): kernels.quantize_activation (fp64 is
    rounded to fp32 first; narrower floats convert exactly)."""
    return quantize_activation(x.float() if x.dtype == torch.float64 else x)


def dequantize_fp8(q: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of quantize_fp8 (q * scale in fp32), returned in dtype."""
    return dequantize_activation(q, scales).to(dtype)


def encode_fp8(x: Tensor) -> Tensor:
    """x [n, H] -> uint8 [n, fp8_row_bytes(H)]: e4m3 bytes then fp32 scale bytes (any transport carries it)."""
    q, scales = quantize_fp8(x)
    # no rows (a rank without tokens): an empty tensor counts as contiguous with any strides, so give it fresh ones
    scales = scales.contiguous() if scales.shape[0] else scales.new_empty(scales.shape)
    return torch.cat([q.view(torch.uint8), scales.view(torch.uint8)], dim=1)


def split_fp8(wire: Tensor, hidden: int, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """uint8 rows from encode_fp8 (those at `rows`, when given) -> contiguous (e4m3 [n, hidden], fp32 scales)."""
    q, scales = wire[:, :hidden], wire[:, hidden:]
    if rows is not None:
        q, scales = q.index_select(0, rows), scales.index_select(0, rows)
    return q.contiguous().view(FP8_DTYPE), scales.contiguous().view(torch.float32)


def decode_fp8(wire: Tensor, hidden: int, dtype: torch.dtype) -> Tensor:
    """uint8 rows from encode_fp8 -> [n, hidden] in dtype."""
    return dequantize_fp8(*split_fp8(wire, hidden), dtype)
