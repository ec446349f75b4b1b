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
HangKind = Literal["spin", "sleep", "stop", "kill"]  # ops.inject_hang drills: Python loop, blocked, SIGSTOP, SIGKILL
HANG_KINDS = get_args(HangKind)
SpikePolicy = Literal["none", "skip", "rollback"]



MIN_SPIKE_HISTORY = 4  # accepted losses needed before a spike can be called



MIN_HEARTBEATS = 3  # ops.heartbeat_timeout_s spans at least this many of the watchdog's rounds



HANG_FIELDS = ("rank", "step", "kind")



@dataclass
class OpsSettings:
    """[ops]: checkpoint retention and mode, bad-step and loss-spike policies, watchdog, restarts, fault drills.

    inject_nan_steps / inject_spike_steps are drills: the loss of those steps (first time each is
    reached) is multiplied by NaN / SPIKE_INJECTION_FACTOR before backward. inject_hang = {rank, step,
    kind} is a drill too: that rank hangs where it would enter the grad sync of that step (once per run
    directory), by kind: "spin" (a Python loop), "sleep" (blocked before the collective), "stop"
    (SIGSTOP), "kill" (SIGKILL).
    """

    keep_checkpoints: int = 3
    async_checkpoint: bool = False
    max_bad_steps: int = 3
    spike_policy: SpikePolicy = "none"
    spike_window: int = 50
    spike_zscore: float = 6.0
    heartbeat_timeout_s: float = 60.0  # a rank making no progress this long ends the run (0: watchdog off)
    long_phase_timeout_s: float = 240.0  # the same in load, a first step, eval, save (< the 300 s collective timeout)
    max_restarts: int = 0  # restarts of a failed run from its latest checkpoint (moe-train's own spawn)
    inject_nan_steps: list = field(default_factory=list)
    inject_spike_steps: list = field(default_factory=list)
    inject_hang: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("keep_checkpoints", "max_bad_steps"):
            check_positive(f"ops.{name}", getattr(self, name))
        check_positive("ops.max_restarts", self.max_restarts, minimum=0)
        check_positive("ops.spike_window", self.spike_window, minimum=MIN_SPIKE_HISTORY)
        check_choice("ops.spike_policy", self.spike_policy, SpikePolicy)
        if not self.spike_zscore > 0:
            raise ValueError(f"ops.spike_zscore = {self.spike_zscore!r} must be > 0 (e.g. 6.0)")
        shortest = MIN_HEARTBEATS * HEARTBEAT_S
        if not (self.heartbeat_timeout_s == 0 or shortest <= self.heartbeat_timeout_s < math.inf):
            raise ValueError(f"ops.heartbeat_timeout_s = {self.heartbeat_timeout_s!r}; allowed: 0 (watchdog off) or "
                             f">= {shortest:g} seconds ({MIN_HEARTBEATS} heartbeats), finite")
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

