"""Fault handling for long runs: the [ops] settings, bad-step and loss-spike guards, preemption, a rank watchdog.

- StepGuard: a step whose loss or gradient norm is NaN/inf is skipped (no optimizer update); after
  ops.max_bad_steps such steps in a row the run stops with FaultError. A loss whose robust z-score
  against the last ops.spike_window accepted losses (median and MAD) exceeds ops.spike_zscore is a
  spike: skipped, or the run rolls back to its latest checkpoint and goes on with the batches after it.
- Preemption: SIGTERM (or SIGINT) sets a flag; the ranks agree on it after each step, save a
  checkpoint and leave the step loop, so the run exits 0.
- Watchdog: each rank touches RUN_DIR/heartbeat/rankNNNNN every second; a thread of each rank checks
  the others' and, when one has been silent for ops.heartbeat_timeout_s (killed, stopped, hung),
  prints which rank and ends its own process, so the whole run ends within that bound.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from moe.config import check_choice, check_positive

SPIKE_POLICIES = ("none", "skip", "rollback")
SPIKE_INJECTION_FACTOR = 1000.0  # an injected spike multiplies the step's loss (and gradients) by this
MIN_SPIKE_HISTORY = 4  # accepted losses needed before a spike can be called
MAD_TO_SIGMA = 1.4826  # a normal distribution's sigma / median absolute deviation
WATCHDOG_EXIT = 3  # exit code of a rank whose watchdog found a silent peer
HEARTBEAT_S = 1.0


class FaultError(RuntimeError):
    """The run stopped on purpose: too many bad steps in a row."""


@dataclass
class OpsSettings:
    """[ops]: checkpoint retention and mode, bad-step and loss-spike policies, watchdog, fault drills.

    inject_nan_steps / inject_spike_steps are drills: the loss of those steps (first time each is
    reached) is multiplied by NaN / SPIKE_INJECTION_FACTOR before backward.
    """

    keep_checkpoints: int = 3
    async_checkpoint: bool = False
    max_bad_steps: int = 3
    spike_policy: str = "none"
    spike_window: int = 50
    spike_zscore: float = 6.0
    heartbeat_timeout_s: float = 60.0
    inject_nan_steps: list = field(default_factory=list)
    inject_spike_steps: list = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("keep_checkpoints", "max_bad_steps"):
            check_positive(f"ops.{name}", getattr(self, name))
        check_positive("ops.spike_window", self.spike_window, minimum=MIN_SPIKE_HISTORY)
        check_choice("ops.spike_policy", self.spike_policy, SPIKE_POLICIES)
        if not self.spike_zscore > 0:
            raise ValueError(f"ops.spike_zscore = {self.spike_zscore!r} must be > 0 (e.g. 6.0)")
        if not 0 <= self.heartbeat_timeout_s < math.inf:
            raise ValueError(f"ops.heartbeat_timeout_s = {self.heartbeat_timeout_s!r} must be >= 0 seconds "
                             f"(0 turns the watchdog off; >= {3 * HEARTBEAT_S:g} to be useful)")
        for name in ("inject_nan_steps", "inject_spike_steps"):
            for value in getattr(self, name):
                check_positive(f"ops.{name} entry", value, minimum=0)


class StepGuard:
    """Judges each step from its global loss and gradient norm (the same numbers on every rank, so every
    rank takes the same decision without communicating)."""

    def __init__(self, ops: OpsSettings) -> None:
        self.ops = ops
        self.history: deque[float] = deque(maxlen=ops.spike_window)
        self.bad_in_row: list[int] = []
        self.pending_injections = {"nan": set(ops.inject_nan_steps), "spike": set(ops.inject_spike_steps)}

    def loss_scale(self, step: int, scale: float) -> float:
        """The step's loss scale, poisoned on a drill step (each drill fires once)."""
        for kind, factor in (("nan", math.nan), ("spike", SPIKE_INJECTION_FACTOR)):
            if step in self.pending_injections[kind]:
                self.pending_injections[kind].discard(step)
                return scale * factor
        return scale

    def zscore(self, loss: float) -> float:
        """Robust z-score of loss against the accepted history (0 while the history is short)."""
        if len(self.history) < MIN_SPIKE_HISTORY:
            return 0.0
        median = statistics.median(self.history)
        mad = statistics.median(abs(x - median) for x in self.history)
        return (loss - median) / max(MAD_TO_SIGMA * mad, 1e-6 * abs(median), 1e-12)

    def verdict(self, step: int, loss: float, grad_norm: float) -> str:
        """"ok", "nonfinite" (skip), "spike" (skip or roll back, per ops.spike_policy); raises FaultError
        on the ops.max_bad_steps-th non-finite step in a row."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.bad_in_row.append(step)
            if len(self.bad_in_row) >= self.ops.max_bad_steps:
                raise FaultError(f"{len(self.bad_in_row)} steps in a row (steps {self.bad_in_row}) had a non-finite "
                                 f"loss or gradient norm (last: loss {loss}, grad norm {grad_norm}); ops.max_bad_steps "
                                 f"= {self.ops.max_bad_steps}: stopping. Resume from the last checkpoint with a lower "
                                 f"train.lr or another train.seed")
            return "nonfinite"
        self.bad_in_row = []
        if self.ops.spike_policy != "none" and self.zscore(loss) > self.ops.spike_zscore:
            return "spike"
        self.history.append(loss)
        return "ok"


class Preemption:
    """SIGTERM/SIGINT set a flag instead of killing the process (installed for the step loop, then restored)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        self.received = signum

    @property
    def requested(self) -> bool:
        """Whether this rank got the signal (the trainer's stats all-reduce makes every rank stop after the same step)."""
        return self.received is not None


class Watchdog:
    """Heartbeat files under folder plus a thread that ends this process when a peer goes silent; enter it
    after a collective (every rank alive), a rank leaving it removes its file."""

    def __init__(self, folder: str | Path, rank: int, world_size: int, timeout_s: float) -> None:
        self.folder = Path(folder)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def path(self, rank: int) -> Path:
        """Heartbeat file of rank."""
        return self.folder / f"rank{rank:05d}"

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0 and self.world_size > 1:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.path(self.rank).touch()
            self._thread = threading.Thread(target=self._run, name="moe-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.path(self.rank).unlink(missing_ok=True)  # a finished rank is not a silent one

    def _run(self) -> None:
        started = time.time()
        while not self._stop.wait(HEARTBEAT_S):
            now = time.time()
            os.utime(self.path(self.rank), (now, now))
            for peer in range(self.world_size):
                try:
                    seen = max(self.path(peer).stat().st_mtime, started)
                except FileNotFoundError:  # finished (or not started: the launcher sees ranks that never start)
                    continue
                if peer != self.rank and now - seen > self.timeout_s:
                    print(f"watchdog on rank {self.rank}: rank {peer} stopped sending heartbeats {now - seen:.0f} s "
                          f"ago (killed, stopped or hung; ops.heartbeat_timeout_s = {self.timeout_s:g}); "
                          f"ending this rank", file=sys.stderr, flush=True)
                    os._exit(WATCHDOG_EXIT)
