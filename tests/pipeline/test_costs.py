"""Costs taken from a recorded timeline, and the simulator's wait prediction fed with them."""

from __future__ import annotations

import pytest

from pipeline.costs import (CostSamples, cost_key, measured_wait, median_wait, occupied_durations, replayed_wait,
                            sampled_wait)
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
    samples = CostSamples()
    samples.add(1, [(F0, 2.0), (Action(Op.F, 0, 5), 4.0), (fb, 7.0)])
    assert samples.samples == {(1, (0,), "F"): [2.0, 4.0], (1, (1, 0), "FB"): [7.0]}


def _constant_samples(schedule, costs: Costs) -> CostSamples:
    samples = CostSamples()
    for r in range(schedule.layout.num_ranks):
        samples.add(r, [(a, costs.of(a)) for a in schedule.compute_actions(r)])
    return samples


@pytest.mark.parametrize("name,ranks", [("dualpipev", 2), ("dualpipe", 2), ("dualpipev", 4)])
def test_without_jitter_every_prediction_is_the_simulators_own(name: str, ranks: int) -> None:
    schedule = build(name, ranks, 8)
    costs = Costs(1.0, 2.5, 1.1, 3.2, p2p=0.05)
    samples = _constant_samples(schedule, costs)
    expected = simulate(schedule, costs).idle_fractions
    steps = [[[(a, costs.of(a)) for a in schedule.compute_actions(r)] for r in range(ranks)]] * 2
    for got in (median_wait(schedule, samples, 0.05), sampled_wait(schedule, samples, 0.05, draws=5),
                replayed_wait(schedule, steps, 0.05)):
        assert got == pytest.approx(expected)


def test_jitter_adds_wait_a_median_cost_hides() -> None:
    schedule = build("dualpipev", 2, 8)
    samples = CostSamples()
    for r in range(2):  # every action's cost drawn from {0.7, 1.0, 1.3} x its kind's base cost
        for scale in (0.7, 1.0, 1.3):
            samples.add(r, [(a, scale * Costs(1.0, 2.0, 1.0).of(a)) for a in schedule.compute_actions(r)])
    median, sampled = median_wait(schedule, samples, 0.0), sampled_wait(schedule, samples, 0.0)
    assert all(s > m + 0.02 for s, m in zip(sampled, median)), (sampled, median)
