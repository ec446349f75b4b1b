"""Byte counters of token movement, split intra-node / inter-node and payload / routing metadata."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

_logs: list[list[tuple[TrafficMeter, str, tuple[Any, ...]]]] = []  # open deferred() logs, innermost last


@dataclass
class Traffic:
    """Bytes one rank handed to the transport for peers (self-sends count zero)."""

    intra_payload: int = 0
    inter_payload: int = 0
    intra_meta: int = 0
    inter_meta: int = 0

    @property
    def intra_node(self) -> int:
        """All bytes sent to peers on the same node."""
        return self.intra_payload + self.intra_meta

    @property
    def inter_node(self) -> int:
        """All bytes sent to peers on other nodes."""
        return self.inter_payload + self.inter_meta

    def add(self, inter: bool, part: str, nbytes: int) -> None:
        """Count nbytes of part ("payload" or "meta") to an inter- or intra-node peer."""
        name = f"{'inter' if inter else 'intra'}_{part}"
        setattr(self, name, getattr(self, name) + nbytes)

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))

    def as_dict(self) -> dict[str, int]:
        """Counters plus the intra_node / inter_node totals."""
        return {**asdict(self), "intra_node": self.intra_node, "inter_node": self.inter_node}


class TrafficMeter:
    """Per-call (`last`) and cumulative (`total`) traffic by call kind ("dispatch", "combine_backward", ...),
    cumulative traffic by hop then kind (`by_hop`: "ep" flat, "rail" and "node" hierarchical) and cumulative
    bytes by destination rank of the EP group over all kinds (`sent_to`)."""

    def __init__(self) -> None:
        self.last: dict[str, Traffic] = {}
        self.total: dict[str, Traffic] = {}
        self.sent_to: dict[int, int] = {}
        self.by_hop: dict[str, dict[str, Traffic]] = {}

    def start(self, kind: str) -> None:
        """Begin a new call of kind: its `last` counter restarts at zero (inside deferred(): logged instead)."""
        if _logs:
            _logs[-1].append((self, "start", (kind,)))
            return
        self.last[kind] = Traffic()
        self.total.setdefault(kind, Traffic())

    def add(self, kind: str, inter: bool, part: str, nbytes: int, peer: int | None = None,
            hop: str | None = None) -> None:
        """Count bytes of the current call of kind (sent to EP rank peer over hop, when given); inside deferred():
        logged instead."""
        if _logs:
            _logs[-1].append((self, "add", (kind, inter, part, nbytes, peer, hop)))
            return
        self.last[kind].add(inter, part, nbytes)
        self.total[kind].add(inter, part, nbytes)
        if peer is not None:
            self.sent_to[peer] = self.sent_to.get(peer, 0) + nbytes
        if hop is not None:
            self.by_hop.setdefault(hop, {}).setdefault(kind, Traffic()).add(inter, part, nbytes)

    def clear(self) -> None:
        """Restart every cumulative counter (a new training step)."""
        self.total.clear()
        self.sent_to.clear()
        self.by_hop.clear()


@contextmanager
def deferred() -> Iterator[list[tuple[TrafficMeter, str, tuple[Any, ...]]]]:
    """Inside, every meter's counting is logged, not done: the log (yielded) is the host-side counting of the work
    inside, which redo() does when that work runs (a captured CUDA graph: its capture runs the Python once and counts
    nothing, each replay counts through redo)."""
    log: list[tuple[TrafficMeter, str, tuple[Any, ...]]] = []
    _logs.append(log)
    try:
        yield log
    finally:
        _logs.remove(log)


def redo(log: list[tuple[TrafficMeter, str, tuple[Any, ...]]]) -> None:
    """Do the counting a deferred() log holds, in order."""
    for meter, method, args in log:
        getattr(meter, method)(*args)
