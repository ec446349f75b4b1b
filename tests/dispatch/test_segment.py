"""Fixed-order segment sums and the (un)permutation built on them, against plain loops (single process)."""

from __future__ import annotations

import pytest
import torch

from dispatch import make_permutation, make_topology, permute, segment, unpermute
from dispatch.routes import make_hop, plan_sends, routes_for
from dispatch.segment import ordered_sum, pass_sizes, segment_plan


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


def test_segment_plan_takes_each_rows_values_slot_by_slot():
    target = torch.tensor([0, 2, 2, 5, 1, 1, 1, 3])  # row 1 has three values, row 2 two, row 4 none
    plan = segment_plan(target, 6, max_slots=4)
    assert plan.offsets == [0, 5, 7, 8, 8] and plan.max_slots == 4
    assert plan.source.tolist() == [0, 4, 1, 7, 3, 5, 2, 6]  # per pass: each row's next value, rows ascending
    assert plan.target.tolist() == [0, 1, 2, 3, 5, 1, 2, 1]
    assert plan.pass_span(1) == (5, 2) and plan.pass_span(3) == (8, 0)
    assert segment_plan(torch.empty(0, dtype=torch.long), 4, max_slots=2).offsets == [0, 0, 0]


def test_segment_plan_refuses_more_values_per_target_than_max_slots():
    with pytest.raises(ValueError, match="a target row has more than max_slots = 2 values"):
        segment_plan(torch.tensor([0, 2, 2, 2]), 3, max_slots=2)


@pytest.mark.parametrize("grouped", [True, False])
def test_ordered_sum_takes_each_row_in_ascending_order_bitwise(grouped):
    sizes, num_targets = [30, 0, 45, 25], 17
    target = _grouped_targets(sizes, num_targets, seed=1)
    if not grouped:  # any order: each row's values are still taken in ascending index order
        target = target[torch.randperm(target.numel(), generator=torch.Generator().manual_seed(7))]
    values = _wide_values(target.numel(), 24, seed=2)
    weights = torch.rand(target.numel(), generator=torch.Generator().manual_seed(3))
    plan = segment_plan(target, num_targets, max_slots=int(torch.bincount(target).max()))
    want = _loop_sum(values, target, weights, num_targets, range(target.numel()))
    backwards = _loop_sum(values, target, weights, num_targets, range(target.numel() - 1, -1, -1))
    assert not torch.equal(want, backwards)  # the data tells summation orders apart
    assert torch.equal(ordered_sum(values, plan, weights), want)
    assert torch.equal(ordered_sum(values.bfloat16(), plan, weights, out_dtype=torch.bfloat16),
                       _loop_sum(values.bfloat16(), target, weights, num_targets, range(target.numel())).bfloat16())
    assert torch.equal(ordered_sum(values, plan), _loop_sum(values, target, torch.ones_like(weights), num_targets,
                                                            range(target.numel())))
    roomy = segment_plan(target, num_targets, max_slots=plan.max_slots + 3)  # passes with nothing to add
    assert torch.equal(ordered_sum(values, roomy, weights), want)


def test_ordered_sum_over_many_groups_runs_and_rows_bitwise():
    """256 groups of a top-8 routing (the cuts of the former run-by-run sum: ~2k runs, 4 row blocks)."""
    gen = torch.Generator().manual_seed(11)
    tokens, experts, k = 700, 256, 8
    groups = torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices
    groups[torch.rand(tokens, k, generator=gen) < 0.2] = -1  # drops: rows with 0..8 pairs
    perm = make_permutation(groups, experts)
    values = _wide_values(perm.row.numel(), 40, seed=12)
    weights = torch.rand(perm.row.numel(), generator=gen)
    want = _loop_sum(values, perm.row, weights, tokens, range(perm.row.numel()))
    assert torch.equal(ordered_sum(values, perm.inverse, weights), want)
    assert torch.equal(ordered_sum(values.bfloat16(), perm.inverse, weights, out_dtype=torch.bfloat16),
                       _loop_sum(values.bfloat16(), perm.row, weights, tokens, range(perm.row.numel())).bfloat16())


