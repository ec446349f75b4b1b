"""Byte counters of token movement, split intra-node / inter-node and payload / routing metadata."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor

from dispatch.layout import device_index
from dispatch.upload import upload

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


FIELDS = tuple(f.name for f in fields(Traffic))  # the order of Traffic's counters (TrafficMeter.tables' columns)


@dataclass
class _Owed:
    """Rows counted on the device (TrafficMeter.add_rows), not read yet: rows[i] rows of row_bytes to EP rank
    peers[i]; in_last / in_total: whether they still belong to their kind's latest call / to the cumulative counters."""

    kind: str
    part: str
    hop: str | None
    peers: list[int]
    inter: list[bool]
    row_bytes: int
    rows: Tensor
    in_last: bool = True
    in_total: bool = True


class TrafficMeter:
    """Per-call (`last`) and cumulative (`total`) traffic by call kind ("dispatch", "combine_backward", ...),
    cumulative traffic by hop then kind (`by_hop`: "ep" flat, "rail" and "node" hierarchical) and cumulative
    bytes by destination rank of the EP group over all kinds (`sent_to`).

    Bytes whose row counts live on the device (a device-split exchange, dispatch.device_split: add_rows) are kept as
    device tensors, never read while counted: `tables` adds them up on the device (the trainer's statistics carry
    them), and reading last / total / sent_to / by_hop reads them first, in one copy (a test's or a bench's read,
    after the step)."""

    def __init__(self) -> None:
        self._last: dict[str, Traffic] = {}
        self._total: dict[str, Traffic] = {}
        self._sent_to: dict[int, int] = {}
        self._by_hop: dict[str, dict[str, Traffic]] = {}
        self._owed: list[_Owed] = []

    @property
    def last(self) -> dict[str, Traffic]:
        """Traffic of the latest call of each kind."""
        self._settle()
        return self._last

    @property
    def total(self) -> dict[str, Traffic]:
        """Traffic since clear(), by kind."""
        self._settle()
        return self._total

    @property
    def sent_to(self) -> dict[int, int]:
        """Bytes since clear() by destination EP rank."""
        self._settle()
        return self._sent_to

    @property
    def by_hop(self) -> dict[str, dict[str, Traffic]]:
        """Traffic since clear() by hop, then kind."""
        self._settle()
        return self._by_hop

    def start(self, kind: str) -> None:
        """Begin a new call of kind: its `last` counter restarts at zero (inside deferred(): logged instead)."""
        if _logs:
            _logs[-1].append((self, "start", (kind,)))
            return
        self._keep(lambda owed: owed.kind != kind, "in_last")
        self._last[kind] = Traffic()
        self._total.setdefault(kind, Traffic())

    def add(self, kind: str, inter: bool, part: str, nbytes: int, peer: int | None = None,
            hop: str | None = None) -> None:
        """Count bytes of the current call of kind (sent to EP rank peer over hop, when given); inside deferred():
        logged instead."""
        if _logs:
            _logs[-1].append((self, "add", (kind, inter, part, nbytes, peer, hop)))
            return
        self._count(kind, inter, part, nbytes, peer, hop, True, True)

    def add_rows(self, kind: str, part: str, rows: Tensor, row_bytes: int, peers: list[int], inter: list[bool],
                 hop: str | None = None) -> None:
        """Count rows[i] rows of row_bytes bytes sent to EP rank peers[i] (inter[i]: on another node) in the current
        call of kind, rows an int64 tensor on the device: kept (a copy, as it is now), not read (inside deferred():
        logged instead, so that each replay of a captured graph keeps the counts that replay left in rows)."""
        if _logs:
            _logs[-1].append((self, "add_rows", (kind, part, rows, row_bytes, peers, inter, hop)))
            return
        self._owed.append(_Owed(kind, part, hop, list(peers), list(inter), row_bytes, rows.detach().clone()))

    def tables(self, kinds: tuple[str, ...], ep: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(float64 [len(kinds), len(FIELDS)] bytes since clear() by kind and counter, float64 [ep] by destination EP
        rank) on device, the host-counted bytes and the ones counted on the device added up there: nothing is read."""
        by_kind = [[getattr(self._total.get(kind, Traffic()), f) for f in FIELDS] for kind in kinds]
        sent = [self._sent_to.get(peer, 0) for peer in range(ep)]
        host = upload([value for row in by_kind for value in row] + sent, torch.float64, device)  # one queued copy
        by_kind, sent = host[:len(kinds) * len(FIELDS)].view(len(kinds), len(FIELDS)), host[len(kinds) * len(FIELDS):]
        for owed in self._owed:
            if not owed.in_total or owed.kind not in kinds:
                continue
            nbytes = owed.rows.to(device=device, dtype=torch.float64) * owed.row_bytes
            column = tuple(FIELDS.index(f"{'inter' if inter else 'intra'}_{owed.part}") for inter in owed.inter)
            by_kind[kinds.index(owed.kind)].index_add_(0, device_index(column, device), nbytes)
            sent.index_add_(0, device_index(tuple(owed.peers), device), nbytes)
        return by_kind, sent

    def clear(self) -> None:
        """Restart every cumulative counter (a new training step)."""
        self._keep(lambda owed: False, "in_total")
        self._total.clear()
        self._sent_to.clear()
        self._by_hop.clear()

    def _count(self, kind: str, inter: bool, part: str, nbytes: int, peer: int | None, hop: str | None, last: bool,
               total: bool) -> None:
        """Add nbytes to the latest call of kind (last) and to the cumulative counters (total)."""
        if last:
            self._last[kind].add(inter, part, nbytes)
        if not total:
            return
        self._total[kind].add(inter, part, nbytes)
        if peer is not None:
            self._sent_to[peer] = self._sent_to.get(peer, 0) + nbytes
        if hop is not None:
            self._by_hop.setdefault(hop, {}).setdefault(kind, Traffic()).add(inter, part, nbytes)

    def _keep(self, still: Any, flag: str) -> None:
        """Unset flag on the owed counts for which still(owed) is false; forget those that count nowhere then."""
        for owed in self._owed:
            if not still(owed):
                setattr(owed, flag, False)
        self._owed = [owed for owed in self._owed if owed.in_last or owed.in_total]

    def _settle(self) -> None:
        """Read the counts kept on the device (one copy for all of them) into the host counters."""
        if not self._owed:
            return
        owed, self._owed = self._owed, []
        values = torch.cat([o.rows.reshape(-1).cpu() for o in owed]).tolist()  # the one read, after the step
        at = 0
        for o in owed:
            for peer, inter in zip(o.peers, o.inter):
                self._count(o.kind, inter, o.part, values[at] * o.row_bytes, peer, o.hop, o.in_last, o.in_total)
                at += 1


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
