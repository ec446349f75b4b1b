"""Step-progress watchdog: a rank that is killed, stopped, stuck in Python or stuck in a collective while the
others move on ends the run within its budget, named with the phase it is stuck in.

- Each rank's main thread publishes its progress in memory: Progress.enter at the trainer's phases (the same
  phases in the same order on every rank), finer marks from pipeline and MoE code through dispatch.progress.
  No I/O on the hot path.
- A thread of each rank pushes that progress (a beat the thread counts, the main thread's move and phase
  counters, the phase) to the rendezvous TCPStore about once a second, one key per rank, and reads the
  monitor's tick and the abort key in one multi_get: 2 store operations per rank per second at any world
  size, over the watchdog's own connection to the store (no shared filesystem).
- Rank 0's thread is the monitor: per second one multi_get of every rank's key and the abort key, and one
  multi_set of its own key and its tick. It compares counters, never clocks of other hosts, timing on its own
  monotonic clock how long each rank has not moved. It names a rank whose beat stopped (killed, stopped), or,
  when the job stalls, the rank furthest behind (fewest phases entered, then the earliest to stop moving),
  once that rank has not moved for its budget: ops.heartbeat_timeout_s, or ops.long_phase_timeout_s while it
  is in a phase entered as long (load, a process's first step, eval, save).
- The verdict reaches every rank through the abort key; each live rank writes its Python stacks to
  RUN_DIR/hang/rankNNNNN.txt, waits for the other live ranks' (at most DUMP_WAIT_S: the ranks the verdict found
  silent, and a rank the launcher saw die, are counted as dumped, since they cannot write) and exits with
  WATCHDOG_EXIT, and the launcher ends the job at once (restarting it under ops.max_restarts). The other ranks watch the monitor's tick:
  rank 0 silent for its budget ends them too. Where the launcher holds the store (own spawn, node 0), a rank
  that died is named with its last phase and the abort key tells the others at once (on_rank_death).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch.distributed as dist

from dispatch import progress as marks
from launch.config.ops import HEARTBEAT_S, WATCHDOG_OFF

if TYPE_CHECKING:
    from launch.config.ops import OpsSettings

WATCHDOG_EXIT = 3  # exit code of a rank the watchdog ended
HANG_PHASE = "grad sync"  # a hang drill fires where its rank would enter this phase of its step
DUMP_WAIT_S = 3 * HEARTBEAT_S  # a rank ending waits at most this long for the others' stacks before it exits
DONE = "done"  # a rank's value once it left the watchdog (and the monitor's)
NO_ABORT = "-"  # the abort key's value until a verdict
LEVELS = 3  # depth of dispatch.progress marks: ACTION, LAYER, EXCHANGE


class Keys:
    """The watchdog's store keys for one attempt of a run (torchrun keeps one store across its restarts)."""

    def __init__(self, world_size: int, restart: int = 0) -> None:
        self.prefix = f"moe-watchdog/{restart}/"
        self.ranks = [self.rank(r) for r in range(world_size)]
        self.monitor, self.abort, self.dumped = (self.prefix + name for name in ("monitor", "abort", "dumped"))

    def rank(self, rank: int) -> str:
        """The key of rank's progress."""
        return f"{self.prefix}rank{rank}"


