"""Fixed-order segment sums: each target's values added in ascending index order, one pass per slot.

A plan ranks every value among the values of its target (its slot: 0 for the first, 1 for the
second, ...). Pass j adds the slot-j value of every target at once, so each row is added to at most
once per pass (deterministic on every device, no colliding atomics) and the passes keep each
target's order. The number of passes is a bound the caller knows (top-k, the peers of a hop), never
read from the data, so a sum issues the same torch operators for any number of values, targets,
experts or runs; building a plan reads its pass sizes to the host once.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dispatch import rehearsal_rule

BLOCK_ELEMENTS = 1 << 25  # ordered_sum gathers at most this many elements of its values at a time (128 MiB in fp32):
# a combine's node hop would otherwise hold every arriving row twice more (gathered, and converted to fp32)


@dataclass
class SegmentPlan:
    """Sum of values[i] into row target[i], each row's values in ascending i: pass j adds every row's j-th value."""

    source: Tensor      # [P] int64 values by (slot, target): pass j's are source[offsets[j]:offsets[j + 1]]
    target: Tensor      # [P] int64 their target rows (distinct, ascending within a pass)
    offsets: list[int]  # [max_slots + 1] where each pass starts, then P
    num_targets: int
    spare: int = 0      # 1 in a static plan: target row num_targets takes the values of no target (discarded)

    @property
    def max_slots(self) -> int:
        """Passes of a sum: the most values any target may have."""
        return len(self.offsets) - 1

    def pass_span(self, slot: int) -> tuple[int, int]:
        """(start, number of values) of pass `slot` in source and target."""
        return self.offsets[slot], self.offsets[slot + 1] - self.offsets[slot]


def pass_sizes(values_per_target: Tensor, max_slots: int) -> Tensor:
    """[max_slots] int64, on the device: how many targets have more than j values (pass j's size in a plan); a
    caller reading counts to the host anyway reads these with them and hands them to segment_plan."""
    return (values_per_target.unsqueeze(1) > torch.arange(max_slots, device=values_per_target.device)).sum(0)


def segment_plan(target: Tensor, num_targets: int, max_slots: int, sizes: list[int] | None = None) -> SegmentPlan:
    """Plan over values with target rows target [P] in [0, num_targets), at most max_slots values per row; sizes:
    the passes' sizes (pass_sizes) when the caller has read them, else the plan reads them itself."""
    device, num_values = target.device, target.numel()
    order = torch.argsort(target, stable=True)  # values by target, ascending index within one
    ordered = target[order]
    slot = torch.arange(num_values, device=device) - torch.searchsorted(ordered, ordered)  # rank within its target
    by_slot = torch.argsort(slot * num_targets + ordered)  # distinct keys: slot-major, targets ascending
    slots = slot[by_slot]
    if target.is_meta:  # a rehearsal: no ranks to count; the passes follow the rule (dispatch.rehearsal_rule)
        offsets = rehearsal_rule.pass_offsets(num_values, num_targets, max_slots)
    elif sizes is not None:  # read by the caller with its counts: no read here
        if len(sizes) != max_slots or sum(sizes) != num_values:
            raise ValueError(f"pass sizes {sizes} do not split {num_values} values into max_slots = {max_slots} passes")
        offsets = [0, *itertools.accumulate(sizes)]
    else:  # host sync: the values of each pass size its operators, read once per plan
        offsets = torch.searchsorted(slots, torch.arange(max_slots + 1, device=device)).tolist()
        if offsets[-1] < num_values:
            raise ValueError(f"a target row has more than max_slots = {max_slots} values")
    return SegmentPlan(order[by_slot], ordered[by_slot], offsets, num_targets)


def static_plan(target: Tensor, num_targets: int, max_slots: int) -> SegmentPlan:
    """Plan over values with target rows target [P] in [0, num_targets], where num_targets marks a value of no target
    (a padded exchange's empty slot), at most max_slots values per target: its passes have fixed sizes (pass j holds
    one entry per target, pointing at the target's j-th value or at none), so neither building it nor summing by it
    reads anything to the host, for any routing. Sums add each target's values in ascending index, as segment_plan's.
    A target with more than max_slots values must not occur (the caller's bound: its values past the bound are not
    summed)."""
    device, num_values = target.device, target.numel()
    max_slots = max_slots if num_values else 0  # no values: no pass (and none to point at)
    order = torch.argsort(target, stable=True)  # values by target, ascending index within one
    ordered = target[order]
    slot = torch.arange(num_values, device=device) - torch.searchsorted(ordered, ordered)  # rank within its target
    width = num_targets + 1  # a column for the values of no target, and for those past the bound
    cell = torch.where((ordered < num_targets) & (slot < max_slots), slot * width + ordered, max_slots * width)
    table = torch.full((max_slots * width + 1,), num_values, dtype=torch.int64, device=device)
    table.index_put_((cell,), order)  # distinct cells for the values summed; the rest share the discarded last one
    source = table[:-1].view(max_slots, width)[:, :num_targets].reshape(-1)
    empty = source == num_values
    targets = torch.arange(num_targets, device=device).repeat(max_slots)
    offsets = [num_targets * j for j in range(max_slots + 1)]
    return SegmentPlan(torch.where(empty, 0, source), torch.where(empty, num_targets, targets), offsets, num_targets, 1)


def ordered_sum(values: Tensor, plan: SegmentPlan, weights: Tensor | None = None, dtype: torch.dtype | None = None,
                out_dtype: torch.dtype | None = None) -> Tensor:
    """[num_targets, ...]: out[t] = sum over i with target t of weights[i] * values[i], in ascending i.

    Products and sums are taken in dtype (default: values' dtype promoted to at least fp32; weights
    must be in it) and the sums rounded once to out_dtype (default dtype). Memory besides the result:
    a [num_targets, ...] accumulator in dtype (the result itself when out_dtype is dtype), and at most
    BLOCK_ELEMENTS elements of values at a time (a pass is summed in blocks of rows) gathered in values'
    dtype (in the result when that is out_dtype) and converted to dtype (unless it is values'). Blocks
    change no sum: a pass holds one value per target.
    """
    dtype = dtype or torch.promote_types(values.dtype, torch.float32)
    out_dtype = out_dtype or dtype
    rest = values.shape[1:]
    acc = values.new_zeros((plan.num_targets + plan.spare, *rest), dtype=dtype)
    block = max(1, BLOCK_ELEMENTS // max(1, math.prod(rest)))
    rows = min(plan.pass_span(0)[1], block) if plan.max_slots else 0  # the first pass is the largest
    out = None if out_dtype == dtype else values.new_empty((plan.num_targets, *rest), dtype=out_dtype)
    gathered = out if out is not None and out_dtype == values.dtype else values.new_empty((rows, *rest))
    converted = gathered if values.dtype == dtype else values.new_empty((rows, *rest), dtype=dtype)
    for slot in range(plan.max_slots):  # a fixed number of passes: the plan's bound, not the data
        start, size = plan.pass_span(slot)
        for first in range(start, start + max(size, 1), block):  # the plan's host sizes; an empty pass issues its
            # operators too (on 0 rows): the sequence of operators depends on max_slots and the blocks of a pass only
            rows = min(block, start + size - first)  # narrow, not [:rows]: a slice of a whole tensor issues no operator
            source = plan.source.narrow(0, first, rows)
            part = torch.index_select(values, 0, source, out=gathered.narrow(0, 0, rows))
            if converted is not gathered:  # same-dtype kernels: mixed-dtype ones are not vectorised on CPU
                part = converted.narrow(0, 0, rows).copy_(part)
            if weights is not None:
                part.mul_(weights.index_select(0, source).view(-1, *[1] * len(rest)))
            acc.index_add_(0, plan.target.narrow(0, first, rows), part)
    acc = acc.narrow(0, 0, plan.num_targets)
    return acc if out is None else out.copy_(acc)
