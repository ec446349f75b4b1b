"""Simulate a schedule from per-chunk costs: timelines, bubbles, peak activations; text/SVG drawing.

Run `python -m pipeline.simulator --schedule dualpipev --pp 8 --chunks 16 --f 1 --b 2 --w 1 --svg out.svg`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pipeline.schedules import SCHEDULES, Action, Op, Schedule, build, merge_weight_grads


@dataclass(frozen=True)
class Costs:
    """Time of one chunk through one stage: forward, full backward, its weight part, overlapped pair, p2p hop."""

    f: float
    b: float
    w: float = 0.0
    fb: float | None = None  # an overlapped F&B pair; default f + b (no gain from overlap)
    p2p: float | Mapping[tuple[int, int], float] = 0.0  # one hop, or per (source rank, destination rank)

    def hop(self, src: int, dst: int) -> float:
        """p2p time of a message from rank src to rank dst."""
        return self.p2p if isinstance(self.p2p, (int, float)) else self.p2p[(src, dst)]

    def of(self, action: Action) -> float:
        """Duration of a compute action (a split B costs b - w, in an F&B pair too; a W costs w per chunk)."""
        if action.op is Op.F:
            return self.f
        if action.op is Op.B:
            return self.b - self.w if action.split else self.b
        if action.op is Op.W:
            return self.w * len(action.chunks)
        pair = self.f + self.b if self.fb is None else self.fb
        return pair - self.w if action.backward.split else pair


@dataclass
class Span:
    """One executed action on a rank."""

    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    """Simulated step: each rank's spans, the makespan and per-rank bubble and peak activations."""

    schedule: Schedule
    timelines: list[list[Span]]
    makespan: float
    busy: list[float] = field(default_factory=list)
    peak_activations: list[int] = field(default_factory=list)

    @property
    def bubbles(self) -> list[float]:
        """Idle time of each rank within the step."""
        return [self.makespan - b for b in self.busy]

    @property
    def bubble(self) -> float:
        """Largest idle time of any rank."""
        return max(self.bubbles)

    @property
    def idle_fractions(self) -> list[float]:
        """Idle time / step time per rank."""
        return [x / self.makespan for x in self.bubbles]

    @property
    def param_copies(self) -> int:
        """Stage modules held per rank."""
        return self.schedule.layout.num_phases


def _deps(schedule: Schedule, rank: int, half: Action) -> list[tuple[str, int, int, int]]:
    """Keys (op, rank, phase, chunk) of the actions on other stages that `half` waits for."""
    layout = schedule.layout
    stage = layout.stage_of(rank, half.phase)
    if half.op is Op.F and stage > 0:
        return [("F", *layout.locate(half.chunk, stage - 1), half.chunk)]
    if half.op is Op.B:
        if stage < layout.num_stages - 1:
            return [("B", *layout.locate(half.chunk, stage + 1), half.chunk)]
        return [("F", rank, half.phase, half.chunk)]
    return []


def _ready(t: float, deps: list[tuple[str, int, int, int]], done: Mapping, costs: Costs, rank: int) -> float:
    """When inputs deps have reached rank, not before t."""
    for k in deps:
        finish, src = done[k]
        t = max(t, finish + (costs.hop(src, rank) if src != rank else 0.0))
    return t


