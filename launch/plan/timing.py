"""Time of a step: per-stage chunk costs from FLOPs (launch.metrics.flops) and link bandwidths, the pipeline simulator
for the bubble, DP gradient sync after it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pipeline.schedules import Action, Op, Schedule
from pipeline.simulator import Costs, SimResult, simulate, simulate_shared


@dataclass(frozen=True)
class Rates:
    """Link bytes/s per GPU per direction."""

    intra_bps: float
    inter_bps: float
    exchange_s: float = 0.0  # fixed seconds of one all-to-all exchange

    def link_seconds(self, intra_bytes: float, inter_bytes: float) -> float:
        """Time to move bytes over both link classes at once (they run side by side)."""
        return max(intra_bytes / self.intra_bps, inter_bytes / self.inter_bps)


@dataclass(frozen=True)
class StageCost:
    """One chunk through one stage on one rank: compute of F, B (input+weight grads), W, and the
    communication F and B wait on (EP all-to-all, TP collectives) when nothing overlaps it."""

    f: float
    b: float
    w: float
    comm_f: float
    comm_b: float
    slots: float = 0.0  # of f + b: the routed slots' handling (launch.plan.efficiency.SLOT_SECONDS)
    ep_f: float = 0.0  # of comm_f: the EP exchanges' (what a paired 1F1B overlaps; TP and CP collectives are the rest)
    ep_b: float = 0.0  # of comm_b: the same
    rerun_slots: float = 0.0  # of b, beyond slots: the handling a recompute reruns before the backward

    def without_slots(self) -> StageCost:
        """The same costs less the routed slots' handling, half of it from F and half (and any rerun) from B."""
        return replace(self, f=self.f - self.slots / 2, b=self.b - self.slots / 2 - self.rerun_slots, slots=0.0,
                       rerun_slots=0.0)

    @property
    def serial(self) -> float:
        """F then B of one chunk with nothing overlapped (no pipeline)."""
        return self.f + self.comm_f + self.b + self.comm_b

    def compute(self, op: Op, split: bool) -> float:
        """Compute seconds of an F or B (split: without its weight part) or a W, no communication."""
        if op is Op.F:
            return self.f
        return self.w if op is Op.W else self.b - (self.w if split else 0.0)

    def of(self, op: Op, split: bool) -> float:
        """Duration of a lone F or B (split: without its weight part) or a W, communication exposed."""
        return self.compute(op, split) + {Op.F: self.comm_f, Op.B: self.comm_b}.get(op, 0.0)


def action_seconds(action: Action, stages: Sequence[StageCost], stage_of, overlap: bool,
                   pair_factor: float = 1.0, comm_share: float = 0.0) -> float:
    """Duration of a compute action; an F&B pair with overlap hides one half's communication
    behind the other's compute (links and SMs run at once), its compute taking pair_factor times the
    halves' (the two share the device: a profile measures it, 1 on a GPU's separate streams) and running
    on 1 - comm_share of the SMs while communication runs beside it."""
    if action.op is Op.W:
        return stages[stage_of(action.phase)].w * len(action.chunks)
    if action.op is not Op.FB:
        return stages[stage_of(action.phase)].of(action.op, action.split)
    fwd, bwd = stages[stage_of(action.phase)], stages[stage_of(action.backward.phase)]
    compute = fwd.compute(Op.F, False) + bwd.compute(Op.B, action.backward.split)
    if not overlap:
        return compute + fwd.comm_f + bwd.comm_b
    comm = fwd.comm_f + bwd.comm_b
    return max(compute * pair_factor + comm_share * comm, comm)


def simulate_step(schedule: Schedule, stages: Sequence[StageCost], p2p_seconds: float, overlap: bool,
                  pair_factor: float = 1.0, speed: Callable[[int], float] | None = None,
                  comm_share: float = 0.0) -> SimResult:
    """The pipeline simulator run with each rank's actions priced by its stages' costs (speed: pipeline ranks
    share processors, see pipeline.simulator.simulate_shared; comm_share: see action_seconds)."""
    layout = schedule.layout
    durations = {}
    for rank in range(layout.num_ranks):
        for action in schedule.compute_actions(rank):
            durations[(rank, action)] = action_seconds(action, stages, lambda p: layout.stage_of(rank, p), overlap,
                                                      pair_factor, comm_share)
    costs = Costs(0.0, 0.0, p2p=p2p_seconds)
    if speed:
        return simulate_shared(schedule, costs, durations, speed)
    return simulate(schedule, costs, durations=durations)


def paired(costs: Sequence[StageCost], comm_share: float, hidden: float) -> list[StageCost]:
    """Stage costs of a 1F1B whose steady-state F and B of different chunks run as overlapped pairs
    (Megatron-Core's combined 1F1B): each half's EP exchanges hide behind the other half's compute, a share `hidden`
    of what the other half's compute could cover (1: all of it, leaving exposed what exceeds that compute and the
    SMs the exchanges hold meanwhile, comm_share of their time); TP and CP collectives stay exposed."""
    def exposed(ep: float, other: float) -> float:
        best = max(comm_share * ep, ep - other)
        return best + (1.0 - hidden) * (ep - best)

    out = []
    for c in costs:
        ep_f, ep_b = exposed(c.ep_f, c.b), exposed(c.ep_b, c.f)
        out.append(replace(c, comm_f=c.comm_f - c.ep_f + ep_f, comm_b=c.comm_b - c.ep_b + ep_b, ep_f=ep_f, ep_b=ep_b))
    return out


def interleave(result: SimResult, virtual_stages: int) -> tuple[float, list[float]]:
    """(makespan, idle fraction per rank) of the simulated step run as interleaved 1F1B with virtual_stages
    model chunks per rank: the same work, its idle time divided by virtual_stages (Narayanan et al. 2021,
    section 2.2: bubble (p - 1) / (v m)); the extra p2p hops it costs are not counted."""
    busiest = max(result.busy)
    makespan = busiest + (result.makespan - busiest) / virtual_stages
    return makespan, [1.0 - b / makespan for b in result.busy]
