"""Persistent, warp-specialised FP8 grouped GEMMs for sm_90 (Gluon): forward and dgrad (m-grouped, mgrouped_kernel)
and wgrad (k-grouped, fp32 out, kgrouped_kernel, on the same skeleton with triton_common.kgrouped_walk_tile).

The same product as triton_gemm._mgrouped_kernel (the `tl` reference, tested under the interpreter): out[rows of g] =
a[rows of g] @ b[g].T with a [M, K] e4m3 in 1x128 tiles and b [G, N, K] e4m3 in 128x128 blocks, fp32 promotion
every 128 of K. Gluon does not run under the interpreter; what it shares with the reference is the tile walk
(triton_common.walk_tile, tested there) and the operands' layouts. The design (DeepGEMM's SM90 kernel, restated):

- one CTA per SM walks the walk's tiles t = pid, pid + programs, ... (persistent: the ring stays full across tiles);
- a producer warp (40 registers) feeds a STAGES-deep ring of A (two 64-row halves) and B [BLOCK_N, 128] by TMA,
  one `ready` mbarrier per stage (expect-tx bytes), and waits on the stage's `empty` mbarrier before refilling it;
- two math warpgroups, each its own partition (232 registers): warpgroup w multiplies rows 64w..64w+63 of the tile.
  Each 128-wide K slice is one wgmma into a fresh accumulator, then its stage is released (one arrive per
  warpgroup, `empty` counts two) and the slice is scaled (row scale x column scale) into the fp32 accumulator. The
  warpgroups meet only at mbarriers, so one promotes while the other multiplies (a warpgroup's own next wgmma
  waiting for its promotion keeps two accumulators live, not three: no spills at 168 registers); no CTA-wide
  barrier in the main loop;
- epilogue: a half tile whose rows all belong to the group goes out by TMA store from shared memory (waited for
  only before the buffer is reused, so it overlaps the next tile's main loop); the group's last, partial half tile
  by masked stores (TMA cannot clip at a group boundary).

Scales are plain loads (L1-resident: one row scale per row and one column scale per 128 columns per K slice),
issued before the wgmma they follow so their latency hides behind it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from kernels.triton_common import kgrouped_walk_tile, walk_tile

# Gluon is experimental: Triton 3.6 (the GPU machines' stack) names the TMA copies async_copy_global_to_shared /
# async_copy_shared_to_global, later versions async_load / async_store (same arguments); both are supported.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

TILE_K = gl.constexpr(128)  # the promotion interval: one 128-wide K slice per wgmma, as the 1x128 / 128x128 scales
HALF_M = gl.constexpr(64)  # rows per math warpgroup (wgmma m64)
BLOCK_M = gl.constexpr(128)
GROUP_M = gl.constexpr(8)  # walk_tile's swizzle band, as the `tl` reference
PRODUCER_REGS = gl.constexpr(40)
MATH_REGS = gl.constexpr(232)
MATH_WARPS = 4  # warps per math warpgroup: the launch's num_warps (the default partition is warpgroup 0)


@gluon.jit
def _producer(a_desc, b_desc, offs_ptr, M, N, K, G, WALK, a_smem, b_smem, ready, empty,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, G_POW2: gl.constexpr):
    """The TMA warp: for every K slice of every valid tile of this CTA, wait for the stage to be empty, then load
    A's two 64-row halves and B's [BLOCK_N, 128] slice into it, completing `ready` by their bytes."""
    stage_bytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    k_tiles = gl.cdiv(K, TILE_K)
    it = 0
    for t in range(gl.program_id(0), WALK, gl.num_programs(0)):
        g, row0, end, tile_n, valid = walk_tile(t, offs_ptr, M, N, G, BLOCK_M, BLOCK_N, GROUP_M, G_POW2)
        if valid:
            for kt in range(k_tiles):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
                bar = ready.index(s)
                mbarrier.expect(bar, stage_bytes)
                _tma_load(a_desc, [row0, kt * TILE_K], bar, a_smem.index(2 * s))
                _tma_load(a_desc, [row0 + HALF_M, kt * TILE_K], bar, a_smem.index(2 * s + 1))
                _tma_load(b_desc, [g * N + tile_n * BLOCK_N, kt * TILE_K], bar, b_smem.index(s))
                it += 1


@gluon.jit
def _slice_product(a_smem, b_smem, ready, empty, it, acc, HALF: gl.constexpr, STAGES: gl.constexpr):
    """The `it`-th ring slot's product for math warpgroup HALF: wait for the stage, one wgmma of its 128-wide K
    slice into a fresh accumulator (acc only gives the layout), wait for it, release the stage; returns the fp32
    partial product, which the caller scales into its accumulator."""
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    part = warpgroup_mma(a_smem.index(2 * s + HALF), b_smem.index(s).permute((1, 0)), acc, use_acc=False,
                         is_async=True)
    part = warpgroup_mma_wait(0, deps=[part])
    mbarrier.arrive(empty.index(s), count=1)
    return part


@gluon.jit
def _math(a_smem, b_smem, ready, empty, c_smem, c_desc, c_ptr, as_ptr, bs_ptr, offs_ptr, M, N, K, G, WALK,
          stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk, stride_cm, HALF: gl.constexpr,
          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, G_POW2: gl.constexpr):
    """One math warpgroup: rows HALF * 64 .. + 63 of every tile this CTA walks (see the module doc). BLOCK_N divides
    128, so a column tile lies in one weight block: its scale is one scalar per K slice."""
    gl.static_assert(TILE_K % BLOCK_N == 0)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    k_tiles = gl.cdiv(K, TILE_K)
    it = 0
    for t in range(gl.program_id(0), WALK, gl.num_programs(0)):
        g, row0, end, tile_n, valid = walk_tile(t, offs_ptr, M, N, G, BLOCK_M, BLOCK_N, GROUP_M, G_POW2)
        if valid:
            rows = row0 + HALF * HALF_M + gl.arange(0, HALF_M, row_layout)
            cols = tile_n * BLOCK_N + gl.arange(0, BLOCK_N, col_layout)
            sa_ptrs = as_ptr + gl.minimum(rows, M - 1).to(gl.int64) * stride_asm
            sb_ptr = bs_ptr + g.to(gl.int64) * stride_bsg + (tile_n * BLOCK_N // TILE_K) * stride_bsn
            acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
            for kt in range(k_tiles):
                sa = gl.load(sa_ptrs + kt * stride_ask)  # loaded before the wgmma, used after it
                sb = gl.load(sb_ptr + kt * stride_bsk)
                part = _slice_product(a_smem, b_smem, ready, empty, it, acc, HALF, STAGES)
                acc += part * (sa * sb)[:, None]  # the reference's rounding: dot * (row scale * column scale)
                it += 1
            # epilogue: TMA store of a full half tile (overlapping what follows), masked stores at a group's end
            first = row0 + HALF * HALF_M
            if first + HALF_M <= end:
                tma.store_wait(0)  # the previous tile's store has left c_smem
                c_smem.store(acc.to(c_desc.dtype))
                fence_async_shared()
                _tma_store(c_desc, [first, tile_n * BLOCK_N], c_smem)
            else:
                mask = (rows < end)[:, None] & (cols < N)[None, :]
                c_ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
                gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    tma.store_wait(0)


@gluon.jit
def _ring(a_desc, b_desc, c_desc, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Both kernels' shared memory: the STAGES-deep ring (A as two 64-row halves per stage, B), one output half tile
    per math warpgroup, and per stage a `ready` mbarrier (the producer's expect-tx) and an `empty` one (one arrive
    per math warpgroup)."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, TILE_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, TILE_K], b_desc.layout)
    c_smem0 = gl.allocate_shared_memory(c_desc.dtype, [HALF_M, BLOCK_N], c_desc.layout)
    c_smem1 = gl.allocate_shared_memory(c_desc.dtype, [HALF_M, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    return a_smem, b_smem, c_smem0, c_smem1, ready, empty


@gluon.jit
def mgrouped_kernel(a_desc, as_ptr, b_desc, bs_ptr, offs_ptr, c_desc, c_ptr, M, N, K, G, WALK,
                    stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk, stride_cm,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, G_POW2: gl.constexpr):
    """a_desc: TMA over a [M, K] in [64, 128] boxes; b_desc: over b viewed [G*N, K] in [BLOCK_N, 128] boxes; c_desc:
    over c [M, N] in [64, BLOCK_N] boxes (c_ptr: the same tensor, for the masked stores). WALK = walk_size(...)."""
    a_smem, b_smem, c_smem0, c_smem1, ready, empty = _ring(a_desc, b_desc, c_desc, BLOCK_N, STAGES)
    gl.warp_specialize([
        (_math, (a_smem, b_smem, ready, empty, c_smem0, c_desc, c_ptr, as_ptr, bs_ptr, offs_ptr, M, N, K, G, WALK,
                 stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk, stride_cm, 0, BLOCK_N, STAGES, G_POW2)),
        (_math, (a_smem, b_smem, ready, empty, c_smem1, c_desc, c_ptr, as_ptr, bs_ptr, offs_ptr, M, N, K, G, WALK,
                 stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk, stride_cm, 1, BLOCK_N, STAGES, G_POW2)),
        (_producer, (a_desc, b_desc, offs_ptr, M, N, K, G, WALK, a_smem, b_smem, ready, empty, BLOCK_N, STAGES,
                     G_POW2)),
    ], [4, 1], [MATH_REGS, PRODUCER_REGS])


@gluon.jit
def _kproducer(a_desc, b_desc, offs_ptr, N, K, WALK, a_smem, b_smem, ready, empty,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The wgrad's TMA warp: per token tile of every tile this CTA walks, a_t's two 64-row halves [64, 128 tokens]
    and b_t's [BLOCK_N, 128 tokens] into the ring (as _producer)."""
    stage_bytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), WALK, gl.num_programs(0)):
        g, tile_n, tile_k, first_tile, token_tiles = kgrouped_walk_tile(t, offs_ptr, N, K, BLOCK_M, BLOCK_N)
        for j in range(token_tiles):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, stage_bytes)
            token0 = (first_tile + j) * TILE_K
            _tma_load(a_desc, [tile_n * BLOCK_M, token0], bar, a_smem.index(2 * s))
            _tma_load(a_desc, [tile_n * BLOCK_M + HALF_M, token0], bar, a_smem.index(2 * s + 1))
            _tma_load(b_desc, [tile_k * BLOCK_N, token0], bar, b_smem.index(s))
            it += 1


