"""[ops]: the settings of a long run's fault handling (checkpoint retention, bad-step and loss-spike guards,
the step-progress watchdog, restarts, fault drills), and the watchdog constants they are checked against.

launch.faults.guard and launch.faults.watchdog act on these settings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from dispatch.choices import check_choice
from moe.config import check_positive

HEARTBEAT_S = 1.0  # how often each rank pushes its progress and the monitor judges
MIN_HEARTBEATS = 3  # ops.heartbeat_timeout_s spans at least this many of the watchdog's rounds
WATCHDOG_OFF = 0.0  # ops.heartbeat_timeout_s: no watchdog
MIN_SPIKE_HISTORY = 4  # accepted losses needed before a spike can be called
SpikePolicy = Literal["none", "skip", "rollback"]
HangKind = Literal["spin", "sleep", "stop", "kill"]  # ops.inject_hang's kinds
HANG_KINDS = get_args(HangKind)
HANG_FIELDS = ("rank", "step", "kind")


@dataclass
class OpsSettings:
    """[ops]: checkpoint retention and mode, bad-step and loss-spike policies, the step-progress watchdog, restarts,
    fault drills (launch.faults)."""

    keep_checkpoints: int = 3
    """Published checkpoints kept in run_dir/checkpoint; older ones are deleted."""
    async_checkpoint: bool = False
    """Write checkpoints on a helper thread while training goes on (bitwise the same files)."""
    max_bad_steps: int = 3
    """Steps in a row whose loss or gradient norm is NaN or infinite (each skipped, no update) before the run
    stops."""
    spike_policy: SpikePolicy = "none"
    """What a loss spike (spike_zscore) does: "none" nothing, "skip" skips the step's update, "rollback" goes back
    to the latest checkpoint and on with the batches after it."""
    spike_window: int = 50
    """Accepted losses (the latest) a spike is judged against, by their median and median absolute deviation; at
    least `MIN_SPIKE_HISTORY`, the history a spike needs."""
    spike_zscore: float = 6.0
    """Robust z-score above which a loss is a spike (> 0)."""
    heartbeat_timeout_s: float = 60.0
    """Seconds a rank may make no progress before the watchdog ends the run, naming it; `WATCHDOG_OFF` turns the
    watchdog off; else at least `MIN_HEARTBEATS` of the watchdog's rounds of `HEARTBEAT_S` seconds."""
    long_phase_timeout_s: float = 240.0
    """The same in the long phases: loading, a first step, evaluation, saving (seconds; >= heartbeat_timeout_s,
    below the 300 s collective timeout)."""
    max_restarts: int = 0
    """Restarts of a failed run from its latest checkpoint (moe-train's own spawn, one node)."""
    rendezvous_timeout_s: float = 300.0
    """Seconds moe-train's own spawn on several nodes waits for every rank to join the rendezvous (> 0, finite):
    while it waits, node 0 reports every 10 seconds which ranks (on which nodes) are missing,
    and another node that its node 0 does not answer; past it the run ends naming them (exit 1)."""
    inject_nan_steps: list[int] = field(default_factory=list)
    """Drill: steps whose loss is multiplied by NaN before the backward (the first time each is reached)."""
    inject_spike_steps: list[int] = field(default_factory=list)
    """Drill: steps whose loss is multiplied by launch.faults.guard.SPIKE_INJECTION_FACTOR before the backward
    (the first time each is reached)."""
    inject_hang: dict[str, int | str] = field(default_factory=dict)
    """Drill: {rank = R, step = S, kind = K} hangs rank R where it would enter step S's gradient sync (once per run
    directory), by kind K: "spin" (a Python loop), "sleep" (blocked before the collective), "stop" (SIGSTOP),
    "kill" (SIGKILL)."""

    def __post_init__(self) -> None:
        for name in ("keep_checkpoints", "max_bad_steps"):
            check_positive(f"ops.{name}", getattr(self, name))
        check_positive("ops.max_restarts", self.max_restarts, minimum=0)
        check_positive("ops.spike_window", self.spike_window, minimum=MIN_SPIKE_HISTORY)
        check_choice("ops.spike_policy", self.spike_policy, SpikePolicy)
        if not self.spike_zscore > 0:
            raise ValueError(f"ops.spike_zscore = {self.spike_zscore!r} must be > 0 (e.g. 6.0)")
        shortest = MIN_HEARTBEATS * HEARTBEAT_S
        if not (self.heartbeat_timeout_s == WATCHDOG_OFF or shortest <= self.heartbeat_timeout_s < math.inf):
            raise ValueError(f"ops.heartbeat_timeout_s = {self.heartbeat_timeout_s!r}; allowed: {WATCHDOG_OFF:g} "
                             f"(watchdog off) or >= {shortest:g} seconds ({MIN_HEARTBEATS} heartbeats), finite")
        if not 0 < self.rendezvous_timeout_s < math.inf:
            raise ValueError(f"ops.rendezvous_timeout_s = {self.rendezvous_timeout_s!r} must be > 0 and finite "
                             f"(seconds; default 300)")
        if not self.heartbeat_timeout_s <= self.long_phase_timeout_s < math.inf:
            raise ValueError(f"ops.long_phase_timeout_s = {self.long_phase_timeout_s!r} must be finite and >= "
                             f"ops.heartbeat_timeout_s = {self.heartbeat_timeout_s!r} seconds")
        for name in ("inject_nan_steps", "inject_spike_steps"):
            for value in getattr(self, name):
                check_positive(f"ops.{name} entry", value, minimum=0)
        if self.inject_hang:
            if sorted(self.inject_hang) != sorted(HANG_FIELDS):
                raise ValueError(f"ops.inject_hang = {self.inject_hang!r} must give exactly {', '.join(HANG_FIELDS)} "
                                 f"(e.g. {{rank = 1, step = 2, kind = \"spin\"}})")
            for name in ("rank", "step"):
                check_positive(f"ops.inject_hang.{name}", self.inject_hang[name], minimum=0)
            check_choice("ops.inject_hang.kind", self.inject_hang["kind"], HangKind)

