"""Triton FP8 quantisation kernels: 1x128 activation tiles, 128x128 weight blocks, k-grouped wgrad tiles."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import quant_ref
from kernels.quant_ref import FP8_DTYPE, kgrouped_columns, num_tiles
from kernels.triton_common import (
    TILE,
    e4m3_value,
    locate_tile,
    quantize_codes,
    tile_scale,
)

ROWS_PER_PROGRAM = 32
COLUMNS_PER_PROGRAM = 64


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sk,
                          BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kt = tl.program_id(1)
    cols = kt * TILE + tl.arange(0, TILE)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tile_scale(tl.max(tl.abs(x), axis=1))
    tl.store(q_ptr + r64[:, None] * stride_qm + cols[None, :], quantize_codes(x, scale[:, None]), mask=mask)
    tl.store(s_ptr + r64 * stride_sm + kt * stride_sk, scale, mask=row_ok)


@triton.jit
def _quantize_blocks_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wg, stride_wn, stride_qg, stride_qn, stride_qk,
                            stride_sg, stride_sn):
    # q's strides place code (n, k): (stride_qn, 1) for the [G, N, K] orientation, (1, stride_qk) for [G, K, N]
    g = tl.program_id(0).to(tl.int64)
    nt = tl.program_id(1)
    kt = tl.program_id(2)
    rows = (nt * TILE + tl.arange(0, TILE)).to(tl.int64)
    cols = kt * TILE + tl.arange(0, TILE)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + g * stride_wg + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    w = w.to(tl.float32)
    scale = tile_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
    q_ptrs = q_ptr + g * stride_qg + rows[:, None] * stride_qn + cols.to(tl.int64)[None, :] * stride_qk
    tl.store(q_ptrs, quantize_codes(w, scale), mask=mask)
    tl.store(s_ptr + g * stride_sg + nt * stride_sn + kt, scale)


@triton.jit
def _kgrouped_block(offs_ptr, K, G, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr):
    """This program's block of a k-grouped launch: its tile column, the tile's 128 source rows (of one group), its
    BLOCK_K columns of K, and which rows (inside the group) and columns exist."""
    tile = tl.program_id(0)
    _, row0, end, _ = locate_tile(tile, offs_ptr, G, TILE, G_POW2)
    rows = (row0 + tl.arange(0, TILE)).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    return tile, rows, ks, rows < end, ks < K


@triton.jit
def _store_kgrouped(x, tile, ks, k_ok, q_ptr, s_ptr, stride_qk, stride_sk, stride_st):
    """Quantise fp32 x [128 rows, BLOCK_K] (zeros outside the group) in 1x128 tiles along the rows and store
    it transposed at tile column `tile` of q_t [K, 128 T], its scales at column `tile` of scale [K, T]."""
    scale = tile_scale(tl.max(tl.abs(x), axis=0))
    codes = tl.trans(quantize_codes(x, scale[None, :]))
    k64 = ks.to(tl.int64)
    columns = tile.to(tl.int64) * TILE + tl.arange(0, TILE)
    tl.store(q_ptr + k64[:, None] * stride_qk + columns[None, :], codes, mask=k_ok[:, None])
    tl.store(s_ptr + k64 * stride_sk + tile * stride_st, scale, mask=k_ok)


@triton.jit
def _quantize_kgrouped_kernel(x_ptr, offs_ptr, q_ptr, s_ptr, K, G, stride_xm, stride_qk, stride_sk, stride_st,
                              BLOCK_K: tl.constexpr, G_POW2: tl.constexpr):
    tile, rows, ks, row_ok, k_ok = _kgrouped_block(offs_ptr, K, G, BLOCK_K, G_POW2)
    mask = row_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    _store_kgrouped(x, tile, ks, k_ok, q_ptr, s_ptr, stride_qk, stride_sk, stride_st)


@triton.jit
def _retile_kgrouped_kernel(x_ptr, xs_ptr, offs_ptr, q_ptr, s_ptr, K, G, stride_xm, stride_xsm, stride_xsk,
                            stride_qk, stride_sk, stride_st, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr):
    """_quantize_kgrouped_kernel on e4m3 rows: codes and their row tile's scale (one 128-block of K holds the
    program's BLOCK_K columns) are dequantised in registers, as quant_ref.dequantize_activation computes them."""
    tl.static_assert(TILE % BLOCK_K == 0)
    tile, rows, ks, row_ok, k_ok = _kgrouped_block(offs_ptr, K, G, BLOCK_K, G_POW2)
    mask = row_ok[:, None] & k_ok[None, :]
    codes = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0)
    kt = tl.program_id(1) * BLOCK_K // TILE
    row_scale = tl.load(xs_ptr + rows * stride_xsm + kt * stride_xsk, mask=row_ok, other=0.0)
    x = e4m3_value(codes) * row_scale[:, None]
    _store_kgrouped(x, tile, ks, k_ok, q_ptr, s_ptr, stride_qk, stride_sk, stride_st)