def simulate(schedule: Schedule, costs: Costs, durations: Mapping[tuple[int, Action], float] | None = None,
             start: Sequence[float] | None = None,
             forward_shares: Mapping[tuple[int, Action], float] | None = None) -> SimResult:
    """Run every rank's compute actions in order as soon as their inputs are ready; durations
    (rank, action) -> time overrides the per-kind costs (e.g. with one measured step); start: the
    time each rank begins (default 0; the time before it counts as its idle time).

    An F&B pair is one block that starts once both halves' inputs are there and hands both outputs
    on at its end (as when the halves interleave); with forward_shares[(rank, pair)] = s it is run
    as its forward (share s of its time, starting on the forward's input, its outputs leaving at
    once) followed by its backward (starting on the backward's input too), as the runtime does when
    the forward has no communication to overlap.
    """
    n = schedule.layout.num_ranks
    queues = [schedule.compute_actions(r) for r in range(n)]
    pos = [0] * n
    clock = list(start) if start is not None else [0.0] * n
    done: dict[tuple[str, int, int, int], tuple[float, int]] = {}  # key -> (finish time, rank)
    timelines: list[list[Span]] = [[] for _ in range(n)]
    busy = [0.0] * n
    remaining = sum(map(len, queues))
    while remaining:
        progressed = False
        for r in range(n):
            while pos[r] < len(queues[r]):
                act = queues[r][pos[r]]
                deps = [_deps(schedule, r, h) for h in act.halves()]
                if any(k not in done for ks in deps for k in ks):
                    break
                took = durations[(r, act)] if durations else costs.of(act)
                share = forward_shares.get((r, act)) if forward_shares and act.op is Op.FB else None
                if share is None:
                    begin = _ready(clock[r], [k for ks in deps for k in ks], done, costs, r)
                    end = begin + took
                    finished = [end] * len(deps)
                else:
                    begin = _ready(clock[r], deps[0], done, costs, r)
                    end = _ready(begin + share * took, deps[1], done, costs, r) + (1 - share) * took
                    finished = [begin + share * took, end]
                for h, t in zip(act.halves(), finished):
                    done[(h.op.value, r, h.phase, h.chunk)] = (t, r)
                timelines[r].append(Span(act, begin, end))
                busy[r] += took
                clock[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(queues[r][pos[r]]) for r in range(n) if pos[r] < len(queues[r])}
            raise RuntimeError(f"schedule {schedule.name} deadlocks; ranks wait at {stuck}")
    return SimResult(schedule, timelines, max(clock), busy, [_peak_live(q) for q in queues])


def simulate_shared(schedule: Schedule, costs: Costs, durations: Mapping[tuple[int, Action], float],
                    speed: Callable[[int], float]) -> SimResult:
    """simulate() for ranks that share processors: while n ranks run an action, each one's action advances
    speed(n) seconds of its duration per second (fluid processor sharing; speed(n) = 1 for every n is
    simulate()). Each action starts once it is the rank's next and its inputs have arrived; an F&B pair is
    one block. A rank is busy from an action's start to its end."""
    n = schedule.layout.num_ranks
    queues = [schedule.compute_actions(r) for r in range(n)]
    pos = [0] * n
    done: dict[tuple[str, int, int, int], tuple[float, int]] = {}
    timelines: list[list[Span]] = [[] for _ in range(n)]
    busy, clock = [0.0] * n, [0.0] * n
    running: dict[int, list[float]] = {}  # rank -> [start, duration left]
    now = 0.0
    while running or any(pos[r] < len(queues[r]) for r in range(n)):
        ready = {}
        for r in range(n):
            if r in running or pos[r] == len(queues[r]):
                continue
            deps = [k for h in queues[r][pos[r]].halves() for k in _deps(schedule, r, h)]
            if all(k in done for k in deps):
                ready[r] = _ready(now, deps, done, costs, r)
        for r, t in ready.items():
            if t <= now:
                running[r] = [now, durations[(r, queues[r][pos[r]])]]
        if not running and not ready:
            stuck = {r: str(queues[r][pos[r]]) for r in range(n) if pos[r] < len(queues[r])}
            raise RuntimeError(f"schedule {schedule.name} deadlocks; ranks wait at {stuck}")
        rate = speed(len(running)) if running else 0.0
        finish = now + min(left for _, left in running.values()) / rate if running else float("inf")
        later = min((t for r, t in ready.items() if r not in running), default=float("inf"))
        step = min(finish, later) - now
        now += step
        for r, (began, left) in list(running.items()):
            left -= step * rate
            running[r][1] = left
            if left <= 1e-12 * max(1.0, abs(now)):
                act = queues[r][pos[r]]
                for h in act.halves():
                    done[(h.op.value, r, h.phase, h.chunk)] = (now, r)
                timelines[r].append(Span(act, began, now))
                busy[r] += now - began
                clock[r] = now
                pos[r] += 1
                del running[r]
    return SimResult(schedule, timelines, max(clock), busy, [_peak_live(q) for q in queues])


def _peak_live(actions: list[Action]) -> int:
    """Most chunks whose forward is done and whose backward is not, over the rank's actions."""
    live = peak = 0
    for act in actions:
        for half in act.halves():
            live += {Op.F: 1, Op.B: -1}.get(half.op, 0)
            peak = max(peak, live)
    return peak


_GLYPH = {Op.F: "F", Op.B: "B", Op.W: "W", Op.FB: "X"}
_COLOR = {Op.F: "#f4c542", Op.B: "#5fa8e8", Op.W: "#8fd18f", Op.FB: "#d08ae0"}


