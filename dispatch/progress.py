"""Where a rank's main thread is, finer than the trainer's phases: marks that pipeline and MoE code leave
through one module-level hook, a no-op until the trainer's watchdog (launch.faults.watchdog) installs a sink.

A mark is an in-memory assignment (no I/O); the watchdog's own thread publishes the latest marks. Listeners
(`listening`: a rehearsal's phase clock, launch.plan.phases) receive every mark too, beside the sink.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

ACTION, LAYER, EXCHANGE = 0, 1, 2  # levels of a mark: a pipeline action or micro-batch, a layer, an exchange in it


class Sink(Protocol):
    """What receives the marks (launch.faults.watchdog.Progress)."""

    def mark(self, where: str, level: int) -> None:
        """Record where at level, clearing the deeper levels."""


_sink: Sink | None = None
_listeners: list[Sink] = []


def install(sink: Sink | None) -> None:
    """Send the marks to sink (None: drop them)."""
    global _sink
    _sink = sink


def mark(where: str, level: int) -> None:
    """This rank's main thread is now at where (e.g. "layer 3" at LAYER); free when no sink is installed."""
    if _sink is not None:
        _sink.mark(where, level)
    for listener in _listeners:
        listener.mark(where, level)


@contextmanager
def listening(listener: Sink) -> Iterator[None]:
    """Send every mark to listener too while the block runs, whatever sink is installed meanwhile."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
