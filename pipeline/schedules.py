"""Pipeline schedules as data: per-rank lists of F, B, W, overlapped F&B, send and receive actions.

A schedule is built for `num_ranks` ranks and `num_chunks` micro-batches ("chunks"). Each rank
holds one or two stage modules, told apart by `phase` (0 or 1); a `StageLayout` says which stage a
(rank, phase) holds and where a chunk meets a stage. The runtime and the simulator both walk
these lists; neither knows any schedule by name.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, replace
from enum import Enum
from typing import Literal, get_args

ScheduleName = Literal["afab", "1f1b", "zb1p", "dualpipe", "dualpipev"]
SCHEDULES = get_args(ScheduleName)


class Op(str, Enum):
    """Kinds of actions."""

    F = "F"  # forward of one chunk through one stage
    B = "B"  # backward (input grads; weight grads too unless split)
    W = "W"  # deferred weight grads of an earlier split B (or of several, merged)
    FB = "FB"  # a forward and a backward of two chunks, overlapped
    SEND_F = "SEND_F"  # send a forward's outputs to the next stage's rank
    RECV_F = "RECV_F"  # post the receive of a forward's inputs
    SEND_B = "SEND_B"  # send a backward's input grads to the previous stage's rank
    RECV_B = "RECV_B"  # post the receive of a backward's output grads


COMPUTE_OPS = (Op.F, Op.B, Op.W, Op.FB)


@dataclass(frozen=True)
class Action:
    """One step of a rank: op on the stage held as `phase`, for micro-batch `chunk`."""

    op: Op
    phase: int = 0
    chunk: int = 0
    split: bool = False  # B: weight grads are left to a later W
    backward: Action | None = None  # FB: the backward half; (phase, chunk) is the forward half
    peer: int = -1  # SEND/RECV: the other rank
    merged: tuple[int, ...] = ()  # W: further chunks whose weight grads it computes along with chunk's

    @property
    def chunks(self) -> tuple[int, ...]:
        """The chunks this action works on (a merged W: several)."""
        return (self.chunk, *self.merged)

    def halves(self) -> tuple[Action, ...]:
        """The plain F/B actions this action consists of (itself unless it is an FB pair)."""
        if self.op is Op.FB:
            return (Action(Op.F, self.phase, self.chunk), self.backward)
        return (self,)

    def __str__(self) -> str:
        if self.op is Op.FB:
            return f"F{self.phase}.{self.chunk}&{self.backward}"
        tail = f"@{self.peer}" if self.peer >= 0 else ("w" if self.split else "")
        return f"{self.op.value}{self.phase}.{self.chunk}{''.join(f'+{c}' for c in self.merged)}{tail}"


@dataclass(frozen=True)
class StageLayout:
    """Placement of stages on ranks: 'linear' (1 per rank), 'v' (DualPipeV) or 'bidirectional' (DualPipe)."""

    kind: str
    num_ranks: int
    num_chunks: int

    @property
    def num_stages(self) -> int:
        """Stages a chunk passes through."""
        return 2 * self.num_ranks if self.kind == "v" else self.num_ranks

    @property
    def num_phases(self) -> int:
        """Stage modules per rank (parameter copies relative to one stage)."""
        return 1 if self.kind == "linear" else 2

    def stage_of(self, rank: int, phase: int) -> int:
        """Position along its chunks' path of the stage held by (rank, phase)."""
        if phase == 0:
            return rank
        return (2 * self.num_ranks if self.kind == "v" else self.num_ranks) - 1 - rank

    def locate(self, chunk: int, stage: int) -> tuple[int, int]:
        """(rank, phase) where chunk passes stage."""
        n = self.num_ranks
        if self.kind == "v":
            return (stage, 0) if stage < n else (2 * n - 1 - stage, 1)
        if self.kind == "bidirectional" and chunk >= self.num_chunks // 2:
            return n - 1 - stage, 1
        return stage, 0

    def entry_chunks(self, rank: int) -> list[int]:
        """Chunks whose inputs this rank feeds (it holds their first stage), in order."""
        return [c for c in range(self.num_chunks) if self.locate(c, 0)[0] == rank]

    def exit_chunks(self, rank: int) -> list[int]:
        """Chunks whose loss this rank computes (it holds their last stage), in order."""
        return [c for c in range(self.num_chunks) if self.locate(c, self.num_stages - 1)[0] == rank]


