"""The FP8 ops on meta tensors (a rehearsal): only the outputs a GPU kernel allocates, in their shapes and
dtypes, so a rehearsal's memory is a GPU's and not the torch reference's fp32 intermediates."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from kernels.quant_ref import FP8_DTYPE, TILE, kgrouped_columns, num_tiles


def _empty(shape: tuple[int, ...], dtype: torch.dtype, like: Tensor) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


def quantize_activation(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> e4m3 [M, K] and fp32 scales [M, ceil(K/128)]."""
    m, k = x.shape
    return _empty((m, k), FP8_DTYPE, x), _empty((m, num_tiles(k)), torch.float32, x)


def quantize_activation_kgrouped(x: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> e4m3 [K, 128 T] and fp32 scales [K, T], T = ceil(M/128) + groups."""
    m, k = x.shape
    columns = kgrouped_columns(m, offs.numel())
    return _empty((k, columns * TILE), FP8_DTYPE, x), _empty((k, columns), torch.float32, x)


def retile_kgrouped(x_q: Tensor, x_scale: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """e4m3 x_q [M, K] -> e4m3 [K, 128 T] and fp32 scales [K, T], as quantize_activation_kgrouped."""
    return quantize_activation_kgrouped(x_q, offs)


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., N, K] -> e4m3 [..., N, K] and fp32 scales [..., ceil(N/128), ceil(K/128)]."""
    *lead, n, k = w.shape
    return _empty(tuple(w.shape), FP8_DTYPE, w), _empty((*lead, num_tiles(n), num_tiles(k)), torch.float32, w)


def quantize_weight_t(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., N, K] -> e4m3 [..., K, N] and fp32 scales [..., ceil(N/128), ceil(K/128)]."""
    *lead, n, k = w.shape
    return _empty((*lead, k, n), FP8_DTYPE, w), _empty((*lead, num_tiles(n), num_tiles(k)), torch.float32, w)


def gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offs: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a [M, K] x b [G, N, K] -> [M, N]."""
    return _empty((a.shape[0], b.shape[1]), out_dtype, a)


def dgrad(dy: Tensor, dy_scale: Tensor, w_t: Tensor, w_scale: Tensor, offs: Tensor, out_dtype: torch.dtype) -> Tensor:
    """dy [M, N] x w_t [G, K, N] -> [M, K]."""
    return _empty((dy.shape[0], w_t.shape[1]), out_dtype, dy)


def wgrad(a_t: Tensor, a_t_scale: Tensor, b_t: Tensor, b_t_scale: Tensor, offs: Tensor,
          rows: int | None = None) -> Tensor:
    """a_t [N, 128 T], b_t [K, 128 T] -> fp32 [G, N, K] (rows: the reference's sum length, no shape's)."""
    return _empty((offs.numel(), a_t.shape[0], b_t.shape[0]), torch.float32, a_t)


META_KERNELS: dict[str, Callable] = {
    "quantize_activation": quantize_activation,
    "quantize_activation_kgrouped": quantize_activation_kgrouped,
    "retile_kgrouped": retile_kgrouped,
    "quantize_weight": quantize_weight,
    "quantize_weight_t": quantize_weight_t,
    "gemm": gemm,
    "dgrad": dgrad,
    "wgrad": wgrad,
}