@gluon.jit
def _kmath(a_smem, b_smem, ready, empty, c_smem, c_desc, c_ptr, as_ptr, bs_ptr, offs_ptr, N, K, WALK,
           stride_asn, stride_ast, stride_bsk, stride_bst, stride_cg, stride_cn, HALF: gl.constexpr,
           BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One wgrad math warpgroup: rows HALF * 64 .. + 63 of dw[g]'s tile, one wgmma per 128-token tile scaled by the
    tile's row scales (a_t's, per row of N) and column scales (b_t's, per column of K) into fp32, as the `tl`
    _kgrouped_kernel; an empty group's tile is stored as zeros."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    it = 0
    for t in range(gl.program_id(0), WALK, gl.num_programs(0)):
        g, tile_n, tile_k, first_tile, token_tiles = kgrouped_walk_tile(t, offs_ptr, N, K, BLOCK_M, BLOCK_N)
        first = tile_n * BLOCK_M + HALF * HALF_M
        rows = first + gl.arange(0, HALF_M, gl.SliceLayout(1, acc_layout))
        cols = tile_k * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, acc_layout))
        sa_ptrs = as_ptr + gl.minimum(rows, N - 1).to(gl.int64) * stride_asn + first_tile * stride_ast
        sb_ptrs = bs_ptr + gl.minimum(cols, K - 1).to(gl.int64) * stride_bsk + first_tile * stride_bst
        acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
        for j in range(token_tiles):
            sa = gl.load(sa_ptrs + j * stride_ast)
            sb = gl.load(sb_ptrs + j * stride_bst)
            part = _slice_product(a_smem, b_smem, ready, empty, it, acc, HALF, STAGES)
            acc += part * sa[:, None] * sb[None, :]
            it += 1
        if first + HALF_M <= N:  # the half tile lies in dw[g]: TMA store (dw viewed [G*N, K]; K clipped by TMA)
            tma.store_wait(0)
            c_smem.store(acc)
            fence_async_shared()
            _tma_store(c_desc, [g * N + first, tile_k * BLOCK_N], c_smem)
        else:
            mask = (rows < N)[:, None] & (cols < K)[None, :]
            c_ptrs = c_ptr + g.to(gl.int64) * stride_cg + rows.to(gl.int64)[:, None] * stride_cn + cols[None, :]
            gl.store(c_ptrs, acc, mask=mask)
    tma.store_wait(0)