@dataclass
class Schedule:
    """Per-rank action lists for one training step."""

    name: str
    layout: StageLayout
    actions: list[list[Action]]

    def compute_actions(self, rank: int) -> list[Action]:
        """The rank's F, B, W and FB actions in order."""
        return [a for a in self.actions[rank] if a.op in COMPUTE_OPS]

    def to_text(self) -> str:
        """One line per rank listing its actions."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))


class _Builder:
    """Appends actions for one rank, numbering chunks per phase and queueing split B's for W."""

    def __init__(self, chunk_ids: tuple[list[int], list[int]], phase_map: tuple[int, int] = (0, 1)) -> None:
        self.actions: list[Action] = []
        self._ids = chunk_ids
        self._map = phase_map  # schedule phase -> module phase (DualPipe's second half swaps them)
        self._next_f = [0, 0]
        self._next_b = [0, 0]
        self._pending_w: deque[Action] = deque()

    def _take(self, counters: list[int], phase: int) -> tuple[int, int]:
        real = self._map[phase]
        chunk = self._ids[real][counters[real]]
        counters[real] += 1
        return real, chunk

    def _backward(self, phase: int, split: bool) -> Action:
        real, chunk = self._take(self._next_b, phase)
        action = Action(Op.B, real, chunk, split=split)
        if split:
            self._pending_w.append(action)
        return action

    def f(self, phase: int) -> None:
        self.actions.append(Action(Op.F, *self._take(self._next_f, phase)))

    def b(self, phase: int, split: bool = False) -> None:
        self.actions.append(self._backward(phase, split))

    def w(self) -> None:
        done = self._pending_w.popleft()
        self.actions.append(Action(Op.W, done.phase, done.chunk))

    def fb(self, f_phase: int, b_phase: int) -> None:
        real, chunk = self._take(self._next_f, f_phase)
        self.actions.append(Action(Op.FB, real, chunk, backward=self._backward(b_phase, False)))

    def finish(self) -> list[Action]:
        assert not self._pending_w, "schedule left weight grads undone"
        return self.actions


def afab(num_ranks: int, num_chunks: int) -> Schedule:
    """All forward, all backward (GPipe): every rank runs its forwards of all chunks, then their backwards in the
    same order; activations of every chunk are held at once, the bubble is 1F1B's."""
    _check_common(num_ranks, num_chunks, 1)
    ranks = []
    for _ in range(num_ranks):
        bld = _Builder((list(range(num_chunks)), []))
        for _ in range(num_chunks):
            bld.f(0)
        for _ in range(num_chunks):
            bld.b(0)
        ranks.append(bld.finish())
    return Schedule("afab", StageLayout("linear", num_ranks, num_chunks), ranks)


def one_f_one_b(num_ranks: int, num_chunks: int) -> Schedule:
    """Classic 1F1B: rank r warms up with PP-1-r forwards, then alternates F and B."""
    _check_common(num_ranks, num_chunks, 1)
    layout = StageLayout("linear", num_ranks, num_chunks)
    ranks = []
    for r in range(num_ranks):
        bld = _Builder((list(range(num_chunks)), []))
        warm = min(num_ranks - 1 - r, num_chunks)
        for _ in range(warm):
            bld.f(0)
        for _ in range(num_chunks - warm):
            bld.f(0)
            bld.b(0)
        for _ in range(warm):
            bld.b(0)
        ranks.append(bld.finish())
    return Schedule("1f1b", layout, ranks)


def zb1p(num_ranks: int, num_chunks: int) -> Schedule:
    """Zero-bubble ZB-H1: 1F1B with split backwards; rank r postpones its first r weight passes."""
    _check_common(num_ranks, num_chunks, min_chunks("zb1p", num_ranks))
    layout = StageLayout("linear", num_ranks, num_chunks)
    ranks = []
    for r in range(num_ranks):
        bld = _Builder((list(range(num_chunks)), []))
        warm = num_ranks - 1 - r
        for _ in range(warm):
            bld.f(0)
        for i in range(num_chunks - warm):
            bld.f(0)
            bld.b(0, split=True)
            if i >= r:
                bld.w()
        for _ in range(warm):
            bld.b(0, split=True)
            bld.w()
        for _ in range(min(r, num_chunks - warm)):
            bld.w()
        ranks.append(bld.finish())
    return Schedule("zb1p", layout, ranks)


