"""Fixed-order segment sums and the (un)permutation built on them, against plain loops (single process)."""

from __future__ import annotations

import pytest
import torch

import dispatch.segment as segment
from dispatch import make_permutation, permute, unpermute
from dispatch.segment import ordered_sum, segment_plan


def _wide_values(rows: int, width: int, seed: int) -> torch.Tensor:
    """Values over 40 binades: fp32 sums of them depend on the order they are taken in."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen) * 2.0 ** torch.randint(-20, 21, (rows, 1), generator=gen)


def _grouped_targets(group_sizes: list[int], num_targets: int, seed: int) -> torch.Tensor:
    """Non-decreasing targets inside each group, with repeats."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(0, num_targets, (n,), generator=gen).sort().values for n in group_sizes])


def _loop_sum(values: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, num_targets: int,
              order: range) -> torch.Tensor:
    out = torch.zeros(num_targets, values.shape[1])
    for i in order:
        out[target[i]] = out[target[i]] + weights[i] * values[i].float()
    return out


def test_segment_plan_cuts_runs_at_groups_and_repeats():
    target = torch.tensor([0, 2, 2, 5, 1, 1, 1, 3])
    plan = segment_plan(target, 6, [4, 3, 0, 1])
    assert plan.bounds == [0, 2, 4, 5, 6, 7, 8]
    for start, end in plan.runs():
        assert (target[start:end].diff() > 0).all()  # distinct, ascending: one add per row per run
    assert segment_plan(torch.tensor([0, 1, 3]), 4, [3]).bounds == [0, 3]
    assert segment_plan(torch.empty(0, dtype=torch.long), 4, [0, 0]).runs() == []


def test_segment_plan_rejects_unsorted_groups_and_wrong_sizes():
    with pytest.raises(ValueError, match="non-decreasing inside each group"):
        segment_plan(torch.tensor([0, 2, 1]), 3, [3])
    segment_plan(torch.tensor([0, 2, 1]), 3, [2, 1])  # a new group may start lower
    with pytest.raises(ValueError, match="group sizes sum to 2, expected one per value"):
        segment_plan(torch.tensor([0, 2, 1]), 3, [2])


@pytest.mark.parametrize("block_elements", [segment.BLOCK_ELEMENTS, 3 * 24])  # one block; 3-row blocks
def test_ordered_sum_takes_each_row_in_ascending_order_bitwise(monkeypatch, block_elements):
    monkeypatch.setattr(segment, "BLOCK_ELEMENTS", block_elements)
    sizes, num_targets = [30, 0, 45, 25], 17
    target = _grouped_targets(sizes, num_targets, seed=1)
    values = _wide_values(target.numel(), 24, seed=2)
    weights = torch.rand(target.numel(), generator=torch.Generator().manual_seed(3))
    plan = segment_plan(target, num_targets, sizes)
    want = _loop_sum(values, target, weights, num_targets, range(target.numel()))
    backwards = _loop_sum(values, target, weights, num_targets, range(target.numel() - 1, -1, -1))
    assert not torch.equal(want, backwards)  # the data tells summation orders apart
    assert torch.equal(ordered_sum(values, plan, weights), want)
    assert torch.equal(ordered_sum(values.bfloat16(), plan, weights, out_dtype=torch.bfloat16),
                       _loop_sum(values.bfloat16(), target, weights, num_targets, range(target.numel())).bfloat16())
    assert torch.equal(ordered_sum(values, plan), _loop_sum(values, target, torch.ones_like(weights), num_targets,
                                                            range(target.numel())))


def test_ordered_sum_of_nothing_is_zero_rows():
    plan = segment_plan(torch.empty(0, dtype=torch.long), 3, [0])
    out = ordered_sum(torch.empty(0, 5, dtype=torch.bfloat16), plan)
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(3, 5))
    assert ordered_sum(torch.empty(0, 5), segment_plan(torch.empty(0, dtype=torch.long), 0, [])).shape == (0, 5)


def _routing(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    groups = torch.randint(-1, 4, (rows, 3), generator=gen)
    groups[0] = torch.tensor([2, 2, -1])  # the same expert twice: two pairs in one group
    return groups, torch.rand(rows, 3, generator=gen)


def test_unpermute_is_the_per_row_pre_reduction_in_permuted_order_bitwise():
    groups, weights = _routing(40, seed=4)
    perm = make_permutation(groups, 4)
    y = _wide_values(perm.row.numel(), 24, seed=5).bfloat16()
    want = _loop_sum(y, perm.row, weights[perm.row, perm.slot], 40, range(perm.row.numel()))
    assert torch.equal(unpermute(y, perm, weights), want)
    assert torch.equal(unpermute(y, perm, weights, torch.bfloat16), want.bfloat16())  # rounded once
    assert torch.equal(unpermute(y, perm, weights), unpermute(y, perm, weights))  # run to run


def test_permute_and_unpermute_gradients_equal_plain_autograd():
    groups, weights = _routing(40, seed=6)
    perm = make_permutation(groups, 4)
    x = torch.randn(40, 24, dtype=torch.float64, requires_grad=True)
    w = weights.double().requires_grad_()
    grad = torch.randn(40, 24, dtype=torch.float64)
    (unpermute(permute(x, perm) * 3, perm, w) * grad).sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    pairs = x_ref[perm.row] * 3 * w_ref[perm.row, perm.slot].unsqueeze(1)
    (torch.zeros(40, 24, dtype=torch.float64).index_add(0, perm.row, pairs) * grad).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-14, atol=0)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-14, atol=0)
    # fast mode: finite differences along random directions (the full Jacobian took ~2 min of CPU)
    assert torch.autograd.gradcheck(lambda a, b: unpermute(permute(a, perm), perm, b, torch.float64), (x, w),
                                    fast_mode=True)
