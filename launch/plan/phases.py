"""The time of each phase of one rank's training step, from the marks its code leaves (dispatch.progress), beside
moe-plan's compute-only prediction of the same phase (a real-device rehearsal: launch.plan.rehearse).

The pipeline runtime marks each action it starts ("F of stage 3 chunk 2", at level ACTION), a step without a
pipeline each micro-batch's forward and backward, the trainer the end of the micro-batches ("grad sync"), and an
MoE layer's forward its dispatch, experts, combine and the end of its combine (level EXCHANGE). PhaseClock is the
sink of those marks: it stamps each one (a CUDA event on the current stream on a GPU, so a phase is the device's
time between two marks; time.perf_counter on a CPU) and a phase lasts from its mark to the next mark of its level
or a shallower one. The optimizer's step is stamped by optimizer hooks. Only the step being measured is stamped
(`recording`). Per-phase rows then sum the step's actions by kind and stage, each beside moe-plan's
launch.plan.timing.StageCost figure for the same actions (compute only: a fake process group moves no data).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dispatch.progress import ACTION, EXCHANGE
from launch.plan.timing import StageCost
from pipeline.schedules import Action, Op

STEP_END = "step end"
OPTIMIZER = "optimizer step"
EXCHANGE_PHASES = ("dispatch", "experts", "combine")  # an MoE layer's forward: local work of each part
_ACTION = re.compile(r"^(?P<op>[A-Z_]+) of stage (?P<stage>\d+) chunk \d+$")
_MICRO = re.compile(r"^(?P<kind>forward|backward) of micro-batch \d+$")


@dataclass
class Phase:
    """One row: a phase's measured seconds over the step, how many actions it summed, moe-plan's seconds for the
    same actions (None where the plan prices no such phase)."""

    name: str
    seconds: float
    count: int
    planned: float | None
    inside: str | None = None  # the phase this one is part of (an MoE layer's forward parts: "F")


class PhaseClock:
    """A dispatch.progress sink stamping each mark while recording (see the module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.recording = False
        self.marks: list[tuple[str, int, object]] = []

    def stamp(self) -> object:
        """Now, on the device's clock: a recorded CUDA event, or perf_counter seconds."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self, where: str, level: int) -> None:
        """Stamp a mark of the step being measured."""
        if self.recording:
            self.marks.append((where, level, self.stamp()))

    def _seconds(self, start: object, end: object) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start

    def intervals(self) -> list[tuple[str, int, float]]:
        """(mark, level, seconds until the next mark of its level or a shallower one) of every mark but the last."""
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for i, (where, level, start) in enumerate(self.marks):
            end = next((stamp for _, lvl, stamp in self.marks[i + 1:] if lvl <= level), None)
            if end is not None:
                out.append((where, level, self._seconds(start, end)))
        return out


def _planned(action: Action, costs: Sequence[StageCost], stage_of) -> tuple[str, float]:
    """A compute action's row name and moe-plan's compute seconds for it."""
    cost = costs[stage_of(action.phase)]
    if action.op is Op.F:
        return f"F stage {stage_of(action.phase)}", cost.compute(Op.F, False)
    if action.op is Op.B:
        return f"B stage {stage_of(action.phase)}", cost.compute(Op.B, action.split)
    if action.op is Op.W:
        return f"W stage {stage_of(action.phase)}", cost.w * len(action.chunks)
    back = action.backward
    return (f"F&B stage {stage_of(action.phase)}+{stage_of(back.phase)}",
            cost.compute(Op.F, False) + costs[stage_of(back.phase)].compute(Op.B, back.split))


def phase_rows(intervals: list[tuple[str, int, float]], costs: Sequence[StageCost],
               actions: Sequence[Action] | None, stage_of) -> list[Phase]:
    """Measured phases summed by kind and stage beside moe-plan's costs (costs: StageCost by stage; actions: the
    rank's compute actions in order, from its schedule, None without a pipeline; stage_of: phase -> stage).
    A pipeline action whose mark does not match the schedule's next compute action gets no prediction."""
    rows: dict[str, Phase] = {}

    def add(name: str, seconds: float, planned: float | None, inside: str | None = None) -> None:
        row = rows.setdefault(name, Phase(name, 0.0, 0, 0.0 if planned is not None else None, inside))
        row.seconds += seconds
        row.count += 1
        if planned is not None and row.planned is not None:
            row.planned += planned

    pending = list(actions or [])
    for where, level, seconds in intervals:
        if level == EXCHANGE:
            if where in EXCHANGE_PHASES:  # moe-plan prices no such part alone (its slot handling spans F and B)
                add(f"{where} (MoE forward)", seconds, None, "F")
            continue
        if level != ACTION:
            continue
        micro, action = _MICRO.match(where), _ACTION.match(where)
        if micro:
            kind = micro["kind"]
            add(kind, seconds, costs[0].f if kind == "forward" else costs[0].b)
        elif action and action["op"] in ("F", "B", "W", "FB"):
            stage = int(action["stage"])
            expected = pending.pop(0) if pending else None
            if expected is not None and expected.op.value == action["op"] and stage_of(expected.phase) == stage:
                name, planned = _planned(expected, costs, stage_of)
                add(name, seconds, planned)
            else:
                add(f"{action['op']} stage {stage} (unmatched)", seconds, None)
                pending = []
        elif action:
            add("p2p send/recv (local)", seconds, None)
        elif where != STEP_END:  # the micro-batches' end to the optimizer (grad sync, clip, stats), its step
            add(where, seconds, None)
    return list(rows.values())


def planned_comm(costs: Sequence[StageCost], actions: Sequence[Action] | None, stage_of, micro_batches: int) -> float:
    """moe-plan's communication seconds (EP exchanges, TP and CP collectives, nothing overlapped) of the rank's
    compute actions in one step (one pipeline step): each forward half its stage's comm_f, each backward half its
    comm_b; without a pipeline, micro_batches x (comm_f + comm_b)."""
    if actions is None:
        return micro_batches * (costs[0].comm_f + costs[0].comm_b)
    total = 0.0
    for action in actions:
        for half in action.halves():
            cost = costs[stage_of(half.phase)]
            total += {Op.F: cost.comm_f, Op.B: cost.comm_b}.get(half.op, 0.0)
    return total
