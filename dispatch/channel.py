"""All-to-all of variable row counts over one process group, counting the bytes sent to each peer."""

from __future__ import annotations

import math
from typing import Any, Callable, Generator

import torch
import torch.distributed as dist
from torch import Tensor

from dispatch import rehearsal
from dispatch.topology import Topology
from dispatch.traffic import TrafficMeter

Steps = Generator["Pending", None, Any]  # a computation that yields each exchange it leaves in flight


class Pending:
    """An exchange in flight: wait() blocks until it has arrived and returns its result."""

    def __init__(self, work: dist.Work | None, result: Callable[[], Any], keep: Tensor | None = None) -> None:
        self.work, self._result = work, result
        self._keep = keep  # the send buffer, alive until the exchange is done

    def wait(self) -> Any:
        """Block until the exchange is complete; return what arrived."""
        if self.work is not None:
            self.work.wait()
        return self._result()


def run_steps(steps: Steps) -> Any:
    """Drive a generator of exchanges to its end without pausing and return its value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


class Channel:
    """One EP group's all-to-all (gloo on CPU, NCCL on CUDA) with per-peer byte accounting.

    start_* issue an exchange asynchronously (async_op) and return a Pending; the plain methods
    wait for it. One channel's exchanges must be issued in the same order on every rank of the
    group, so a channel serves one thread at a time.
    """

    def __init__(self, group: dist.ProcessGroup, topology: Topology, meter: TrafficMeter) -> None:
        self.group, self.topology, self.meter = group, topology, meter
        self.rank = dist.get_rank(group)

    def start_exchange(self, rows: Tensor, send_splits: list[int], recv_splits: list[int], kind: str,
                       part: str = "payload") -> Pending:
        """Start sending send_splits[p] leading rows to each peer p and receiving recv_splits[p] from each."""
        rows = rows.contiguous()
        row_bytes = rows.element_size() * math.prod(rows.shape[1:])
        for peer, count in enumerate(send_splits):
            if peer != self.rank and count:
                self.meter.add(kind, not self.topology.same_node(self.rank, peer), part, count * row_bytes, peer)
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        work = dist.all_to_all_single(out, rows, recv_splits, send_splits, group=self.group, async_op=True)
        return Pending(work, lambda: out, keep=rows)

    def exchange(self, rows: Tensor, send_splits: list[int], recv_splits: list[int], kind: str,
                 part: str = "payload") -> Tensor:
        """start_exchange, waited for: the rows received, grouped by source rank."""
        return self.start_exchange(rows, send_splits, recv_splits, kind, part).wait()

    def start_counts(self, counts: list[int], peers: list[int], kind: str, device: torch.device) -> Pending:
        """Start trading row counts with peers; the Pending gives the counts each peer will send here
        (ranks outside peers send none)."""
        stray = [p for p, n in enumerate(counts) if n and p not in peers]
        if stray:
            raise RuntimeError(f"rows planned for ranks {stray} outside this hop's peers {peers}")
        splits = [int(r in peers) for r in range(self.topology.world_size)]
        sent = torch.tensor([counts[p] for p in peers], dtype=torch.int64, device=device)
        pending = self.start_exchange(sent, splits, splits, kind, "meta")

        def recv_counts() -> list[int]:
            got = pending.wait()
            if got.is_meta:  # a rehearsal: counts hold no values; each peer sends what this rank sends itself
                return rehearsal.received_counts(counts, peers, self.rank)
            recv = [0] * self.topology.world_size
            for peer, count in zip(peers, got.tolist()):  # host sync: the counts size the receive buffers
                recv[peer] = count
            return recv
        return Pending(None, recv_counts)

    def exchange_counts(self, counts: list[int], peers: list[int], kind: str, device: torch.device) -> list[int]:
        """start_counts, waited for."""
        return self.start_counts(counts, peers, kind, device).wait()
