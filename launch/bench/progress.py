"""Progress lines and the per-call time budget of the suites; run_ranks spawns through launch.parallel.spawn."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from launch.parallel.spawn import WorkerError, run_processes

EXIT_OVER_BUDGET = 75
BUDGET_FILE = "budget_report"  # key of the workers' opts: where an over-budget call is reported
PROGRESS_START = "progress_start"  # key of the workers' opts: the launcher's Progress.start


class BudgetExceeded(RuntimeError):
    """A timed call ran past the per-call budget; the message names the contender and the call."""


class BenchProgress:
    """Prints '[moe-bench SUITE  12.3 s] text' on stderr at once (silent when not enabled); seconds since start
    (a time.time() value, e.g. the launching process's Progress.start, so workers count from the same moment)."""

    def __init__(self, suite: str, enabled: bool = True, start: float | None = None) -> None:
        self.suite, self.enabled, self.start = suite, enabled, time.time() if start is None else start

    def __call__(self, text: str) -> None:
        """One progress line."""
        if self.enabled:
            print(f"[moe-bench {self.suite} {time.time() - self.start:6.1f} s] {text}", file=sys.stderr, flush=True)


def _over_budget(seconds: float, what: str, report: str | None) -> None:
    message = f"{what} was still running after the per-call budget of {seconds:g} s"
    if report:
        with open(report, "a") as fh:
            fh.write(message + "\n")
    print(f"moe-bench: {message}; stopping", file=sys.stderr, flush=True)
    os._exit(EXIT_OVER_BUDGET)  # the main thread may be inside a collective that never returns


@contextmanager
def call_budget(seconds: float | None, what: str, opts: dict[str, Any] | None = None) -> Iterator[None]:
    """Ends this process, reporting `what` (e.g. "one-hot bf16 combine") to run_ranks, if the block runs
    longer than seconds (None or 0: no budget)."""
    if not seconds:
        yield
        return
    timer = threading.Timer(seconds, _over_budget, (seconds, what, (opts or {}).get(BUDGET_FILE)))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def worker_progress(suite: str, rank: int, opts: dict[str, Any]) -> BenchProgress:
    """Rank 0's progress lines in a worker (unless opts["quiet"]), timed from the launcher's start."""
    return BenchProgress(suite, rank == 0 and not opts.get("quiet"), opts.get(PROGRESS_START))


def run_ranks(fn: Callable[..., Any], world_size: int, opts: dict[str, Any], hint: str, *, backend: str = "gloo",
              threads: int = 1, timeout_s: float = 3600.0, progress: BenchProgress | None = None) -> list[Any]:
    """run_processes(fn, world_size, opts) where fn(rank, world, opts) may use call_budget(..., opts):
    a call over budget raises BudgetExceeded naming it, followed by hint (how to make the run smaller).
    With progress: says that the processes start, and workers' worker_progress counts from its start."""
    if progress is not None:
        progress(f"starting {world_size} {backend} processes")
        opts = {**opts, PROGRESS_START: progress.start}
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        report = Path(tmp) / "over_budget.txt"
        try:
            return run_processes(fn, world_size, {**opts, BUDGET_FILE: str(report)}, backend=backend,
                                 threads=threads, timeout_s=timeout_s)
        except WorkerError:
            if report.exists():
                raise BudgetExceeded(f"{report.read_text().splitlines()[0]}; {hint}") from None
            raise
