"""Per-chunk costs measured from runtime timelines, and the wait the simulator predicts from them.

A rank's step is a list of compute actions (F, B, W, F&B) with send/receive actions between them.
An action's occupied time runs from its start to the start of the next compute action, less the
time it was blocked on receives: its compute plus issuing the sends and receives (and the
bookkeeping) that follow it. The rest of the step is the rank's wait: blocked on a receive, or
outside its actions. The simulator predicts each rank's wait fraction from these costs three ways:
replaying every measured step with each action's own cost (the costs as measured, chunk by chunk);
with costs pooled per stage and kind, (rank, phases, kind), over a step's chunks, either each
stage's median cost over all steps, or averaged over runs whose every action cost is drawn from
its stage's samples of one measured step at a time. Drawing keeps the jitter of single chunks that a
median hides (at each hand-over the slower rank makes the other wait, so jitter adds wait no
central cost shows); drawing within a step keeps a slow episode of a shared machine, which hits
both ranks at once, from being spread over every step as imbalance that never happened.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from pipeline.p2p import TransferLog
from pipeline.schedules import COMPUTE_OPS, Action, Op, Schedule
from pipeline.simulator import Costs, SimResult, simulate

Timeline = Sequence[tuple[Action, float, float, float]]  # (action, start, end, busy) as the runtime records
Durations = list[tuple[Action, float]]  # a rank's compute actions in order, each with its occupied seconds
Shares = Mapping[Action, float]  # a rank's F&B pairs run forward first: the forward's share (simulate)
Hops = float | Mapping[tuple[int, int], float]  # p2p seconds per hop, or per (source rank, destination rank)


def occupied_durations(timeline: Timeline) -> Durations:
    """Each compute action of one recorded step with its occupied seconds (see the module doc);
    send/receive actions before the first compute action count towards it."""
    starts = [i for i, (act, *_) in enumerate(timeline) if act.op in COMPUTE_OPS]
    bounds = [0, *starts[1:], len(timeline)]
    out = []
    for i, k in enumerate(starts):
        span = timeline[bounds[i]:bounds[i + 1]]
        end = timeline[bounds[i + 1]][1] if bounds[i + 1] < len(timeline) else span[-1][2]
        blocked = sum(e - s - busy for _, s, e, busy in span)
        out.append((timeline[k][0], end - span[0][1] - blocked))
    return out


def cost_key(action: Action) -> tuple[tuple[int, ...], str]:
    """(phases, kind) an action's cost is pooled under: kind F, B (full), Bs (split), W, Wn (a W
    merged over n chunks) or FB; phases the stage(s) it runs on (an F&B pair: its forward's then
    its backward's)."""
    if action.op is Op.FB:
        return (action.phase, action.backward.phase), "FB"
    if action.op is Op.W and action.merged:
        return (action.phase,), f"W{len(action.chunks)}"
    return (action.phase,), "Bs" if action.op is Op.B and action.split else action.op.value


@dataclass
class CostSamples:
    """Measured occupied seconds per (rank, phases, kind), pooled over chunks (and steps), the
    forward shares of F&B pairs (kind "F share"), and the time each rank started its first action
    after the first rank did (start[rank], if measured)."""

    samples: dict[tuple[int, tuple[int, ...], str], list[float]] = field(default_factory=dict)
    start: list[float] | None = None

    @classmethod
    def of_step(cls, step: Sequence[Durations], start: list[float] | None = None,
                shares: Sequence[Shares] = ()) -> CostSamples:
        """The samples of one measured step (step[rank]: that rank's durations; shares[rank]: its
        F&B pairs' forward shares; start: see the class)."""
        out = cls(start=start)
        for rank, durations in enumerate(step):
            out.add(rank, durations)
        for rank, pairs in enumerate(shares):
            for act, share in pairs.items():
                out.samples.setdefault((rank, cost_key(act)[0], "F share"), []).append(share)
        return out

    @classmethod
    def pooled(cls, parts: Sequence[CostSamples]) -> CostSamples:
        """All samples of parts together (start: each rank's mean)."""
        starts = [p.start for p in parts if p.start is not None]
        out = cls(start=[statistics.mean(s) for s in zip(*starts)] if starts else None)
        for part in parts:
            for key, values in part.samples.items():
                out.samples.setdefault(key, []).extend(values)
        return out

    def add(self, rank: int, durations: Durations) -> None:
        """Pool durations of rank."""
        for act, seconds in durations:
            self.samples.setdefault((rank, *cost_key(act)), []).append(seconds)

    def durations(self, schedule: Schedule, pick: Callable[[list[float]], float]) -> dict[tuple[int, Action], float]:
        """Cost of every compute action of schedule: pick(samples of its rank, phases and kind)."""
        return {(r, act): pick(self.samples[(r, *cost_key(act))])
                for r in range(schedule.layout.num_ranks) for act in schedule.compute_actions(r)}

    def forward_shares(self, schedule: Schedule) -> dict[tuple[int, Action], float]:
        """Each F&B pair's forward share, the median of its stages' samples (pairs without none)."""
        keys = {(r, act): (r, cost_key(act)[0], "F share") for r in range(schedule.layout.num_ranks)
                for act in schedule.compute_actions(r) if act.op is Op.FB}
        return {k: statistics.median(self.samples[key]) for k, key in keys.items() if self.samples.get(key)}


def median_wait(schedule: Schedule, samples: CostSamples, p2p: Hops) -> list[float]:
    """Per-rank wait fractions simulated with each stage's median cost per kind (p2p: seconds per hop)."""
    return simulate(schedule, Costs(0.0, 0.0, p2p=p2p), samples.durations(schedule, statistics.median),
                    samples.start, samples.forward_shares(schedule)).idle_fractions


def sampled_wait(schedule: Schedule, steps: Sequence[CostSamples], p2p: Hops, draws: int = 10,
                 seed: int = 0) -> list[float]:
    """Per-rank wait fractions over `draws` simulated steps per measured step, every action's cost
    drawn at random from its stage's samples of that step: total wait / total makespan."""
    rng = random.Random(seed)
    runs = [simulate(schedule, Costs(0.0, 0.0, p2p=p2p), step.durations(schedule, rng.choice), step.start,
                     step.forward_shares(schedule))
            for step in steps for _ in range(draws)]
    return _wait_fractions(runs)


def replayed_wait(schedule: Schedule, steps: list[list[Durations]], p2p: Hops,
                  starts: Sequence[list[float] | None] | None = None,
                  shares: Sequence[Sequence[Shares]] | None = None) -> list[float]:
    """Per-rank wait fractions of the simulator replaying each measured step with every action's own
    occupied time (steps[i][rank]; starts[i]: see CostSamples.start; shares[i][rank]: its F&B pairs'
    own forward shares): the costs as measured, chunk by chunk, so what it gets wrong is the
    simulator's model of the schedule and of p2p."""
    runs = [simulate(schedule, Costs(0.0, 0.0, p2p=p2p),
                     {(r, act): seconds for r, durations in enumerate(step) for act, seconds in durations},
                     start, {(r, act): x for r, pairs in enumerate(step_shares) for act, x in pairs.items()})
            for step, start, step_shares in zip(steps, starts or [None] * len(steps), shares or [()] * len(steps))]
    return _wait_fractions(runs)


def measured_wait(window_s: list[float], durations: list[Durations]) -> float:
    """A rank's measured wait fraction over steps: 1 - total occupied time / total time of the
    steps' windows (whole steps, or from the first action of any rank to the last action's end)."""
    return 1 - sum(s for d in durations for _, s in d) / sum(window_s)


def action_window(bounds: Sequence[tuple[float, float]]) -> tuple[float, list[float]]:
    """Of one step (bounds[rank]: perf_counter times its first action started and its last ended):
    seconds from the first action of any rank to the last action end of any rank, and when each
    rank's first action started within that window."""
    first = min(b[0] for b in bounds)
    return max(b[1] for b in bounds) - first, [b[0] - first for b in bounds]


def hop_latencies(steps: Sequence[Sequence[TransferLog]], blocked: float = 50e-6) -> dict[tuple[int, int], list[float]]:
    """Seconds a message took to land once it was both sent and asked for (from the later of its
    send's issue and its receiver's wait), per (source rank, destination rank), over the messages a
    receiver was blocked on for more than `blocked` (for the others, arrival is unknown).
    steps[i][rank]: that rank's log of step i."""
    out: dict[tuple[int, int], list[float]] = {}
    for logs in steps:
        for dst, log in enumerate(logs):
            for (src, stream), received in log.received.items():
                sent = logs[src].sent[(dst, stream)]
                out.setdefault((src, dst), []).extend(
                    done - max(sent[i], asked) for i, (asked, done) in enumerate(received) if done - asked > blocked)
    return out


def _wait_fractions(runs: list[SimResult]) -> list[float]:
    total = sum(r.makespan for r in runs)
    return [sum(r.bubbles[rank] for r in runs) / total for rank in range(len(runs[0].bubbles))]