def _dual_rank(bld: _Builder, half_rank: int, half_ranks: int, half_chunks: int, is_middle: bool) -> list[Action]:
    """DeepSeek's eight-part per-rank order, with "phase 0" the path entering at this rank's end."""
    for _ in range((half_ranks - half_rank - 1) * 2):  # 1: nF0
        bld.f(0)
    for _ in range(half_rank + 1):  # 2: nF0F1
        bld.f(0)
        bld.f(1)
    for _ in range(half_ranks - half_rank - 1):  # 3: nB1W1F1, zero bubble
        bld.b(1, split=True)
        bld.w()
        bld.f(1)
    for i in range(half_chunks - 2 * half_ranks + half_rank + 1):  # 4: nF0B1F1B0, main part
        if i == 0 and is_middle:  # kept apart: overlapping them here would only lengthen the bubble
            bld.f(0)
            bld.b(1)
        else:
            bld.fb(0, 1)
        bld.fb(1, 0)
    for _ in range(half_ranks - half_rank - 1):  # 5: nB1F1B0
        bld.b(1)
        bld.fb(1, 0)
    split = False
    for i in range(half_rank + 1):  # 6: nB1B0, the second half with split backwards
        split = split or (i == (half_rank + 1) // 2 and half_rank % 2 == 1)
        bld.b(1, split)
        split = split or (i == (half_rank + 1) // 2 and half_rank % 2 == 0)
        bld.b(0, split)
    for _ in range(half_ranks - half_rank - 1):  # 7: nWB0
        bld.w()
        bld.b(0, split=True)
    for _ in range(half_rank + 1):  # 8: nW
        bld.w()
    return bld.finish()


def dualpipe(num_ranks: int, num_chunks: int) -> Schedule:
    """DualPipe: rank r holds stages r and PP-1-r; half the chunks enter at each end."""
    _check_common(num_ranks, num_chunks, min_chunks("dualpipe", num_ranks))
    if num_ranks % 2:
        raise ValueError(f"DualPipe needs an even number of ranks, got {num_ranks}")
    if num_chunks % 2:
        raise ValueError(f"num_chunks = {num_chunks} must be even for DualPipe")
    layout = StageLayout("bidirectional", num_ranks, num_chunks)
    half = num_chunks // 2
    ids = (list(range(half)), list(range(half, num_chunks)))
    half_ranks = num_ranks // 2
    ranks = []
    for r in range(num_ranks):
        second = r >= half_ranks
        bld = _Builder(ids, (1, 0) if second else (0, 1))
        half_rank = num_ranks - 1 - r if second else r
        ranks.append(_dual_rank(bld, half_rank, half_ranks, half, half_rank == half_ranks - 1))
    return Schedule("dualpipe", layout, ranks)


def dualpipev(num_ranks: int, num_chunks: int) -> Schedule:
    """DualPipeV: 2N stages on N ranks in a V, rank r holds stages r and 2N-1-r."""
    _check_common(num_ranks, num_chunks, min_chunks("dualpipev", num_ranks))
    layout = StageLayout("v", num_ranks, num_chunks)
    ids = (list(range(num_chunks)), list(range(num_chunks)))
    ranks = [_dual_rank(_Builder(ids), r, num_ranks, num_chunks, r == num_ranks - 1) for r in range(num_ranks)]
    return Schedule("dualpipev", layout, ranks)


def _check_common(num_ranks: int, num_chunks: int, fewest: int) -> None:
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    if not isinstance(num_chunks, int) or num_chunks < fewest:
        raise ValueError(f"num_chunks = {num_chunks!r} is too few: this schedule needs >= {fewest} "
                         f"for {num_ranks} ranks")


def min_chunks(name: str, num_ranks: int) -> int:
    """The fewest chunks per step the trainer and the planner run schedule name (one of SCHEDULES) with on
    num_ranks pipeline ranks: enough to fill the pipeline (the builders take fewer where the order allows)."""
    return {"afab": num_ranks, "1f1b": num_ranks, "zb1p": num_ranks, "dualpipe": 2 * num_ranks,
            "dualpipev": 2 * num_ranks}[name]


def build(name: str, num_ranks: int, num_chunks: int, split_bw: bool = True) -> Schedule:
    """Build a schedule by name (one of SCHEDULES); split_bw=False folds every W back into its B."""
    builders = {"afab": afab, "1f1b": one_f_one_b, "zb1p": zb1p, "dualpipe": dualpipe, "dualpipev": dualpipev}
    if name not in builders:
        raise ValueError(f"schedule = {name!r} is not known; choose one of {', '.join(SCHEDULES)}")
    schedule = builders[name](num_ranks, num_chunks)
    return schedule if split_bw else without_split(schedule)


def without_split(schedule: Schedule) -> Schedule:
    """The same order with every backward computing its weight grads at once (no W actions)."""
    actions = [[replace(a, split=False) for a in acts if a.op is not Op.W] for acts in schedule.actions]
    return Schedule(schedule.name, schedule.layout, actions)


def merge_weight_grads(schedule: Schedule, group: int) -> Schedule:
    """The same order with every backward split and, per rank and stage, the weight grads of each
    `group` consecutive backwards computed by one W action, placed where the group's last weight
    pass was (its W, or its backward if unsplit): fewer, larger weight-grad GEMMs (they pay when
    chunks are small), for the memory of each chunk's layer inputs and output grads held until then."""
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group = {group!r}: chunks per merged W must be an integer >= 1")
    out = []
    for acts in schedule.actions:
        backwards: dict[int, list[int]] = defaultdict(list)  # phase -> chunks in backward order
        weight_pass: dict[tuple[int, int], int] = {}  # (phase, chunk) -> index of its weight pass
        for i, act in enumerate(acts):
            for half in act.halves():
                if half.op is Op.B:
                    backwards[half.phase].append(half.chunk)
                    weight_pass[(half.phase, half.chunk)] = i
            if act.op is Op.W:
                weight_pass.update({(act.phase, c): i for c in act.chunks})
        after: dict[int, list[Action]] = defaultdict(list)
        for phase, chunks in sorted(backwards.items()):
            for k in range(0, len(chunks), group):
                part = chunks[k:k + group]
                at = max(weight_pass[(phase, c)] for c in part)
                after[at].append(Action(Op.W, phase, part[0], merged=tuple(part[1:])))
        seq = []
        for i, act in enumerate(acts):
            if act.op is Op.B:
                seq.append(replace(act, split=True))
            elif act.op is Op.FB:
                seq.append(replace(act, backward=replace(act.backward, split=True)))
            elif act.op is not Op.W:
                seq.append(act)
            seq.extend(after[i])
        out.append(seq)
    return Schedule(schedule.name, schedule.layout, out)


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of a schedule in the same order (for inference under torch.no_grad())."""
    actions = [[h for a in acts for h in a.halves() if h.op is Op.F] for acts in schedule.actions]
    return Schedule(schedule.name, schedule.layout, actions)


def with_communication(schedule: Schedule) -> Schedule:
    """Add SEND after each action whose result goes to another rank and RECV one compute action
    before each action that needs another rank's data (so the receive is in flight meanwhile),
    posted ahead of the sends that end the compute action before that one: a compute action's
    sends are the last thing before the next compute action starts."""
    layout = schedule.layout
    last = layout.num_stages - 1
    out = []
    for rank, acts in enumerate(schedule.actions):
        seq: list[Action] = []
        computes: list[int] = []  # indices in seq of the compute actions so far
        for act in acts:
            if act.op not in COMPUTE_OPS:
                seq.append(act)
                continue
            recvs, sends = [], []
            for half in act.halves():
                stage = layout.stage_of(rank, half.phase)
                if half.op is Op.F and stage > 0:
                    peer = layout.locate(half.chunk, stage - 1)[0]
                    if peer != rank:
                        recvs.append(Action(Op.RECV_F, half.phase, half.chunk, peer=peer))
                if half.op is Op.F and stage < last:
                    peer = layout.locate(half.chunk, stage + 1)[0]
                    if peer != rank:
                        sends.append(Action(Op.SEND_F, half.phase, half.chunk, peer=peer))
                if half.op is Op.B and stage < last:
                    peer = layout.locate(half.chunk, stage + 1)[0]
                    if peer != rank:
                        recvs.append(Action(Op.RECV_B, half.phase, half.chunk, peer=peer))
                if half.op is Op.B and stage > 0:
                    peer = layout.locate(half.chunk, stage - 1)[0]
                    if peer != rank:
                        sends.append(Action(Op.SEND_B, half.phase, half.chunk, peer=peer))
            at = computes[-2] + 1 if len(computes) > 1 else (computes[-1] if computes else 0)
            seq[at:at] = recvs
            if computes:
                computes[-1] += len(recvs)
            computes.append(len(seq))
            seq.append(act)
            seq.extend(sends)
        out.append(seq)
    return Schedule(schedule.name, layout, out)
