"""Shared inputs for the kernel tests: groups of 0..200 rows, sizes that are not multiples of 128."""

from __future__ import annotations

import torch
from torch import Tensor

GROUP_SIZES = [0, 130, 1, 200, 0, 67]


def offsets(sizes: list[int]) -> Tensor:
    """Cumulative group ends (int32)."""
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every group."""
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


def inputs(sizes: list[int], k: int, n: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [M, K], w [G, N, K], dy [M, N] (fp32, standard normal) and offs."""
    gen = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(len(sizes), n, k, generator=gen)
    dy = torch.randn(m, n, generator=gen)
    return x, w, dy, offsets(sizes)


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Bitwise equality of two e4m3 tensors."""
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
