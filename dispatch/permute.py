"""Deterministic sort-based permutation of rows into expert groups and its weighted inverse, with autograd."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SegmentPlan:
    """A fixed-order sum of P values into n targets: pass j adds every target's j-th value."""

    passes: list[tuple[Tensor, Tensor]]  # (value positions, their targets); targets unique per pass
    num_targets: int


def segment_plan(target: Tensor, num_targets: int) -> SegmentPlan:
    """Plan summing values[i] into target[i], each target's values taken in ascending i."""
    order = torch.argsort(target, stable=True)
    counts = torch.bincount(target, minlength=num_targets)
    sorted_target = target[order]
    ordinal = torch.arange(target.numel(), device=target.device) - (torch.cumsum(counts, 0) - counts)[sorted_target]
    depth = max(int(counts.max()) if target.numel() else 0, 1)  # one (maybe empty) pass keeps autograd linked
    passes = [(order[ordinal == j], sorted_target[ordinal == j]) for j in range(depth)]
    return SegmentPlan(passes, num_targets)


def ordered_sum(values: Tensor, plan: SegmentPlan) -> Tensor:
    """[num_targets, ...] sums of values in the plan's fixed order (no colliding atomics on any device)."""
    out = values.new_zeros(plan.num_targets, *values.shape[1:])
    for positions, targets in plan.passes:
        out = out.index_add(0, targets, values[positions])
    return out


@dataclass
class Permutation:
    """Rows grouped by expert: permuted row i is source row `row[i]`, routing slot `slot[i]`."""

    row: Tensor     # [P] source row of each permuted row
    slot: Tensor    # [P] routing slot (0..k-1) it stands for
    counts: Tensor  # [G] int64 permuted rows per group, in row order
    inverse: SegmentPlan


def make_permutation(groups: Tensor, num_groups: int) -> Permutation:
    """Stable sort of the (row, slot) pairs of groups [M, k] (-1 = not here) by group id."""
    flat = groups.reshape(-1)
    kept = torch.nonzero(flat >= 0).squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    row = order // groups.shape[1]
    return Permutation(row, order % groups.shape[1], torch.bincount(flat[kept], minlength=num_groups),
                       segment_plan(row, groups.shape[0]))


def permute(x: Tensor, perm: Permutation) -> Tensor:
    """One row of x per (row, slot) pair, contiguous per group."""
    return x[perm.row]


def unpermute(y: Tensor, perm: Permutation, weights: Tensor) -> Tensor:
    """[M, H]: out[m] = sum over m's pairs of weights[m, slot] * y[pair], summed in at least fp32."""
    acc = torch.promote_types(y.dtype, torch.float32)
    pair_weight = weights[perm.row, perm.slot].to(acc)
    return ordered_sum(y.to(acc) * pair_weight.unsqueeze(1), perm.inverse)