def render_text(result: SimResult, width: int = 100) -> str:
    """The timeline as text: one row per rank, letters F/B/W/X(overlapped pair; lower case = phase 1), '.' idle."""
    scale = width / result.makespan if result.makespan else 1.0
    rows = []
    for r, spans in enumerate(result.timelines):
        line = ["."] * width
        for s in spans:
            glyph = _GLYPH[s.action.op]
            glyph = glyph.lower() if s.action.phase == 1 else glyph
            for i in range(round(s.start * scale), max(round(s.end * scale), round(s.start * scale) + 1)):
                line[min(i, width - 1)] = glyph
        rows.append(f"rank {r:2d} |{''.join(line)}| idle {result.idle_fractions[r]:.1%}")
    return "\n".join(rows)


def render_svg(result: SimResult, unit: float = 24.0, row: float = 28.0) -> str:
    """The timeline as an SVG picture: a box per action labelled with its chunk, idle left blank."""
    width = result.makespan * unit + 80
    height = row * len(result.timelines) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'font-family="monospace" font-size="10">']
    for r, spans in enumerate(result.timelines):
        y = 10 + r * row
        parts.append(f'<text x="2" y="{y + row / 2:.1f}">rank {r}</text>')
        for s in spans:
            x, w = 60 + s.start * unit, (s.end - s.start) * unit
            label = f"{s.action.chunk}" if s.action.op is not Op.FB else f"{s.action.chunk}|{s.action.backward.chunk}"
            stroke = "#000" if s.action.phase == 0 else "#c00"
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{row - 6:.1f}" '
                         f'fill="{_COLOR[s.action.op]}" stroke="{stroke}"><title>{s.action}</title></rect>')
            parts.append(f'<text x="{x + 2:.1f}" y="{y + row / 2:.1f}">{s.action.op.value}{label}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def summary(result: SimResult) -> str:
    """Makespan, bubble, peak activations and parameter copies as text."""
    return (f"{result.schedule.name}: ranks={result.schedule.layout.num_ranks} "
            f"stages={result.schedule.layout.num_stages} chunks={result.schedule.layout.num_chunks} "
            f"makespan={result.makespan:g} bubble(max rank idle)={result.bubble:g} "
            f"peak activations={max(result.peak_activations)} param copies/rank={result.param_copies}")


def main(argv: list[str] | None = None) -> int:
    """Command line: simulate one schedule and print (and optionally draw) its timeline."""
    p = argparse.ArgumentParser(prog="python -m pipeline.simulator", description=__doc__.splitlines()[0])
    p.add_argument("--schedule", choices=SCHEDULES, default="dualpipev")
    p.add_argument("--pp", type=int, default=8, help="stages (dualpipev puts 2 per rank: pp/2 ranks)")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--f", type=float, default=1.0)
    p.add_argument("--b", type=float, default=2.0)
    p.add_argument("--w", type=float, default=1.0)
    p.add_argument("--fb", type=float, default=None, help="overlapped F&B pair cost (default f+b)")
    p.add_argument("--p2p", type=float, default=0.0)
    p.add_argument("--no-split", action="store_true", help="no B/W split (weight grads inside B)")
    p.add_argument("--merge-w", type=int, default=1, help="chunks per W action (schedules.merge_weight_grads)")
    p.add_argument("--svg", help="write the timeline picture here")
    p.add_argument("--width", type=int, default=100)
    args = p.parse_args(argv)
    if args.schedule == "dualpipev" and args.pp % 2:
        p.error(f"--pp {args.pp}: dualpipev needs an even number of stages")
    ranks = args.pp // 2 if args.schedule == "dualpipev" else args.pp
    try:
        schedule = build(args.schedule, ranks, args.chunks, split_bw=not args.no_split)
        if args.merge_w != 1:
            if args.no_split:
                raise ValueError(f"--merge-w {args.merge_w} needs the B/W split (drop --no-split)")
            schedule = merge_weight_grads(schedule, args.merge_w)
    except ValueError as err:
        p.error(str(err))
    result = simulate(schedule, Costs(args.f, args.b, args.w, args.fb, args.p2p))
    print(summary(result))
    print(render_text(result, args.width))
    if args.svg:
        with open(args.svg, "w") as fh:
            fh.write(render_svg(result))
        print(f"wrote {args.svg}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
