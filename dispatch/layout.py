"""Dispatch layout: where each token's experts live, per rank, node and expert (no communication)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from dispatch.topology import Topology


@dataclass
class DispatchLayout:
    """Counts a dispatch of T tokens to R ranks implies; a token counts once per destination rank."""

    tokens_per_rank: Tensor    # [R] int64 tokens sent to each rank
    tokens_per_node: Tensor    # [nodes] int64 tokens sent to each node
    tokens_per_expert: Tensor  # [E] int64 kept slots per expert
    is_token_in_rank: Tensor   # [T, R] bool


def check_num_experts(num_experts: int, world_size: int) -> int:
    """Experts per rank; ValueError unless num_experts is a positive multiple of world_size."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts = {num_experts!r} must be an integer >= 1")
    if num_experts % world_size:
        raise ValueError(f"num_experts = {num_experts} must be divisible by the EP size {world_size}")
    return num_experts // world_size


def check_routing(indices: Tensor, num_experts: int, weights: Tensor | None = None,
                  x: Tensor | None = None) -> None:
    """ValueError naming the argument unless indices [T, k] (ids in [-1, E)), weights and x agree."""
    if indices.dim() != 2:
        raise ValueError(f"indices must be [num_tokens, top_k], got shape {list(indices.shape)}")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool or indices.is_complex():
        raise ValueError(f"indices must be an integer tensor, got {indices.dtype}")
    if indices.numel() and not indices.is_meta:
        in_range = ((indices >= -1) & (indices < num_experts)).all()
        message = f"indices must lie in [-1, {num_experts - 1}] (-1 marks a dropped slot)"
        try:  # checked on the device: no host read (on the CPU the check runs at once and raises here)
            torch._assert_async(in_range, message)
        except RuntimeError:
            raise ValueError(f"{message}, got values in [{int(indices.min())}, {int(indices.max())}]") from None
    if weights is not None:
        if weights.shape != indices.shape:
            raise ValueError(f"weights shape {list(weights.shape)} must equal indices shape {list(indices.shape)}")
        if not weights.dtype.is_floating_point:
            raise ValueError(f"weights must be floating point, got {weights.dtype}")
    if x is not None:
        if x.dim() != 2 or x.shape[0] != indices.shape[0]:
            raise ValueError(f"x must be [num_tokens={indices.shape[0]}, hidden], got shape {list(x.shape)}")
        if not x.dtype.is_floating_point:
            raise ValueError(f"x must be floating point, got {x.dtype}")


def expert_owner(num_experts: int, world_size: int, device: torch.device | None = None) -> Tensor:
    """[E] rank holding each expert: rank r holds the contiguous block of E/R experts starting at r*E/R."""
    per_rank = check_num_experts(num_experts, world_size)
    return torch.arange(num_experts, device=device) // per_rank


@functools.cache
def device_index(values: tuple[int, ...], device: torch.device) -> Tensor:
    """int64 [len(values)] on device, made once per (values, device) and kept: a step's constant index (a hop's peer
    ranks, say) uploaded at its first use, which precedes any CUDA graph capture (the warm-up runs eagerly), instead
    of torch.tensor(values, device=...) on every call, which on a GPU copies from pageable memory and waits, and
    inside a graph would capture a host buffer the replays no longer have. Callers must not write into it."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def lookup(indices: Tensor, table: Tensor) -> Tensor:
    """table[indices] where indices >= 0, -1 elsewhere."""
    return torch.where(indices >= 0, table[indices.clamp(min=0)], -1)


def count_ids(ids: Tensor, num_ids: int) -> Tensor:
    """[num_ids] int64: how often each id occurs in ids (any shape, -1 ignored). No host sync, where
    torch.bincount reads the largest id to the host on a GPU."""
    flat = ids.reshape(-1)
    counts = torch.zeros(num_ids + 1, dtype=torch.int64, device=ids.device)
    counts.index_add_(0, torch.where(flat >= 0, flat, num_ids), torch.ones_like(flat, dtype=torch.int64))
    return counts[:num_ids]


def membership(targets: Tensor, num_targets: int) -> Tensor:
    """[T, num_targets] bool: which targets appear in each row of targets [T, k] (-1 ignored)."""
    hit = torch.zeros(targets.shape[0], num_targets + 1, dtype=torch.bool, device=targets.device)
    hit.scatter_(1, torch.where(targets >= 0, targets, num_targets), True)
    return hit[:, :num_targets]


def get_dispatch_layout(indices: Tensor, num_experts: int, topology: Topology) -> DispatchLayout:
    """Layout of a dispatch of indices [T, k] (-1 = dropped) over the ranks and nodes of topology."""
    check_routing(indices, num_experts)
    owner = expert_owner(num_experts, topology.world_size, indices.device)
    ranks = lookup(indices, owner)
    in_rank = membership(ranks, topology.world_size)
    node_of_rank = torch.arange(topology.world_size, device=indices.device) // topology.gpus_per_node
    in_node = membership(lookup(ranks, node_of_rank), topology.num_nodes)
    kept = indices[indices >= 0]
    return DispatchLayout(in_rank.sum(0), in_node.sum(0), torch.bincount(kept, minlength=num_experts), in_rank)
