"""Fault handling for long runs (the [ops] settings: launch.config.ops): bad-step and loss-spike guards, preemption.

- StepGuard: a step whose loss or gradient norm is NaN/inf is skipped (no optimizer update); after
  ops.max_bad_steps such steps in a row the run stops with FaultError. A loss whose robust z-score
  against the last ops.spike_window accepted losses (median and MAD) exceeds ops.spike_zscore is a
  spike: skipped, or the run rolls back to its latest checkpoint and goes on with the batches after it.
- Preemption: SIGTERM (or SIGINT) sets a flag; the ranks agree on it after each step, save a
  checkpoint and leave the step loop, so the run exits 0.
- Hangs: the step-progress watchdog (launch.faults.watchdog) ends the run when a rank stops making progress for
  ops.heartbeat_timeout_s (ops.long_phase_timeout_s in load, a first step, eval, save), naming the rank
  and its phase; ops.max_restarts restarts the run from its latest checkpoint (launch.train.launcher).
"""

from __future__ import annotations

import math
import signal
import statistics
import threading
from collections import deque

from launch.config.ops import MIN_SPIKE_HISTORY, OpsSettings


SPIKE_INJECTION_FACTOR = 1000.0  # an injected spike multiplies the step's loss (and gradients) by this



MAD_TO_SIGMA = 1.4826  # a normal distribution's sigma / median absolute deviation



class FaultError(RuntimeError):
    """The run stopped on purpose: too many bad steps in a row."""



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

    def state_dict(self) -> dict[str, list[float]]:
        """The accepted-loss history (checkpointed: spike detection goes on after a resume or a rollback)."""
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        """Restore a state_dict() (its newest ops.spike_window losses)."""
        self.history = deque(state["history"], maxlen=self.ops.spike_window)



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

