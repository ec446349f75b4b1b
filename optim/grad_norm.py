"""Global gradient norm over sharded grads spread across several parallel groups."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

GroupChain = tuple[ProcessGroup | None, ...]


def global_sq_norm(parts: Sequence[tuple[torch.Tensor, GroupChain]]) -> torch.Tensor:
    """Sum of squares over all ranks, each part summed over its own chain of process groups.

    A part is a local sum of squares (float64, shape [1]) and the groups whose ranks hold
    disjoint pieces of it: the shard group first (ZeRO shards), then model-parallel groups
    (pipeline stages, expert-parallel ranks, tensor-parallel ranks) over which the params
    differ. Summing each part only over its own chain counts every parameter exactly once.
    Parts with the same chain are added locally first so each chain costs one all-reduce per
    group. Every rank must pass its parts in the same order.
    """
    chains: dict[tuple[int, ...], tuple[GroupChain, torch.Tensor]] = {}
    for sq, groups in parts:
        key = tuple(id(g) for g in groups)
        prev = chains.get(key)
        chains[key] = (groups, sq.clone() if prev is None else prev[1] + sq)
    total = None
    for groups, sq in chains.values():
        for group in groups:
            dist.all_reduce(sq, group=group)
        total = sq if total is None else total + sq
    return total[0]
