"""Triton helpers shared by the quantisation and GEMM kernels: e4m3 encoding, group-tile lookup and the grouped GEMMs'
tile walk (scalar code only, so the Gluon kernels call the same function as the `tl` reference)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

from kernels import fp8_format

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FP8_MAX = tl.constexpr(fp8_format.FP8_MAX)
SCALE_EPS = tl.constexpr(fp8_format.SCALE_EPS)
TILE = tl.constexpr(fp8_format.TILE)


@triton.jit
def e4m3_code(v):
    """Bits (uint8) of the e4m3fn value nearest to fp32 v in [-448, 448], ties to even.

    Integer-only, so it is exact on GPUs and under TRITON_INTERPRET=1 (whose fp32->fp8 cast is not).
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    mag = bits & 0x7FFFFFFF
    # normal e4m3 (|v| >= 2**-6): keep 3 of fp32's 23 mantissa bits, round half to even
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0x7FF00000
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    # subnormal e4m3 (|v| < 2**-6): the code is |v| / 2**-9 rounded half to even
    exponent = mag >> 23
    mantissa = (mag & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)
    shift = tl.minimum(141 - tl.maximum(exponent, 1), 30)
    units = mantissa >> shift
    rest = mantissa & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (rest > half) | ((rest == half) & ((units & 1) == 1))
    subnormal = units + round_up.to(tl.int32)
    return (tl.where(mag < 0x3C800000, subnormal, normal) | sign).to(tl.uint8)


@triton.jit
def e4m3_value(code):
    """fp32 value of e4m3fn bits (uint8) with the bits of torch's e4m3 -> fp32 cast (NaN codes: 0x7FF00000 and
    its negative). Integer-only (subnormals: an exact int * 2**-9), as e4m3_code, so exact under the interpreter."""
    c = code.to(tl.int32)
    exponent = (c >> 3) & 15
    mantissa = c & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    magnitude = tl.where((c & 0x7F) == 0x7F, 0x7FF00000, tl.where(exponent > 0, normal, subnormal))
    return (magnitude | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def tile_scale(amax):
    """Scale of a tile from its absolute maximum, as the torch reference computes it."""
    return tl.div_rn(tl.maximum(amax, SCALE_EPS), FP8_MAX)


@triton.jit
def quantize_codes(x, scale):
    """e4m3 bits of clamp(x / scale, -448, 448); scale broadcasts against x."""
    scaled = tl.div_rn(x, scale)
    return e4m3_code(tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX))


@triton.jit
def locate_tile(tile, offs_ptr, G, BLOCK: tl.constexpr, G_POW2: tl.constexpr):
    """Group g, first row, group end and validity of virtual row tile `tile` of a grouped launch.

    Group g owns tiles g + start_g // BLOCK onwards (one per BLOCK rows), so ceil(M / BLOCK) + G tiles
    cover any group sizes without a host sync; tiles in the gaps are invalid.
    """
    h = tl.arange(0, G_POW2)
    ends = tl.load(offs_ptr + h, mask=h < G, other=0)
    starts = tl.load(offs_ptr + h - 1, mask=(h > 0) & (h < G), other=0)
    owned = (h < G) & (h + starts // BLOCK <= tile)
    g = tl.sum(owned.to(tl.int32), axis=0) - 1
    start = tl.sum(tl.where(h == g, starts, 0), axis=0)
    end = tl.sum(tl.where(h == g, ends, 0), axis=0)
    row0 = start + (tile - g - start // BLOCK) * BLOCK
    return g, row0, end, row0 < end


@triton.jit
def group_of_tile(tile_m, offs_ptr, G, BLOCK: tl.constexpr, G_POW2: tl.constexpr):
    """locate_tile with scalars only: group g, first row, group end and validity of virtual row tile tile_m.

    Group g owns virtual row tiles g + start_g // BLOCK onwards; that first tile is non-decreasing in g, so g is found
    by a binary search of log2(G_POW2) scalar loads of offs (no tensors, no layouts: callable from Gluon kernels).
    """
    g = tile_m * 0
    step = G_POW2 // 2
    while step > 0:
        cand = g + step
        start = tl.load(offs_ptr + tl.minimum(cand, G) - 1)
        g = tl.where((cand < G) & (cand + start // BLOCK <= tile_m), cand, g)
        step = step // 2
    start = tl.load(offs_ptr + tl.maximum(g - 1, 0), mask=g > 0, other=0)
    end = tl.load(offs_ptr + g)
    row0 = start + (tile_m - g - start // BLOCK) * BLOCK
    return g, row0, end, row0 < end


@triton.jit
def walk_tile(t, offs_ptr, M, N, G, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
              G_POW2: tl.constexpr):
    """The grouped GEMMs' tile walk: tile t of walk_size() -> (group, first row, group end, column tile, valid).

    Virtual row tiles (ceil(M / BLOCK_M) + G of them, see group_of_tile) times column tiles, swizzled in bands of
    GROUP_M row tiles so that consecutive t share B's column tile and neighbouring row tiles (L2 reuse). One program
    per tile (the `tl` reference) or a persistent program walking t = pid, pid + programs, ... (the Gluon kernels)
    visit every (group, row tile, column tile) of the real rows exactly once; the G extra virtual row tiles and those
    of empty groups come out invalid and are skipped. Scalar code only, no host read of offs.
    """
    tiles_m = tl.cdiv(M, BLOCK_M) + G
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * tiles_n
    first_m = (t // band) * GROUP_M
    band_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (t % band) % band_m
    tile_n = (t % band) // band_m
    g, row0, end, valid = group_of_tile(tile_m, offs_ptr, G, BLOCK_M, G_POW2)
    return g, row0, end, tile_n, valid


def walk_size(m: int, n: int, groups: int, block_m: int, block_n: int) -> int:
    """How many tiles walk_tile walks: (ceil(m / block_m) + groups) x ceil(n / block_n)."""
    return (triton.cdiv(m, block_m) + groups) * triton.cdiv(n, block_n)


@triton.jit
def kgrouped_walk_tile(t, offs_ptr, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The k-grouped wgrad's tile walk: tile t of G x ceil(N / BLOCK_M) x ceil(K / BLOCK_N), group-major (consecutive
    tiles share the group's token tiles) -> (group, row tile, column tile, the group's first token tile in the
    k-grouped layout, its token tiles: 0 for an empty group, whose dw tile is zeros). Scalar code only."""
    tiles_k = tl.cdiv(K, BLOCK_N)
    per_group = tl.cdiv(N, BLOCK_M) * tiles_k
    g = t // per_group
    tile_n = (t % per_group) // tiles_k
    tile_k = (t % per_group) % tiles_k
    start = tl.load(offs_ptr + tl.maximum(g - 1, 0), mask=g > 0, other=0)
    end = tl.load(offs_ptr + g)
    return g, tile_n, tile_k, g + start // TILE, tl.cdiv(end - start, TILE)
