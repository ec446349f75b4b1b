"""Triton FP8 grouped GEMMs with fp32 promotion every 128 of K: forward/dgrad (m-grouped) and wgrad (k-grouped).

Both operands are K-major e4m3; each 128-wide K slice is multiplied on the tensor cores and then
scaled into an fp32 accumulator: acc += dot(a_slice, b_slice.T) * row_scale[:, None] * col_scale[None, :].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import quant_ref
from kernels.triton_common import INTERPRET, TILE, kgrouped_walk_tile, walk_size, walk_tile


def _set_blocks(nargs: dict) -> None:
    """Autotune pre-hook: the TMA descriptors load [BLOCK_M, 128] and [BLOCK_N, 128] tiles."""
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], quant_ref.TILE]
    nargs["b_desc"].block_shape = [nargs["BLOCK_N"], quant_ref.TILE]


def config(block_m: int, block_n: int, num_warps: int, num_stages: int) -> triton.Config:
    """An autotune config of either GEMM; BLOCK_N must divide 128."""
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages,
                         pre_hook=_set_blocks)


# (BLOCK_M, BLOCK_N, warps, stages) for H100; the interpreter takes the first (it cannot autotune)
MGROUPED_TILES = [(128, 128, 8, 4), (128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4)]
KGROUPED_TILES = [(128, 128, 8, 4), (128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4)]
_MGROUPED_CONFIGS = [config(*tile) for tile in MGROUPED_TILES[:1 if INTERPRET else None]]
_KGROUPED_CONFIGS = [config(*tile) for tile in KGROUPED_TILES[:1 if INTERPRET else None]]
GROUP_M = tl.constexpr(8)
TMA_ALIGN = quant_ref.ALIGN  # bytes = e4m3 elements: TMA needs every row stride to be a multiple of 16 bytes


@triton.autotune(configs=_MGROUPED_CONFIGS, key=["N", "K", "M_BUCKET"])
@triton.jit
def _mgrouped_kernel(a_desc, as_ptr, b_desc, bs_ptr, offs_ptr, c_ptr, M, N, K, G, M_BUCKET,
                     stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk, stride_cm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G_POW2: tl.constexpr):
    # a_desc: TMA over a [M, K]; b_desc: TMA over b viewed as [G*N, K]. Rows a tile reads past its group
    # (or past b[g]) only feed outputs that the masked store drops; reads past the tensor are zeros.
    # M_BUCKET (next power of two of M) only keys the autotuner. One program per tile of the shared walk
    # (triton_common.walk_tile: the persistent Gluon kernels walk the same tiles in the same order).
    g, row0, end, tile_n, valid = walk_tile(tl.program_id(0), offs_ptr, M, N, G, BLOCK_M, BLOCK_N, GROUP_M, G_POW2)
    # BLOCK_N divides 128, so a column tile lies in one weight block: its scale is a scalar per K slice
    tl.static_assert(TILE % BLOCK_N == 0)
    if valid:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        b_row0 = g * N + tile_n * BLOCK_N
        sa_ptrs = as_ptr + tl.minimum(rows, M - 1).to(tl.int64) * stride_asm
        sb_ptr = bs_ptr + g.to(tl.int64) * stride_bsg + (tile_n * BLOCK_N // TILE) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(0, tl.cdiv(K, TILE)):
            scale = tl.load(sa_ptrs + kt * stride_ask) * tl.load(sb_ptr + kt * stride_bsk)
            a = a_desc.load([row0, kt * TILE])
            b = b_desc.load([b_row0, kt * TILE])
            acc += tl.dot(a, tl.trans(b)) * scale[:, None]
        mask = (rows < end)[:, None] & (cols < N)[None, :]
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_KGROUPED_CONFIGS, key=["N", "K"])
@triton.jit
def _kgrouped_kernel(a_desc, as_ptr, b_desc, bs_ptr, offs_ptr, c_ptr, N, K,
                     stride_asn, stride_ast, stride_bsk, stride_bst, stride_cg, stride_cn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # one program per (group, N tile, K tile) of the shared walk (triton_common.kgrouped_walk_tile, as the Gluon
    # kernel); it walks the group's zero-padded 128-token tiles
    g, tile_n, tile_k, first_tile, token_tiles = kgrouped_walk_tile(tl.program_id(0), offs_ptr, N, K, BLOCK_M, BLOCK_N)
    row0 = tile_n * BLOCK_M
    col0 = tile_k * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    sa_ptrs = as_ptr + tl.minimum(rows, N - 1).to(tl.int64) * stride_asn + first_tile * stride_ast
    sb_ptrs = bs_ptr + tl.minimum(cols, K - 1).to(tl.int64) * stride_bsk + first_tile * stride_bst
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, token_tiles):
        token0 = (first_tile + t) * TILE
        a = a_desc.load([row0, token0])
        b = b_desc.load([col0, token0])
        sa = tl.load(sa_ptrs + t * stride_ast)
        sb = tl.load(sb_ptrs + t * stride_bst)
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    c_ptrs = c_ptr + g.to(tl.int64) * stride_cg + rows.to(tl.int64)[:, None] * stride_cn + cols[None, :]
    tl.store(c_ptrs, acc, mask=mask)


def _descriptor(t: Tensor) -> TensorDescriptor:
    """A TMA descriptor over the 2-D tensor t; the autotune pre-hook sets its block shape."""
    return TensorDescriptor.from_tensor(t, [1, quant_ref.TILE])


def mgrouped_gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offs: Tensor,
                  out_dtype: torch.dtype) -> Tensor:
    """out[rows of g] = a[rows of g] @ b[g].T for K-major e4m3 a [M, K] (1x128 scales), b [G, N, K] (blocks)."""
    a, b = a.contiguous(), b.contiguous()
    m, k = a.shape
    groups, n, _ = b.shape
    if k % TMA_ALIGN or n % TMA_ALIGN:
        raise ValueError(f"the Triton FP8 GEMM needs both matrix sizes (K = {k}, N = {n}) to be multiples of "
                         f"{TMA_ALIGN} (TMA row alignment); use backend='torch' for other sizes")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out

    def grid(meta):
        return (walk_size(m, n, groups, meta["BLOCK_M"], meta["BLOCK_N"]),)

    _mgrouped_kernel[grid](_descriptor(a), a_scale, _descriptor(b.view(groups * n, k)), b_scale, offs, out,
                           m, n, k, groups, triton.next_power_of_2(m), a_scale.stride(0), a_scale.stride(1),
                           b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), out.stride(0),
                           G_POW2=triton.next_power_of_2(groups))
    return out


def mgrouped_dgrad(dy: Tensor, dy_scale: Tensor, w_t: Tensor, w_scale: Tensor, offs: Tensor,
                   out_dtype: torch.dtype) -> Tensor:
    """dx[rows of g] = dy[rows of g] @ w[g]: the forward kernel on w's second orientation w_t [G, K, N]
    (quantize_weight_t: K-major for this product, no transpose per call), w's block scales read transposed."""
    return mgrouped_gemm(dy, dy_scale, w_t, w_scale.transpose(1, 2), offs, out_dtype)


def kgrouped_gemm(a_t: Tensor, a_scale: Tensor, b_t: Tensor, b_scale: Tensor, offs: Tensor,
                  rows: int | None = None) -> Tensor:
    """dw[g] = a[rows of g].T @ b[rows of g] (fp32) from k-grouped e4m3 a_t [N, 128T] and b_t [K, 128T] (rows: the
    reference's sum length; each program walks its group's own tiles, whatever the rows)."""
    a_t, b_t = a_t.contiguous(), b_t.contiguous()
    n, k, groups = a_t.shape[0], b_t.shape[0], offs.numel()
    out = torch.empty(groups, n, k, dtype=torch.float32, device=a_t.device)

    def grid(meta):
        return (groups * triton.cdiv(n, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"]),)

    _kgrouped_kernel[grid](_descriptor(a_t), a_scale, _descriptor(b_t), b_scale, offs, out, n, k,
                           a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
                           out.stride(0), out.stride(1))
    return out