def test_ordered_sum_of_nothing_is_zero_rows():
    plan = segment_plan(torch.empty(0, dtype=torch.long), 3, max_slots=2)
    out = ordered_sum(torch.empty(0, 5, dtype=torch.bfloat16), plan)
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(3, 5))
    assert ordered_sum(torch.empty(0, 5), segment_plan(torch.empty(0, dtype=torch.long), 0, 1)).shape == (0, 5)


def test_ordered_sum_runs_on_meta_with_the_shapes_of_a_real_one():
    target = torch.empty(40, dtype=torch.long, device="meta")
    plan = segment_plan(target, 9, max_slots=8)  # dispatch.rehearsal_rule's rule: 40 values spread over 9 rows
    assert plan.source.is_meta and plan.source.shape == (40,) and plan.offsets == [0, 9, 18, 27, 36, 40, 40, 40, 40]
    out = ordered_sum(torch.empty(40, 6, dtype=torch.bfloat16, device="meta"), plan,
                      torch.empty(40, device="meta"), out_dtype=torch.bfloat16)
    assert out.is_meta and out.shape == (9, 6) and out.dtype == torch.bfloat16


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


def test_a_plan_handed_its_pass_sizes_is_the_plan_that_reads_them():
    gen = torch.Generator().manual_seed(5)
    target = torch.randint(0, 9, (40,), generator=gen)
    bound = int(torch.bincount(target).max()) + 1
    sizes = pass_sizes(torch.bincount(target, minlength=9), bound).tolist()
    read, handed = segment_plan(target, 9, bound), segment_plan(target, 9, bound, sizes)
    assert handed.offsets == read.offsets and torch.equal(handed.source, read.source)
    assert torch.equal(handed.target, read.target)
    with pytest.raises(ValueError, match="do not split 40 values"):
        segment_plan(target, 9, bound, [*sizes[:-1], sizes[-1] + 1])


def test_a_hops_sends_and_a_permutation_each_read_the_host_once(monkeypatch):
    """plan_sends reads the counts and its return sum's pass sizes together, make_hop reads nothing more, and
    make_permutation reads its number of pairs and its passes together: one device-to-host wait each, where
    there were two (the same plans as reading them apart)."""
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(-1, 8, (12, 3), generator=gen)  # -1: dropped slots
    stage = routes_for("flat", make_topology(4, 4), 8, 0)[0]
    reads = []
    real_tolist, real_nonzero = torch.Tensor.tolist, torch.nonzero  # nonzero waits for its size as tolist does
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real_tolist(t))
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: reads.append("nonzero") or real_nonzero(*a, **k))
    send_row, counts, sizes = plan_sends(ids, stage, 4, max_copies=3)
    hop = make_hop(send_row, [n for n, in counts], [0] * 4, ids.shape[0], 3, sizes)
    assert len(reads) == 1
    perm = make_permutation(ids, 8)
    assert len(reads) == 2
    monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)
    monkeypatch.setattr(torch, "nonzero", real_nonzero)
    for plan, target, bound in ((hop.back, send_row, 3), (perm.inverse, perm.row, 3)):
        read = segment_plan(target, ids.shape[0], bound)
        assert plan.offsets == read.offsets and torch.equal(plan.source, read.source)
    assert perm.row.numel() == int((ids >= 0).sum()) and sum(map(sum, counts)) == send_row.numel()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_ordered_sum_in_blocks_of_rows_is_bitwise_the_whole_sum(monkeypatch, out_dtype):
    # a pass holds one value per target, so summing it a block of rows at a time changes no sum (the blocks bound
    # the gathered and converted copies: a combine's node hop held every arriving row twice more in one piece)
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, 40, (300,), generator=generator)
    values = torch.randn(300, 8, generator=generator).bfloat16()
    weights = torch.rand(300, generator=generator)
    plan = segment_plan(target, 40, max_slots=300)
    whole = ordered_sum(values, plan, weights, out_dtype=out_dtype)
    monkeypatch.setattr(segment, "BLOCK_ELEMENTS", 3 * 8)  # 3 rows a block: every pass in several, one ragged
    assert torch.equal(ordered_sum(values, plan, weights, out_dtype=out_dtype), whole)