class Progress:
    """This rank's phase and step as its main thread last entered them, and the finer marks since: plain
    attribute updates, read once a second by the watchdog's thread. Also fires the ops.inject_hang drill."""

    def __init__(self, rank: int, drill: dict | None = None, drill_marker: Path | None = None) -> None:
        self.rank, self.drill, self.drill_marker = rank, drill or {}, drill_marker
        self.seq = 0  # phases entered: the same sequence on every rank
        self.moves = 0  # phases entered and marks left
        self.step: int | None = None
        self.phase, self.long = "start", False  # until the trainer enters its first phase
        self.detail = ("",) * LEVELS

    def enter(self, phase: str, step: int | None = None, long: bool = False) -> None:
        """This rank starts phase (of step); long: judged against ops.long_phase_timeout_s."""
        if self.drill and (self.drill["rank"], self.drill["step"], HANG_PHASE) == (self.rank, step, phase):
            self._hang()
        self.step, self.phase, self.long, self.detail = step, phase, long, ("",) * LEVELS
        self.seq += 1
        self.moves += 1

    def mark(self, where: str, level: int) -> None:
        """A finer position inside the phase (dispatch.progress levels); deeper levels are cleared."""
        self.detail = (*self.detail[:level], where, *("",) * (LEVELS - 1 - level))
        self.moves += 1

    def where(self) -> str:
        """The phase and the marks, e.g. "step 2 forward/backward / F of stage 1 chunk 0 / layer 3 / dispatch"."""
        head = self.phase if self.step is None else f"step {self.step} {self.phase}"
        return " / ".join([head, *(d for d in self.detail if d)])

    def report(self, beat: int) -> str:
        """The value pushed to the store: beat, moves, phases entered, long flag, where."""
        return f"{beat} {self.moves} {self.seq} {int(self.long)} {self.where()}"

    def _hang(self) -> None:
        """The drill: once per run directory (a marker file is written as it fires), hang as ops.inject_hang's
        kind says, after two heartbeats in place (so the phase is published, as a real step's length lets it)."""
        if self.drill_marker is None or self.drill_marker.exists():
            return
        time.sleep(2 * HEARTBEAT_S)
        self.drill_marker.parent.mkdir(parents=True, exist_ok=True)
        self.drill_marker.touch()
        kind = self.drill["kind"]
        print(f"ops.inject_hang: rank {self.rank} hangs ({kind}) before {HANG_PHASE!r} of step {self.step}",
              file=sys.stderr, flush=True)
        if kind in ("stop", "kill"):
            os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
        while kind == "sleep":
            time.sleep(HEARTBEAT_S)
        while kind == "spin":
            pass


@dataclass
class _Seen:
    """What the monitor last saw of one rank, and when (its own clock) the beat and the moves last changed."""

    beat: int
    moves: int
    seq: int
    long: bool
    where: str
    beat_at: float
    moved_at: float


