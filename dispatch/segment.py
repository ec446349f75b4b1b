"""Fixed-order segment sums: add rows into targets run by run, in place, with no two adds to one row at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dispatch import rehearsal

BLOCK_ELEMENTS = 1 << 20  # accumulator block: 4 MiB of fp32, reused for every block of target rows


@dataclass
class SegmentPlan:
    """Sum of values[i] into row target[i], each row's values in ascending i, over runs of consecutive values."""

    target: Tensor     # [P] int64 target row of each value
    bounds: list[int]  # run j is values[bounds[j]:bounds[j + 1]]; targets strictly ascend inside a run
    num_targets: int

    def runs(self) -> list[tuple[int, int]]:
        """(start, end) of each run, in order."""
        return list(zip(self.bounds[:-1], self.bounds[1:]))


def segment_plan(target: Tensor, num_targets: int, group_sizes: list[int]) -> SegmentPlan:
    """Plan over values laid out in consecutive groups of group_sizes, targets non-decreasing in each group.

    A run starts at every group and wherever a target repeats inside its group, so every run
    adds at most once to each row (deterministic everywhere, no colliding atomics).
    """
    if sum(group_sizes) != target.numel():
        raise ValueError(f"group sizes sum to {sum(group_sizes)}, expected one per value ({target.numel()})")
    if target.is_meta:  # a rehearsal: no values to cut at, a run per non-empty group (dispatch.rehearsal)
        return SegmentPlan(target, rehearsal.segment_bounds(group_sizes), num_targets)
    sizes = torch.tensor(group_sizes, dtype=torch.int64, device=target.device)
    starts = torch.cumsum(sizes, 0) - sizes
    first = torch.zeros(target.numel(), dtype=torch.bool, device=target.device)
    first[starts[sizes > 0]] = True  # a group's first value
    step = torch.diff(target, prepend=target[:1])
    if bool(((step < 0) & ~first).any()):
        raise ValueError("targets must be non-decreasing inside each group")
    cuts = torch.nonzero(first | (step == 0)).squeeze(1).tolist()
    return SegmentPlan(target, sorted({0, *cuts, target.numel()}), num_targets)


def _block_edges(plan: SegmentPlan, block_rows: int) -> list[list[int]]:
    """edges[j][b]: offset inside run j of its first value whose target lies in row block b or later."""
    runs, blocks, device = len(plan.bounds) - 1, math.ceil(plan.num_targets / block_rows), plan.target.device
    run = torch.repeat_interleave(torch.arange(runs, device=device), torch.tensor(plan.bounds, device=device).diff())
    counts = torch.bincount(run * blocks + plan.target // block_rows, minlength=runs * blocks)
    return torch.nn.functional.pad(counts.view(runs, blocks).cumsum(1), (1, 0)).tolist()


def ordered_sum(values: Tensor, plan: SegmentPlan, weights: Tensor | None = None, dtype: torch.dtype | None = None,
                out_dtype: torch.dtype | None = None) -> Tensor:
    """[num_targets, ...]: out[t] = sum over i with target t of weights[i] * values[i], in ascending i.

    Products and sums are taken in dtype (default: values' dtype promoted to at least fp32; weights
    must be in it) and the sums rounded once to out_dtype (default dtype). Target rows are summed a
    block at a time in one reused accumulator, and each run's values are converted (and weighted)
    in one reused scratch buffer, then added in place.
    """
    dtype = dtype or torch.promote_types(values.dtype, torch.float32)
    rest = values.shape[1:]
    out = torch.empty((plan.num_targets, *rest), dtype=out_dtype or dtype, device=values.device)
    if not plan.num_targets:
        return out
    block_rows = max(1, min(plan.num_targets, BLOCK_ELEMENTS // max(1, math.prod(rest))))
    accumulator = values.new_empty((block_rows, *rest), dtype=dtype)
    local = plan.target % block_rows
    direct = weights is None and values.dtype == dtype
    scratch = None if direct else values.new_empty((block_rows, *rest), dtype=dtype)
    if values.is_meta:  # a rehearsal: the buffers above are what the sum holds; meta adds change nothing
        return out
    edges = _block_edges(plan, block_rows)
    for block, first_row in enumerate(range(0, plan.num_targets, block_rows)):
        acc = accumulator[:min(block_rows, plan.num_targets - first_row)].zero_()
        for (start, _), edge in zip(plan.runs(), edges):
            lo, hi = start + edge[block], start + edge[block + 1]
            if lo == hi:
                continue
            part = values[lo:hi]
            if not direct:  # same-dtype kernels: mixed-dtype ones are not vectorised on CPU
                part = scratch[:hi - lo].copy_(part)
                if weights is not None:
                    part.mul_(weights[lo:hi].view(-1, *[1] * len(rest)))
            acc.index_add_(0, local[lo:hi], part)
        out[first_row:first_row + acc.shape[0]] = acc
    return out
