"""Costs taken from a recorded timeline, and the simulator's wait prediction fed with them."""

from __future__ import annotations

import statistics

import pytest

from pipeline.costs import (CostSamples, action_window, cost_key, hop_latencies, measured_wait, median_wait,
                            occupied_durations, replayed_wait, sampled_wait)
from pipeline.p2p import TransferLog
from pipeline.schedules import Action, Op, build
from pipeline.simulator import Costs, simulate

F0, B0, W0 = Action(Op.F, 0, 0), Action(Op.B, 0, 0, split=True), Action(Op.W, 0, 0)
TIMELINE = [  # (action, start, end, busy): busy leaves out time blocked on receives
    (Action(Op.RECV_F, 0, 0, peer=1), 0.0, 0.1, 0.1),
    (F0, 0.1, 1.6, 1.0),  # 0.5 blocked on its input
    (Action(Op.SEND_F, 0, 0, peer=1), 1.6, 1.8, 0.2),
    (B0, 1.9, 3.0, 0.8),  # 0.1 of loop overhead before it; 0.3 blocked on its grad
    (Action(Op.SEND_B, 0, 0, peer=1), 3.0, 3.2, 0.2),
    (W0, 3.2, 4.0, 0.8),
]


def test_occupied_time_runs_to_the_next_compute_action_less_receive_waits() -> None:
    durations = occupied_durations(TIMELINE)
    assert [a for a, _ in durations] == [F0, B0, W0]
    assert [round(s, 9) for _, s in durations] == [1.4, 1.0, 0.8]
    assert measured_wait([5.0], [durations]) == pytest.approx(1 - 3.2 / 5.0)  # 0.8 blocked + 1.0 after W


def test_costs_pool_by_stage_and_kind() -> None:
    fb = Action(Op.FB, 1, 3, backward=Action(Op.B, 0, 2, split=True))
    assert cost_key(fb) == ((1, 0), "FB")
    assert cost_key(Action(Op.B, 1, 4)) == ((1,), "B") and cost_key(B0) == ((0,), "Bs")
    step = CostSamples.of_step([[(F0, 1.0)], [(F0, 2.0), (Action(Op.F, 0, 5), 4.0), (fb, 7.0)]])
    assert step.samples == {(0, (0,), "F"): [1.0], (1, (0,), "F"): [2.0, 4.0], (1, (1, 0), "FB"): [7.0]}
    both = CostSamples.pooled([step, CostSamples.of_step([[(F0, 3.0)]])])
    assert both.samples[(0, (0,), "F")] == [1.0, 3.0] and step.samples[(0, (0,), "F")] == [1.0]


def _step(schedule, costs: Costs, scale: float = 1.0) -> list[list]:
    """One step's durations per rank: every action at scale x its kind's cost."""
    return [[(a, scale * costs.of(a)) for a in schedule.compute_actions(r)]
            for r in range(schedule.layout.num_ranks)]


@pytest.mark.parametrize("name,ranks", [("dualpipev", 2), ("dualpipe", 2), ("dualpipev", 4)])
def test_without_jitter_every_prediction_is_the_simulators_own(name: str, ranks: int) -> None:
    schedule = build(name, ranks, 8)
    costs = Costs(1.0, 2.5, 1.1, 3.2, p2p=0.05)
    steps = [_step(schedule, costs)] * 2
    samples = [CostSamples.of_step(step) for step in steps]
    expected = simulate(schedule, costs).idle_fractions
    for got in (median_wait(schedule, CostSamples.pooled(samples), 0.05), sampled_wait(schedule, samples, 0.05, 3),
                replayed_wait(schedule, steps, 0.05)):
        assert got == pytest.approx(expected)


def test_jitter_within_a_step_adds_wait_a_median_cost_hides() -> None:
    schedule = build("dualpipev", 2, 8)
    base = Costs(1.0, 2.0, 1.0)
    # every (rank, stage, kind) costs {0.7, 1.0, 1.3} x its base cost within the step
    step = CostSamples.pooled([CostSamples.of_step(_step(schedule, base, scale)) for scale in (0.7, 1.0, 1.3)])
    median, sampled = median_wait(schedule, step, 0.0), sampled_wait(schedule, [step], 0.0, draws=200)
    assert all(s > m + 0.02 for s, m in zip(sampled, median)), (sampled, median)


