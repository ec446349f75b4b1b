"""Differentiable tensor-parallel collectives over an explicit process group (torch functional collectives).

Conventions (Megatron's f/g pairs): a tensor-parallel region is entered before column-parallel
linears and left after row-parallel ones.

    without SP: enter = identity (backward all-reduce), leave = all-reduce (backward identity)
    with SP:    enter = all-gather along the sequence (backward reduce-scatter),
                leave = reduce-scatter along the sequence (backward all-gather)

`scatter_sequence` / `gather_sequence` move a replicated tensor onto sequence shards and back
(forward slice / all-gather, backward all-gather / slice); use them at stage boundaries where the
consumer on every rank computes the same thing (the loss is replicated over the TP group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

Group = dist.ProcessGroup


def _waited(t: Tensor) -> Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


# torch 2.13 renamed the functional flat collectives; torch 2.11-2.12 have only the old names (same arguments).
_all_gather_flat = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter_flat = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def all_reduce(x: Tensor, group: Group, op: str = "sum") -> Tensor:
    """x reduced over group (not differentiable)."""
    return _waited(funcol.all_reduce(x, op, group))


def all_gather(x: Tensor, dim: int, group: Group) -> Tensor:
    """Every rank's x concatenated along dim in rank order (not differentiable)."""
    return _waited(_all_gather_flat(x.contiguous(), dim, group))


def reduce_scatter(x: Tensor, dim: int, group: Group) -> Tensor:
    """This rank's chunk along dim of x summed over group (not differentiable)."""
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} must be divisible by the TP size {size}")
    return _waited(_reduce_scatter_flat(x.contiguous(), "sum", dim, group))


def own_chunk(x: Tensor, dim: int, group: Group) -> Tensor:
    """This rank's contiguous chunk of x along dim (the sequence shard)."""
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"sequence length {x.shape[dim]} must be divisible by the TP size {size} "
                         f"(sequence parallelism and MoE token shards split it evenly)")
    return x.chunk(size, dim)[dist.get_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, grad_group: Group) -> Tensor:  # noqa: D102
        ctx.group = grad_group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        return all_reduce(dy, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:  # noqa: D102
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        return dy, None


ShardOp = Callable[[Tensor, int, Group], Tensor]  # (x, dim, group) -> x gathered, reduce-scattered or chunked


class _DimCollective(torch.autograd.Function):
    """forward_op(x) in forward, backward_op(dy) over grad_group in backward (both along dim)."""

    @staticmethod
    def forward(ctx, x: Tensor, forward_op: ShardOp, backward_op: ShardOp, dim: int, group: Group,  # noqa: D102
                grad_group: Group) -> Tensor:
        ctx.op, ctx.dim, ctx.group = backward_op, dim, grad_group
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        return ctx.op(dy, ctx.dim, ctx.group), None, None, None, None, None


def copy_to_region(x: Tensor, group: Group) -> Tensor:
    """Identity forward, all-reduce backward (entering a TP region without SP)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: Tensor, group: Group) -> Tensor:
    """All-reduce forward, identity backward (leaving a TP region without SP; summing replicated-loss terms)."""
    return _ReduceFromRegion.apply(x, group)


def gather_for_region(x: Tensor, dim: int, group: Group, grad_group: Group | None = None) -> Tensor:
    """All-gather along dim forward, reduce-scatter backward (entering a TP region with SP)."""
    return _DimCollective.apply(x, all_gather, reduce_scatter, dim, group, grad_group or group)


def reduce_scatter_from_region(x: Tensor, dim: int, group: Group, grad_group: Group | None = None) -> Tensor:
    """Reduce-scatter along dim forward, all-gather backward (leaving a TP region with SP)."""
    return _DimCollective.apply(x, reduce_scatter, all_gather, dim, group, grad_group or group)


def scatter_sequence(x: Tensor, tp_group: Group, dim: int = 1, grad_group: Group | None = None) -> Tensor:
    """Replicated x [B, S, H] -> this rank's sequence shard [B, S/tp, H]; backward all-gathers."""
    return _DimCollective.apply(x, own_chunk, all_gather, dim, tp_group, grad_group or tp_group)


def gather_sequence(x: Tensor, tp_group: Group, dim: int = 1, grad_group: Group | None = None) -> Tensor:
    """Sequence shards [B, S/tp, H] -> replicated [B, S, H] (for replicated consumers); backward keeps the own shard."""
    return _DimCollective.apply(x, all_gather, own_chunk, dim, tp_group, grad_group or tp_group)


class GroupRegion:
    """What a region over a process group (`group`, and `grad_group` for its backward, or None) says of it; shared
    by TP (TPRegion) and CP (moe.cp.CPRegion) regions."""

    group: Group
    grad_group: Group | None

    @property
    def concurrent_backward(self) -> bool:
        """Whether backward collectives run on a group of their own (grad_group)."""
        return self.grad_group is not None

    def __deepcopy__(self, memo: dict) -> GroupRegion:
        """Copies of a converted module share the process groups (they cannot be copied)."""
        return self

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return dist.get_rank(self.group)


@dataclass(frozen=True)
class TPRegion(GroupRegion):
    """How one module enters and leaves its tensor-parallel region: group, SP on/off, and the dim SP gathers.

    grad_group: a second group over the same ranks (made by every one of them with dist.new_group)
    for the collectives of the backward; with it a backward may run on another thread while a
    forward runs (the pipeline runtime's F&B pairs), each group seeing its collectives in the same
    order on every rank. None: both directions use group.
    """

    group: Group
    sequence_parallel: bool
    dim: int = 1  # sequence dim of the activations; token-wise layers may gather along 0 instead
    grad_group: Group | None = None

    def __post_init__(self) -> None:
        if self.grad_group is not None and dist.get_process_group_ranks(self.grad_group) != \
                dist.get_process_group_ranks(self.group):
            raise ValueError(f"grad_group must hold the TP group's ranks {dist.get_process_group_ranks(self.group)}, "
                             f"got {dist.get_process_group_ranks(self.grad_group)}")

    def along(self, dim: int) -> TPRegion:
        """The same groups, with SP, gathering along dim (token-wise layers on flattened tokens use 0)."""
        return TPRegion(self.group, True, dim, self.grad_group)

    def enter(self, x: Tensor) -> Tensor:
        """Input of the column-parallel linears: replicated (no SP) or gathered from sequence shards (SP)."""
        if self.sequence_parallel:
            return gather_for_region(x, self.dim, self.group, self.grad_group)
        return copy_to_region(x, self.grad_group or self.group)

    def leave(self, x: Tensor) -> Tensor:
        """Partial sums out of the row-parallel linears: all-reduced (no SP) or reduce-scattered to shards (SP)."""
        if self.sequence_parallel:
            return reduce_scatter_from_region(x, self.dim, self.group, self.grad_group)
        return reduce_from_region(x, self.group)

    def scatter(self, x: Tensor) -> Tensor:
        """This rank's sequence shard of replicated x (backward all-gathers)."""
        return scatter_sequence(x, self.group, self.dim, self.grad_group)

    def gather(self, x: Tensor) -> Tensor:
        """Replicated x from sequence shards, for replicated consumers (backward keeps the own shard)."""
        return gather_sequence(x, self.group, self.dim, self.grad_group)
