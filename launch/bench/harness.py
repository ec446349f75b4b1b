"""The one timing harness of the suites: warm-up rounds, then timed rounds that run every contender once in
turn (A B C A B C ...), each call under the per-call budget; per contender the median of its rounds and their
spread, and per ratio of two contenders the median and spread of the ratio taken round by round, so a shared
machine's drift (it hits A, B and C of one round alike) cancels out of the ratios.

A suite's JSON rows carry, for each timed metric M (e.g. "step_ms"), M (the median over rounds), M_spread
(its spread), the row's `repeats` (timed rounds), and for each ratio R, R and R_spread: `fields`,
`ratio_fields` and `check_row` say so in one place.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from launch.bench.progress import call_budget

Measured = float | Mapping[str, float] | None  # what a contender's call returns (see rounds)


@dataclass
class Timing:
    """One quantity's values, one per timed round (seconds, or a ratio)."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        """Median over rounds."""
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """Interquartile range over the median (0 with fewer than two rounds)."""
        if len(self.samples) < 2 or self.median == 0:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return (q3 - q1) / abs(self.median)

    @property
    def repeats(self) -> int:
        """Timed rounds."""
        return len(self.samples)

    def _pairs(self, other: Timing) -> zip:
        if other.repeats != self.repeats:
            raise ValueError(f"round by round needs the same rounds: {self.repeats} against {other.repeats}")
        return zip(self.samples, other.samples)

    def __truediv__(self, other: Timing) -> Timing:
        """The ratio round by round (both from the same rounds)."""
        return Timing([a / b for a, b in self._pairs(other)])

    def __add__(self, other: Timing) -> Timing:
        """The sum round by round (e.g. a dispatch and its combine)."""
        return Timing([a + b for a, b in self._pairs(other)])


def rounds(contenders: Mapping[str, Callable[[], Measured]], warmup: int, repeats: int,
           budget_s: float | None = None, opts: dict[str, Any] | None = None, what: str = "call",
           rotate: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, dict[str, Timing]]:
    """Run warmup untimed rounds, then repeats timed ones; a round calls every contender once, in order (rotate:
    each round starting one contender later, so none always runs first). A call returns None (its wall time is
    taken, as "time"), seconds (as "time") or {name: seconds} (several quantities of one call, e.g. a step and
    its optimizer part). Every call runs under call_budget(budget_s, "contender NAME WHAT", opts).
    Returns {contender: {quantity: Timing}}."""
    if warmup < 0:
        raise ValueError(f"warmup = {warmup} must be >= 0")
    if repeats < 1:
        raise ValueError(f"repeats = {repeats} must be >= 1")
    names = list(contenders)
    out: dict[str, dict[str, Timing]] = {name: {} for name in names}
    for r in range(warmup + repeats):
        order = names[r % len(names):] + names[:r % len(names)] if rotate else names
        spent = []
        for name in order:
            with call_budget(budget_s, f"contender {name!r} {what}", opts):
                began = time.perf_counter()
                got = contenders[name]()
                took = time.perf_counter() - began
            values = {"time": took if got is None else got} if not isinstance(got, Mapping) else dict(got)
            spent.append(f"{name} {1e3 * next(iter(values.values())):.1f}")
            if r >= warmup:
                for quantity, seconds in values.items():
                    out[name].setdefault(quantity, Timing()).samples.append(seconds)
        if progress is not None:
            progress(f"round {r + 1}/{warmup + repeats}{' (warmup)' if r < warmup else ''}, ms: {', '.join(spent)}")
    return out


def slowest(per_rank: list[Timing]) -> Timing:
    """Each round's slowest rank (ranks timed the same rounds)."""
    return Timing([max(values) for values in zip(*(t.samples for t in per_rank))])


def fields(metric: str, timing: Timing, scale: float = 1e3) -> dict[str, float | int]:
    """A row's fields for one timed metric: its median (times scale: ms by default), spread and repeats."""
    return {metric: timing.median * scale, f"{metric}_spread": timing.spread, "repeats": timing.repeats}


def ratio_fields(name: str, ratio: Timing) -> dict[str, float]:
    """A row's fields for one ratio: its median over rounds and spread."""
    return {name: ratio.median, f"{name}_spread": ratio.spread}


def timed_metric(name: str) -> bool:
    """Whether a metric is a time (named in ms or s, not a rate per s): those carry a spread and the row its
    repeats."""
    return name.endswith("_ms") or (name.endswith("_s") and not name.endswith("_per_s"))


def check_row(row: Mapping[str, Any], metrics: Mapping[str, str]) -> list[str]:
    """What a suite's JSON row lacks of the harness's fields for the timed metrics it holds (empty: nothing)."""
    timed = [m for m in metrics if timed_metric(m) and row.get(m) is not None]
    missing = [f"{m}_spread" for m in timed if f"{m}_spread" not in row]
    return missing + (["repeats"] if timed and "repeats" not in row else [])


def round_options(parser: argparse.ArgumentParser, steps: int, warmup: int, budget_s: float, unit: str) -> None:
    """The options every suite timed in rounds shares: --steps, --warmup, --call-budget, --quiet, --json."""
    parser.add_argument("--steps", type=int, default=steps, help=f"timed {unit}s per contender")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed {unit}s per contender")
    parser.add_argument("--call-budget", type=float, default=budget_s,
                        help=f"seconds one {unit} may take before the run stops naming it (0: no budget)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Refuse (parser.error, naming the option) any of these integer options below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