def test_a_slow_step_is_not_spread_over_the_others() -> None:
    """Steps 3x apart in speed, each without jitter: no wait beyond the schedule's own; drawing
    from the pooled samples instead would mix slow and fast chunks into imbalance."""
    schedule = build("dualpipev", 2, 8)
    base = Costs(1.0, 2.0, 1.0)
    steps = [CostSamples.of_step(_step(schedule, base, scale)) for scale in (1.0, 3.0)]
    expected = simulate(schedule, base).idle_fractions
    assert sampled_wait(schedule, steps, 0.0) == pytest.approx(expected)
    assert all(s > e + 0.02 for s, e in zip(sampled_wait(schedule, [CostSamples.pooled(steps)], 0.0), expected))


def test_window_runs_from_the_first_action_of_any_rank_to_the_last_end() -> None:
    assert action_window([(10.0, 20.0), (10.5, 21.0)]) == (11.0, [0.0, 0.5])


def test_hop_latency_counts_blocked_receives_from_the_later_of_send_and_wait() -> None:
    sender, receiver = TransferLog(), TransferLog()
    sender.sent[(1, 2)] += [1.0, 2.0, 3.0]
    receiver.received[(0, 2)] += [(0.5, 1.25),  # waiting before the send: lands 0.25 after it
                                  (2.5, 2.75),  # asked after the send: lands 0.25 after the ask
                                  (4.0, 4.00001)]  # not blocked: arrival unknown, left out
    assert hop_latencies([[sender, receiver]]) == {(0, 1): [0.25, 0.25]}


def test_start_offsets_and_per_direction_hops_shift_the_simulated_step() -> None:
    schedule = build("dualpipev", 2, 4)
    base = simulate(schedule, Costs(1.0, 2.0, 1.0, p2p=0.1))
    hops = simulate(schedule, Costs(1.0, 2.0, 1.0, p2p={(0, 1): 0.1, (1, 0): 0.1}))
    assert hops.makespan == base.makespan and hops.busy == base.busy
    late = simulate(schedule, Costs(1.0, 2.0, 1.0, p2p=0.1), start=[0.5, 0.0])  # rank 0 starts late
    assert late.timelines[0][0].start == 0.5 and late.makespan == pytest.approx(base.makespan + 0.5)
    slow_back = simulate(schedule, Costs(1.0, 2.0, 1.0, p2p={(0, 1): 0.1, (1, 0): 0.6}))
    assert slow_back.makespan > base.makespan
    step = CostSamples.of_step(_step(schedule, Costs(1.0, 2.0, 1.0)), start=[0.5, 0.0])
    assert median_wait(schedule, step, 0.1) == pytest.approx(late.idle_fractions)


def test_forward_shares_pool_per_pair_stages_and_feed_the_simulator() -> None:
    schedule = build("dualpipev", 2, 8)
    costs = Costs(1.0, 2.5, 1.1, 3.2, p2p=0.05)
    steps = [_step(schedule, costs)]
    pairs = [{a: 0.2 + 0.1 * (a.chunk % 2) for a in schedule.compute_actions(r) if a.op is Op.FB} for r in range(2)]
    samples = CostSamples.of_step(steps[0], None, pairs)
    medians = samples.forward_shares(schedule)
    assert set(medians) == {(r, a) for r in range(2) for a in pairs[r]}
    for (r, a), share in medians.items():  # the median over the pairs on the same two stages
        same = [x for b, x in pairs[r].items() if cost_key(b) == cost_key(a)]
        assert share == pytest.approx(statistics.median(same))
    own = {(r, a): x for r in range(2) for a, x in pairs[r].items()}
    assert replayed_wait(schedule, steps, 0.05, None, [pairs]) == pytest.approx(
        simulate(schedule, costs, forward_shares=own).idle_fractions)
    assert median_wait(schedule, samples, 0.05) == pytest.approx(
        simulate(schedule, costs, forward_shares=medians).idle_fractions)