def quantize_activation(x: Tensor) -> tuple[Tensor, Tensor]:
    """Triton version of quant_ref.quantize_activation_ref; scales are stored tile-major ([M, K/128] view
    of [K/128, M] memory) so the GEMM reads a row tile's scales with one coalesced load."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_tiles(k), m, dtype=torch.float32, device=x.device).t()
    if m:
        grid = (triton.cdiv(m, ROWS_PER_PROGRAM), num_tiles(k))
        _quantize_rows_kernel[grid](x, q.view(torch.uint8), scale, m, k, x.stride(0), q.stride(0), scale.stride(0),
                                    scale.stride(1), BLOCK_M=ROWS_PER_PROGRAM)
    return q, scale


def _quantize_blocks(w: Tensor, transposed: bool) -> tuple[Tensor, Tensor]:
    """w [..., N, K] -> e4m3 codes [..., N, K] (or [..., K, N] if transposed) and the 128x128 block scales
    [..., ceil(N/128), ceil(K/128)], which are the same in either orientation."""
    stacked = w.contiguous().reshape(-1, *w.shape[-2:])
    groups, n, k = stacked.shape
    q = torch.empty((groups, k, n) if transposed else (groups, n, k), dtype=FP8_DTYPE, device=w.device)
    q_nk = q.transpose(1, 2) if transposed else q  # indexed (g, n, k) either way
    scale = torch.empty(groups, num_tiles(n), num_tiles(k), dtype=torch.float32, device=w.device)
    if q.numel():
        _quantize_blocks_kernel[(groups, num_tiles(n), num_tiles(k))](
            stacked, q.view(torch.uint8), scale, n, k, stacked.stride(0), stacked.stride(1),
            q_nk.stride(0), q_nk.stride(1), q_nk.stride(2), scale.stride(0), scale.stride(1), num_warps=8)
    return q.view(*w.shape[:-2], *q.shape[1:]), scale.view(*w.shape[:-2], num_tiles(n), num_tiles(k))


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """Triton version of quant_ref.quantize_weight_ref, for w [N, K] or [G, N, K]."""
    return _quantize_blocks(w, transposed=False)


def quantize_weight_t(w: Tensor) -> tuple[Tensor, Tensor]:
    """Triton version of quant_ref.quantize_weight_t_ref: the same blocks written K-major for dgrad ([..., K, N]),
    with no transpose pass."""
    return _quantize_blocks(w, transposed=True)


def _kgrouped_outputs(m: int, k: int, groups: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Empty q_t e4m3 [K, 128 T] and scales [K, T] stored tile-major, T = ceil(M/128) + groups."""
    columns = kgrouped_columns(m, groups)
    q_t = torch.empty(k, columns * quant_ref.TILE, dtype=FP8_DTYPE, device=device)
    return q_t, torch.empty(columns, k, dtype=torch.float32, device=device).t()


def quantize_activation_kgrouped(x: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """Triton version of quant_ref.quantize_activation_kgrouped_ref (scales stored tile-major)."""
    x = x.contiguous()
    m, k = x.shape
    groups = offs.numel()
    q_t, scale = _kgrouped_outputs(m, k, groups, x.device)
    grid = (scale.shape[1], triton.cdiv(k, COLUMNS_PER_PROGRAM))
    _quantize_kgrouped_kernel[grid](x, offs, q_t.view(torch.uint8), scale, k, groups, x.stride(0), q_t.stride(0),
                                    scale.stride(0), scale.stride(1), BLOCK_K=COLUMNS_PER_PROGRAM,
                                    G_POW2=triton.next_power_of_2(groups), num_warps=8)
    return q_t, scale


def retile_kgrouped(x_q: Tensor, x_scale: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """Triton version of quant_ref.retile_kgrouped_ref (scales stored tile-major); x_scale in any strides (the
    tile-major ones of quantize_activation included)."""
    x_q = x_q.contiguous()
    m, k = x_q.shape
    groups = offs.numel()
    q_t, scale = _kgrouped_outputs(m, k, groups, x_q.device)
    grid = (scale.shape[1], triton.cdiv(k, COLUMNS_PER_PROGRAM))
    _retile_kgrouped_kernel[grid](x_q.view(torch.uint8), x_scale, offs, q_t.view(torch.uint8), scale, k, groups,
                                  x_q.stride(0), x_scale.stride(0), x_scale.stride(1), q_t.stride(0),
                                  scale.stride(0), scale.stride(1), BLOCK_K=COLUMNS_PER_PROGRAM,
                                  G_POW2=triton.next_power_of_2(groups), num_warps=8)
    return q_t, scale
