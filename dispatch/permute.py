"""Deterministic sort-based permutation of rows into expert groups and its weighted inverse, with autograd."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dispatch.layout import count_ids
from dispatch.segment import SegmentPlan, ordered_sum, pass_sizes, segment_plan, static_plan


@dataclass
class Permutation:
    """Rows grouped by expert: permuted row i is source row `row[i]`, routing slot `slot[i]`."""

    row: Tensor     # [P] source row of each permuted row
    slot: Tensor    # [P] routing slot (0..k-1) it stands for
    counts: Tensor  # [G] int64 permuted rows per group, in row order
    inverse: SegmentPlan
    valid: Tensor | None = None  # [P] bool, padded permutations only: the rows standing for a pair (the rest pad)


def make_permutation(groups: Tensor, num_groups: int, counts: list[int] | None = None) -> Permutation:
    """Stable sort of the (row, slot) pairs of groups [M, k] (-1 = not here) by group id.

    Meta groups hold no values: there counts (pairs per group, from dispatch.rehearsal_rule) must be given
    and give the sizes; real groups ignore it.
    """
    rows, slots = groups.shape
    if groups.is_meta:
        if counts is None or len(counts) != num_groups:
            raise ValueError(f"make_permutation on meta tensors needs counts, one per group ({num_groups})")
        row = groups.new_empty(sum(counts), dtype=torch.int64)
        return Permutation(row, torch.empty_like(row), groups.new_empty(num_groups, dtype=torch.int64),
                           segment_plan(row, rows, slots))
    flat = groups.reshape(-1)
    here = flat >= 0
    per_row = here.view(rows, slots).sum(1)
    pairs, *sizes = torch.cat([per_row.sum().view(1), pass_sizes(per_row, slots)]).tolist()  # host sync: the
    kept = torch.nonzero_static(here, size=pairs).squeeze(1)  # number of pairs sizes every tensor after it
    order = kept[torch.argsort(flat[kept], stable=True)]
    row = order // slots
    counts = count_ids(flat, num_groups)
    return Permutation(row, order % slots, counts, segment_plan(row, rows, slots, sizes))  # a row has <= k pairs


def make_padded_permutation(groups: Tensor, num_groups: int, bound: int) -> tuple[Permutation, Tensor]:
    """make_permutation sized by the shape only (a padded exchange's): bound rows, the pairs first, grouped as
    make_permutation groups them, then padding rows (valid False, in no group's count; summed into no row). Reads
    nothing to the host. Returns (permutation, overflow: a 0-dim bool, true when there are more than bound pairs;
    those past the bound are left out and the counts end at bound)."""
    rows, slots = groups.shape
    flat = groups.reshape(-1)
    key = torch.where(flat >= 0, flat, num_groups)
    order = torch.argsort(key, stable=True).narrow(0, 0, min(bound, flat.numel()))
    valid = key.index_select(0, order) < num_groups
    counts = count_ids(flat, num_groups)
    ends = torch.cumsum(counts, 0).clamp(max=order.numel())
    row = order // slots
    inverse = static_plan(torch.where(valid, row, rows), rows, slots)  # a row has <= k pairs
    return (Permutation(row, order % slots, ends - torch.cat([ends.new_zeros(1), ends[:-1]]), inverse, valid),
            counts.sum() > order.numel())


class _Permute(torch.autograd.Function):
    """x [M, H] -> x[perm.row]; backward sums each row's copies in the inverse plan's order."""

    @staticmethod
    def forward(ctx, x: Tensor, perm: Permutation) -> Tensor:  # noqa: D102
        ctx.perm = perm
        if x.dim() == 2 and x.stride() == (0, 0):  # one value everywhere (an FP8Rows stand-in): widened, no copy
            return x.as_strided((perm.row.numel(), x.shape[1]), (0, 0))
        return x.index_select(0, perm.row)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: D102
        return ordered_sum(grad, ctx.perm.inverse, dtype=grad.dtype), None  # in grad's dtype, as x[row]'s backward did


class _Unpermute(torch.autograd.Function):
    """y [P, H], weights [M, k] (or None: unweighted) -> [M, H] weighted sums of each row's pairs, taken in at least
    fp32; keeps y for the weights' grad only, and nothing of it unweighted."""

    @staticmethod
    def forward(ctx, y: Tensor, weights: Tensor | None, perm: Permutation, dtype: torch.dtype | None) -> Tensor:  # noqa: D102
        acc = torch.promote_types(y.dtype, torch.float32)
        pair_weight = None if weights is None else weights[perm.row, perm.slot].to(acc)
        ctx.save_for_backward(y if ctx.needs_input_grad[1] else None, pair_weight)  # y only feeds weights' grad
        ctx.perm, ctx.y_dtype, ctx.acc = perm, y.dtype, acc
        ctx.weights_like = None if weights is None else (weights.shape, weights.dtype)
        return ordered_sum(y, perm.inverse, pair_weight, acc, dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: D102
        y, pair_weight = ctx.saved_tensors
        perm = ctx.perm
        g = grad.index_select(0, perm.row).to(ctx.acc)  # [P, H] in the accumulation dtype, as is g * y
        grad_weights = None
        if ctx.needs_input_grad[1]:
            shape, dtype = ctx.weights_like
            grad_weights = pair_weight.new_zeros(shape)
            products = (g * y).sum(1)  # a padded permutation's padding rows stand for no pair: nothing to add
            grad_weights[perm.row, perm.slot] = products if perm.valid is None else products.where(perm.valid, 0)
            grad_weights = grad_weights.to(dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_weights, None, None
        grad_y = g if pair_weight is None else g.mul_(pair_weight.unsqueeze(1))
        return grad_y.to(ctx.y_dtype), grad_weights, None, None


def permute(x: Tensor, perm: Permutation) -> Tensor:
    """One row of x per (row, slot) pair, contiguous per group."""
    return _Permute.apply(x, perm)


def unpermute(y: Tensor, perm: Permutation, weights: Tensor | None, dtype: torch.dtype | None = None) -> Tensor:
    """[M, H]: out[m] = sum over m's pairs of weights[m, slot] * y[pair] (weights None: of y[pair]), summed in at
    least fp32.

    The sums are rounded once to dtype (default: the fp32-or-wider accumulation dtype).
    """
    return _Unpermute.apply(y, weights, perm, dtype)