class Monitor:
    """Rank 0's judge of every rank's pushed progress, timed on its own clock (a callable returning seconds,
    monotonic): observe returns the verdict that ends the run, or None."""

    def __init__(self, timeout_s: float, long_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.long_timeout_s, self.clock = timeout_s, long_timeout_s, clock
        self.seen: dict[int, _Seen] = {}
        self.silent: list[int] = []  # at a verdict: the ranks whose beats had paused (they cannot write stacks)

    def budget(self, long: bool) -> float:
        """Seconds a rank in a phase (long or not) may go without moving."""
        return self.long_timeout_s if long else self.timeout_s

    def observe(self, values: Sequence[str]) -> str | None:
        """Take one reading of every rank's value (DONE: left the watchdog) and judge it."""
        now = self.clock()
        for rank, value in enumerate(values):
            if value == DONE:
                self.seen.pop(rank, None)
                continue
            beat, moves, seq, long, where = value.split(" ", 4)
            old = self.seen.get(rank)
            self.seen[rank] = _Seen(int(beat), int(moves), int(seq), long == "1", where,
                                    now if old is None or old.beat != int(beat) else old.beat_at,
                                    now if old is None or old.moves != int(moves) else old.moved_at)
        if not self.seen:
            return None
        silent = {r: now - s.beat_at for r, s in self.seen.items()}
        stopped = [r for r, s in self.seen.items() if silent[r] > self.budget(s.long) / 2]  # beats paused
        self.silent = stopped
        rank = min(self.seen, key=lambda r: (self.seen[r].seq, self.seen[r].moved_at, r))  # the furthest behind
        laggard = self.seen[rank]
        stalled = now - laggard.moved_at > self.budget(laggard.long)
        if stalled and stopped or any(silent[r] > self.budget(self.seen[r].long) for r in stopped):
            rank = max(stopped, key=lambda r: (silent[r], -r))  # a stopped process stalls the others: the cause
            return self._verdict(rank, f"stopped publishing progress {silent[rank]:.0f} s ago (killed or stopped)")
        if stalled:
            return self._verdict(rank, f"made no progress for {now - laggard.moved_at:.0f} s, the furthest behind of "
                                       f"the running ranks (stuck in Python or in a collective)")
        return None

    def _verdict(self, rank: int, what: str) -> str:
        seen = self.seen[rank]
        field = "long_phase_timeout_s" if seen.long else "heartbeat_timeout_s"
        return f"rank {rank} {what} in {seen.where!r} (ops.{field} = {self.budget(seen.long):g})"


class Watchdog:
    """Context manager of every rank (entered by all ranks alike, exited when the rank leaves the loop): yields
    the rank's Progress and, with a store, runs the thread that pushes it (and on rank 0 the Monitor)."""

    def __init__(self, store: dist.Store | None, rank: int, world_size: int, timeout_s: float, long_timeout_s: float,
                 run_dir: str | Path, drill: dict | None = None, restart: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.dumps = Path(run_dir) / "hang"
        self.progress = Progress(rank, drill, self.dumps / "drill-fired")
        self.keys = Keys(world_size, restart)
        self.timeout_s, self.long_timeout_s = timeout_s, long_timeout_s
        self.monitor = Monitor(timeout_s, long_timeout_s, clock) if rank == 0 else None
        self.clock = clock
        self.beat = 0
        self.everyone_in = False  # monitor: every rank has pushed once
        self.opened = clock()
        self.tick = ("", self.opened)  # others: the monitor's last value and when it changed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        marks.install(self.progress)
        if self.store is not None:
            self.open()
            self._thread = threading.Thread(target=self._run, name="moe-watchdog", daemon=True)
            self._thread.start()
        return self.progress

    def __exit__(self, *exc) -> None:
        marks.install(None)
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(RuntimeError):  # a finished rank is not a stuck one
            self.store.set(self.keys.ranks[self.rank], DONE)
            if self.monitor is not None:
                self.store.set(self.keys.monitor, DONE)

    def open(self) -> None:
        """Push this rank's first value; create the monitor's and the abort key where no rank has yet."""
        self.store.set(self.keys.ranks[self.rank], self.progress.report(self.beat))
        self.store.compare_set(self.keys.monitor, "", "tick 0 1")
        self.store.compare_set(self.keys.abort, "", NO_ABORT)

    def poll(self) -> str | None:
        """One round of the thread (public for the counting harness): push this rank's progress, then judge every
        rank's (monitor) or read the monitor's tick; returns the verdict that ends this rank, or None."""
        self.beat += 1
        mine = self.progress.report(self.beat)
        if self.monitor is None:
            self.store.set(self.keys.ranks[self.rank], mine)
            tick, abort = (v.decode() for v in self.store.multi_get([self.keys.monitor, self.keys.abort]))
            return abort if abort != NO_ABORT else self._judge_monitor(tick)
        if not self.everyone_in:
            self.store.set(self.keys.ranks[self.rank], mine)
            self.everyone_in = self.store.check(self.keys.ranks)
            if not self.everyone_in and self.clock() - self.opened > self.long_timeout_s:
                missing = [r for r, key in enumerate(self.keys.ranks) if not self.store.check([key])]
                return self._abort(f"ranks {missing} never published progress within ops.long_phase_timeout_s = "
                                   f"{self.long_timeout_s:g} s of rank 0")
            return None
        *values, abort = (v.decode() for v in self.store.multi_get([*self.keys.ranks, self.keys.abort]))
        if abort != NO_ABORT:  # the launcher saw a rank die
            return abort
        values[self.rank] = mine
        verdict = self.monitor.observe(values)
        if verdict is not None:
            self.store.add(self.keys.dumped, len(self.monitor.silent))  # the silent ranks' stacks are not awaited
            return self._abort(verdict)
        self.store.multi_set([self.keys.ranks[self.rank], self.keys.monitor],
                             [mine, f"tick {self.beat} {int(self.progress.long)}"])
        return None

    def _judge_monitor(self, tick: str) -> str | None:
        """None while the monitor's tick moves (or it is done); a verdict once it has not for rank 0's budget."""
        now = self.clock()
        if tick == DONE or tick != self.tick[0]:
            self.tick = (tick, now)
            return None
        budget = self.long_timeout_s if tick.endswith(" 1") else self.timeout_s  # rank 0 in a long phase
        if now - self.tick[1] <= budget:
            return None
        last = self.store.get(self.keys.ranks[0]).decode().split(" ", 4)[-1]
        return (f"rank 0, which runs the watchdog's monitor, stopped answering {now - self.tick[1]:.0f} s ago "
                f"(killed or stopped) in {last!r}")

    def _abort(self, verdict: str) -> str:
        self.store.set(self.keys.abort, verdict)
        return verdict

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                verdict = self.poll()
            except RuntimeError as error:  # the store's own timeout is the budget: it did not answer for that long
                verdict = f"the rendezvous store did not answer ({error})"
            if verdict is not None:
                self._end(verdict)

    def _end(self, verdict: str) -> None:
        """Say why, write this rank's Python stacks, wait (briefly) for the other live ranks' stacks, exit."""
        print(f"watchdog on rank {self.rank}: {verdict}; ending the run (Python stacks of the live ranks in "
              f"{self.dumps})", file=sys.stderr, flush=True)
        self.dumps.mkdir(parents=True, exist_ok=True)
        with open(self.dumps / f"rank{self.rank:05d}.txt", "w") as out:
            faulthandler.dump_traceback(out, all_threads=True)
        with contextlib.suppress(RuntimeError):
            dumped = self.store.add(self.keys.dumped, 1)
            deadline = self.clock() + DUMP_WAIT_S
            # no rank leaves (failing its peers' collectives at once) before every live rank has written its stacks
            while dumped < self.world_size and self.clock() < deadline:
                time.sleep(HEARTBEAT_S / 10)
                dumped = self.store.add(self.keys.dumped, 0)
        os._exit(WATCHDOG_EXIT)


def rendezvous_store(timeout_s: float) -> dist.Store:
    """A connection of the watchdog's own to the rendezvous store under the default process group (the
    launcher's or torchrun's TCPStore, unprefixed), with timeout_s as its timeout: the trainer's store traffic
    and the watchdog's never wait on each other."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    store = store.clone()
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def run_watchdog(ops: OpsSettings, run_dir: str | Path, rank: int, world_size: int, enabled: bool = True) -> Watchdog:
    """The trainer's watchdog: on when enabled, with several ranks and ops.heartbeat_timeout_s other than
    WATCHDOG_OFF (without, its Progress only records, and the ops.inject_hang drill still fires)."""
    on = enabled and world_size > 1 and ops.heartbeat_timeout_s != WATCHDOG_OFF
    return Watchdog(rendezvous_store(ops.heartbeat_timeout_s) if on else None, rank, world_size,
                    ops.heartbeat_timeout_s, ops.long_phase_timeout_s, run_dir, ops.inject_hang,
                    int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def on_rank_death(store: dist.Store, rank: int) -> str:
    """The launcher's words on a rank that died (launch.parallel.spawn's on_death): the phase it last published; and
    the abort key set (unless a verdict is there already), so every live rank writes its stacks and leaves."""
    keys = Keys(0)
    if not store.check([keys.rank(rank)]):
        return ""
    value = store.get(keys.rank(rank)).decode()
    if value == DONE:
        return ""
    where = value.split(" ", 4)[-1]
    verdict = f"rank {rank} died in {where!r} (seen by the launcher)"
    if store.compare_set(keys.abort, NO_ABORT, verdict).decode() == verdict:
        store.add(keys.dumped, 1)  # the live ranks do not wait for the dead rank's stacks
    return f"; its last published phase: {where!r}"
