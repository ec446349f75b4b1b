"""Plain-torch FP8 (e4m3) quantisation: 1x128 activation tiles, 128x128 weight blocks, and their inverses.

Every tile gets scale = max(amax, SCALE_EPS) / 448 and q = clamp(x / scale, -448, 448) cast to
torch.float8_e4m3fn, so x ~= q * scale. The Triton kernels produce the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fp8_format import ALIGN, FP8_MAX, SCALE_EPS, TILE  # noqa: F401 (re-exported)

FP8_DTYPE = torch.float8_e4m3fn


def num_tiles(n: int) -> int:
    """How many 128-wide tiles cover n elements."""
    return -(-n // TILE)


def kgrouped_columns(m: int, groups: int) -> int:
    """Tile columns of the k-grouped layout: enough for m rows split into `groups` unaligned groups."""
    return num_tiles(m) + groups


def _pad_to_tiles(x: Tensor, dim: int) -> Tensor:
    pad = num_tiles(x.shape[dim]) * TILE - x.shape[dim]
    if pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, pad]
    return F.pad(x, widths)


def _scale_of(amax: Tensor) -> Tensor:
    return amax.clamp(min=SCALE_EPS) / FP8_MAX


def _cast(scaled: Tensor) -> Tensor:
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_activation_ref(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (q e4m3 [M, K], scale fp32 [M, ceil(K/128)]), one scale per 1x128 tile."""
    m, k = x.shape
    tiles = _pad_to_tiles(x.float(), 1).view(m, num_tiles(k), TILE)
    scale = _scale_of(tiles.abs().amax(dim=2))
    q = _cast(tiles / scale[:, :, None]).view(m, num_tiles(k) * TILE)[:, :k]
    return q.contiguous(), scale


def quantize_weight_ref(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., N, K] -> (q e4m3 [..., N, K], scale fp32 [..., ceil(N/128), ceil(K/128)]), 128x128 blocks."""
    *lead, n, k = w.shape
    padded = _pad_to_tiles(_pad_to_tiles(w.float(), -1), -2)
    nt, kt = num_tiles(n), num_tiles(k)
    blocks = padded.reshape(*lead, nt, TILE, kt, TILE)
    scale = _scale_of(blocks.abs().amax(dim=(-3, -1)))
    q = _cast(blocks / scale[..., :, None, :, None]).reshape(*lead, nt * TILE, kt * TILE)
    return q[..., :n, :k].contiguous(), scale


def row_groups(offs: Tensor, rows: int) -> Tensor:
    """[rows] int64: the group of each row from the cumulative group ends offs [G] (rows from offs[-1] on: G, in no
    group), computed on offs' device: no host read."""
    return torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)


def quantize_weight_t_ref(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., N, K] -> (q_t e4m3 [..., K, N], scale fp32 [..., ceil(N/128), ceil(K/128)]): quantize_weight_ref's
    blocks and scales, the codes stored in the other orientation (K-major for dgrad, which reduces over N); the
    scales stay in w's block order, shared with the forward's copy."""
    q, scale = quantize_weight_ref(w)
    return q.transpose(-2, -1).contiguous(), scale


def kgrouped_rows(offs: Tensor, m: int) -> Tensor:
    """Position of each of the m rows in the k-grouped layout: the tile starting at row r of group g
    is tile column g + r // 128, so groups never share a tile and no offsets need a host sync. Rows past
    offs[-1] (padding, in no group) take the places a group G after the last would: tile columns from
    G + offs[-1] // 128 on, inside the layout's ceil(m / 128) + G."""
    group = row_groups(offs, m)
    starts = torch.cat([offs.new_zeros(1), offs]).long()[group]
    within = torch.arange(m, device=offs.device) - starts
    column = group + starts // TILE + within // TILE
    return column * TILE + within % TILE


def quantize_activation_kgrouped_ref(x: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] rows sorted by group -> (q_t e4m3 [K, 128*T], scale fp32 [K, T]): x^T in 1x128 tiles
    along tokens that restart at every group (zero-padded), T = ceil(M/128) + G; the wgrad operand. Rows past
    offs[-1] (padding) are left out: their tiles hold zeros, as every tile no group fills."""
    m, k = x.shape
    columns = kgrouped_columns(m, offs.numel())
    padded = x.new_zeros(columns * TILE, k, dtype=torch.float32)
    grouped = torch.arange(m, device=x.device) < offs[-1:].long()  # [M] in a group (offs[-1] read on the device)
    padded[kgrouped_rows(offs, m)] = torch.where(grouped.unsqueeze(1), x.float(), 0)
    tiles = padded.t().reshape(k, columns, TILE)
    scale = _scale_of(tiles.abs().amax(dim=2))
    q = _cast(tiles / scale[:, :, None]).reshape(k, columns * TILE)
    return q.contiguous(), scale


def retile_kgrouped_ref(x_q: Tensor, x_scale: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """The forward's e4m3 rows x_q [M, K] (1x128 tiles along K, scales [M, ceil(K/128)]) re-tiled into the
    k-grouped layout of quantize_activation_kgrouped_ref: (q_t e4m3 [K, 128*T], scale fp32 [K, T]).

    By definition the k-grouped quantisation of the dequantised rows; the Triton kernel gives the same bits
    without the fp32 [M, K] copy (it dequantises in registers)."""
    return quantize_activation_kgrouped_ref(dequantize_activation(x_q, x_scale), offs)


def dequantize_activation(q: Tensor, scale: Tensor) -> Tensor:
    """Inverse of quantize_activation: q [M, K] * per-1x128-tile scale -> fp32 [M, K]."""
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(TILE, dim=-1)[..., :k]


def dequantize_weight(q: Tensor, scale: Tensor) -> Tensor:
    """Inverse of quantize_weight: q [..., N, K] * per-128x128-block scale -> fp32 [..., N, K]."""
    n, k = q.shape[-2:]
    full = scale.repeat_interleave(TILE, dim=-2).repeat_interleave(TILE, dim=-1)
    return q.float() * full[..., :n, :k]


def dequantize_weight_t(q_t: Tensor, scale: Tensor) -> Tensor:
    """Inverse of quantize_weight_t: q_t [..., K, N] with w's block scales [..., ceil(N/128), ceil(K/128)] -> fp32
    [..., K, N], deq(w) transposed (the same products, element by element)."""
    return dequantize_weight(q_t, scale.transpose(-2, -1))


def dequantize_kgrouped(q_t: Tensor, scale: Tensor, offs: Tensor, rows: int | None = None) -> Tensor:
    """Inverse of quantize_activation_kgrouped: back to fp32 rows [rows, K], rows past offs[-1] zero (rows: default
    the most the layout holds, 128 (T - G), which the layout's shape gives: no host read)."""
    rows = TILE * (scale.shape[1] - offs.numel()) if rows is None else rows
    return dequantize_activation(q_t, scale)[:, kgrouped_rows(offs, rows)].t()