@gluon.jit
def kgrouped_kernel(a_desc, as_ptr, b_desc, bs_ptr, offs_ptr, c_desc, c_ptr, N, K, WALK,
                    stride_asn, stride_ast, stride_bsk, stride_bst, stride_cg, stride_cn,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """dw[g] = a_t[:, tokens of g] @ b_t[:, tokens of g].T in fp32 from the k-grouped operands (a_t [N, 128 T] in
    [64, 128] boxes, b_t [K, 128 T] in [BLOCK_N, 128] boxes, 1x128 scales along tokens); c_desc over dw viewed
    [G*N, K] in [64, BLOCK_N] boxes, c_ptr the same tensor. The skeleton of mgrouped_kernel (module doc)."""
    a_smem, b_smem, c_smem0, c_smem1, ready, empty = _ring(a_desc, b_desc, c_desc, BLOCK_N, STAGES)
    gl.warp_specialize([
        (_kmath, (a_smem, b_smem, ready, empty, c_smem0, c_desc, c_ptr, as_ptr, bs_ptr, offs_ptr, N, K, WALK,
                  stride_asn, stride_ast, stride_bsk, stride_bst, stride_cg, stride_cn, 0, BLOCK_N, STAGES)),
        (_kmath, (a_smem, b_smem, ready, empty, c_smem1, c_desc, c_ptr, as_ptr, bs_ptr, offs_ptr, N, K, WALK,
                  stride_asn, stride_ast, stride_bsk, stride_bst, stride_cg, stride_cn, 1, BLOCK_N, STAGES)),
        (_kproducer, (a_desc, b_desc, offs_ptr, N, K, WALK, a_smem, b_smem, ready, empty, BLOCK_N, STAGES)),
    ], [4, 1], [MATH_REGS, PRODUCER_REGS])


def shared_layouts(block_n: int, out_dtype) -> dict[str, gl.NVMMASharedLayout]:
    """The NVMMA shared layouts of the three TMA descriptors (A and B e4m3 with 128-byte rows, C in out_dtype)."""
    return {"a": gl.NVMMASharedLayout.get_default_for([HALF_M, TILE_K], gl.float8e4nv),
            "b": gl.NVMMASharedLayout.get_default_for([block_n, TILE_K], gl.float8e4nv),
            "c": gl.NVMMASharedLayout.get_default_for([HALF_M, block_n], out_dtype)}


def smem_bytes(block_n: int, stages: int, out_bytes: int) -> int:
    """Shared memory the kernel allocates: the ring, the two output half tiles and 2 mbarriers per stage."""
    return stages * (BLOCK_M + block_n) * TILE_K + 2 * HALF_M * block_n * out_bytes + 16 * stages

