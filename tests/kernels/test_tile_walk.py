"""The grouped GEMMs' tile walk (triton_common.walk_tile), which the `tl` reference and the persistent Gluon kernels
share, under the interpreter: every (group, row tile, column tile) of the real rows visited exactly once, whether one
program per tile or a few persistent programs walk it; empty groups never; and the reference GEMM on it within
calc_diff 1e-3 of float64 at a 4093-row group, a 1-row group and unaligned sizes."""

import pytest
import torch
import triton
import triton.language as tl

import kernels
from kernels.triton_common import kgrouped_walk_tile, walk_size, walk_tile
from tests.kernels.helpers import bounds, inputs, offsets

BLOCK_M, BLOCK_N, GROUP_M = 128, 32, 8


@triton.jit
def _walk_kernel(offs_ptr, row_visits_ptr, row_group_ptr, tiles_ptr, M, N, G, WALK,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, G_POW2: tl.constexpr):
    """Walks tiles pid, pid + programs, ...: per valid tile, +1 on each of its rows' visit count at its column tile,
    the tile's group written per row, +1 on the group's tile count."""
    for t in range(tl.program_id(0), WALK, tl.num_programs(0)):
        g, row0, end, tile_n, valid = walk_tile(t, offs_ptr, M, N, G, BLOCK_M, BLOCK_N, GROUP_M, G_POW2)
        if valid:
            rows = row0 + tl.arange(0, BLOCK_M)
            mine = rows < end
            tl.atomic_add(row_visits_ptr + rows * tl.cdiv(N, BLOCK_N) + tile_n, 1, mask=mine)
            tl.store(row_group_ptr + rows, g + rows * 0, mask=mine)
            tl.atomic_add(tiles_ptr + g, 1)


def walk(sizes: list[int], n: int, programs: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(visits [M, column tiles], group of each row, valid tiles per group) after `programs` programs walk the
    tiles (None: one program per tile)."""
    m, groups = sum(sizes), len(sizes)
    tiles_n = triton.cdiv(n, BLOCK_N)
    visits = torch.zeros(m, tiles_n, dtype=torch.int32)
    row_group = torch.full((m,), -1, dtype=torch.int32)
    tiles = torch.zeros(groups, dtype=torch.int32)
    total = walk_size(m, n, groups, BLOCK_M, BLOCK_N)
    _walk_kernel[(programs or total,)](offsets(sizes), visits, row_group, tiles, m, n, groups, total,
                                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP_M=GROUP_M,
                                      G_POW2=triton.next_power_of_2(groups))
    return visits, row_group, tiles


@pytest.mark.parametrize("sizes", [[0, 1, 4093, 0, 130, 67], [5], [0, 0, 300], [128, 128, 0]])
@pytest.mark.parametrize("programs", [None, 3])
def test_every_group_tile_is_visited_exactly_once_and_empty_groups_never(sizes, programs):
    n = 100  # 4 column tiles, the last one partial
    visits, row_group, tiles = walk(sizes, n, programs)
    assert torch.equal(visits, torch.ones_like(visits))
    want_group = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), torch.tensor(sizes))
    assert torch.equal(row_group, want_group)
    want_tiles = torch.tensor([triton.cdiv(s, BLOCK_M) * triton.cdiv(n, BLOCK_N) for s in sizes], dtype=torch.int32)
    assert torch.equal(tiles, want_tiles)


@pytest.mark.parametrize("sizes", [[0, 1, 4093, 0, 130, 67]])
def test_reference_gemm_on_the_walk_is_within_1e_3_of_float64_of_its_operands(sizes):
    """The `tl` forward and dgrad (one program per walk tile) against float64 products of the same e4m3 operands:
    only fp32 summation differs. 1e-3 is the issue's bound for the GPU kernels; the derived one here: fp32 sums of
    K = 208 products err by <= ~K * 2^-24 ~ 1.2e-5 relative, so calc_diff (~ half the squared relative error)
    <= ~1e-10, bound 1e-9 (measured 1.1e-15..1.8e-15 over 5 seeds at 330 rows, ATEN_CPU_CAPABILITY default, avx2
    and native alike)."""
    x, w, dy, offs = inputs(sizes, 208, 96, seed=11)  # K = 208, N = 96: neither a multiple of 128
    xq, xs = kernels.quantize_activation(x)
    wq, ws = kernels.quantize_weight(w)
    wt, _ = kernels.quantize_weight(w, transposed=True)
    dq, ds = kernels.quantize_activation(dy)
    x64 = kernels.dequantize_activation(xq, xs).double()
    dy64 = kernels.dequantize_activation(dq, ds).double()
    w64 = kernels.dequantize_weight(wq, ws).double()
    out = kernels.fp8_grouped_gemm(xq, xs, wq, ws, offs, backend="triton")
    dx = kernels.fp8_grouped_gemm_dgrad(dq, ds, wt, ws, offs, backend="triton")
    want_out = torch.cat([x64[s:e] @ w64[g].t() for g, (s, e) in enumerate(bounds(sizes))])
    want_dx = torch.cat([dy64[s:e] @ w64[g] for g, (s, e) in enumerate(bounds(sizes))])
    assert kernels.calc_diff(out.double(), want_out) < 1e-9
    assert kernels.calc_diff(dx.double(), want_dx) < 1e-9


@triton.jit
def _kgrouped_walk_kernel(offs_ptr, visits_ptr, token_tiles_ptr, first_tile_ptr, N, K, WALK,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Walks the wgrad's tiles pid, pid + programs, ...: +1 per (group, row tile, column tile) visited, the group's
    token tiles summed, its first token tile written."""
    tiles_n = tl.cdiv(N, BLOCK_M)
    tiles_k = tl.cdiv(K, BLOCK_N)
    for t in range(tl.program_id(0), WALK, tl.num_programs(0)):
        g, tile_n, tile_k, first_tile, token_tiles = kgrouped_walk_tile(t, offs_ptr, N, K, BLOCK_M, BLOCK_N)
        tl.atomic_add(visits_ptr + (g * tiles_n + tile_n) * tiles_k + tile_k, 1)
        tl.atomic_add(token_tiles_ptr + g, token_tiles)
        tl.store(first_tile_ptr + g, first_tile)


@pytest.mark.parametrize("programs", [None, 3])
def test_the_wgrad_walk_visits_every_group_tile_once_with_its_token_tiles(programs):
    """Empty groups too (their dw tile is zeros, with no token tile); a group's token tiles start at column
    g + start // 128 of the k-grouped layout (quant_ref.kgrouped_rows)."""
    sizes, n, k = [0, 1, 4093, 0, 130, 67], 200, 100
    tiles_n, tiles_k = triton.cdiv(n, BLOCK_M), triton.cdiv(k, BLOCK_N)
    visits = torch.zeros(len(sizes), tiles_n, tiles_k, dtype=torch.int32)
    token_tiles = torch.zeros(len(sizes), dtype=torch.int32)
    first_tile = torch.full((len(sizes),), -1, dtype=torch.int32)
    total = len(sizes) * tiles_n * tiles_k
    _kgrouped_walk_kernel[(programs or total,)](offsets(sizes), visits, token_tiles, first_tile, n, k, total,
                                                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    assert torch.equal(visits, torch.ones_like(visits))
    want = torch.tensor([triton.cdiv(s, 128) * tiles_n * tiles_k for s in sizes], dtype=torch.int32)
    assert torch.equal(token_tiles, want)
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]]
    assert first_tile.tolist() == [g + start // 128 for g, start in enumerate(starts)]
