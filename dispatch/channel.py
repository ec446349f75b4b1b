"""All-to-all of variable row counts over one hop's process group, counting the bytes sent to each peer.

A Channel is the transport of one hop (flat: the EP group; hierarchical: the node group or the rail
group). Splits are given over the whole EP group (one entry per EP rank, zero for ranks outside the
hop); the channel exchanges with its hop's peers only, on a group holding exactly them (or, without
hop groups, on the EP group with zero rows for the others). HopTransport is the interface a channel
implements and the seam where a GPU transport plugs in (see transport_for).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Generator, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from dispatch import rehearsal_rule
from dispatch.pending import Pending
from dispatch.topology import Topology
from dispatch.traffic import TrafficMeter
from dispatch.upload import upload

Steps = Generator["Pending", None, Any]  # a computation that yields each exchange it leaves in flight


def run_steps(steps: Steps) -> Any:
    """Drive a generator of exchanges to its end without pausing and return its value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


class HopTransport(Protocol):
    """How one hop moves rows between its peers (EP ranks, ascending, self included).

    start_exchange sends send_splits[p] leading rows of rows to each EP rank p (rows grouped by
    destination, in EP-rank order; zero for ranks outside the hop) and receives recv_splits[p] rows
    from each, grouped by source (both None: equal blocks to and from every peer, a padded exchange's
    fixed sizes); start_counts trades rows of host counts ([EP rank][column]) with the
    hop's peers. Both are asynchronous (a Pending) and are issued in the same order on every peer.
    `meter` counts the bytes handed to the transport per peer and hop; `name` is the hop ("ep",
    "node", "rail"); `topology` and `rank` place this EP rank.
    """

    peers: list[int]
    name: str
    rank: int
    topology: Topology
    meter: TrafficMeter

    def start_exchange(self, rows: Tensor, send_splits: list[int] | None, recv_splits: list[int] | None, kind: str,
                       part: str = "payload") -> Pending: ...  # noqa: D102

    def start_counts(self, counts: list[list[int]], kind: str, device: torch.device) -> Pending: ...  # noqa: D102


class Channel:
    """One hop's all-to-all over a process group (gloo on CPU, NCCL on CUDA), with per-peer byte
    accounting; implements HopTransport.

    group's ranks, in group order, are the EP ranks `members` (default: peers, a group holding exactly
    the hop's peers; a wider group, e.g. the whole EP group, carries zero rows from and for the members
    outside the hop). peers default to every rank of group, rank (this process's EP rank) to its rank in
    group. One channel's exchanges must be issued in the same order on every rank of the group, so a
    channel serves one thread at a time.
    """

    def __init__(self, group: dist.ProcessGroup, topology: Topology, meter: TrafficMeter,
                 peers: list[int] | None = None, rank: int | None = None, name: str = "ep",
                 members: list[int] | None = None) -> None:
        peers = list(range(dist.get_world_size(group))) if peers is None else peers
        members = peers if members is None else members
        rank = dist.get_rank(group) if rank is None else rank
        if len(members) != dist.get_world_size(group) or members[dist.get_rank(group)] != rank \
                or not set(peers) <= set(members):
            raise ValueError(f"the {name} group must hold EP ranks {members} in order, this EP rank {rank} and "
                             f"the hop's peers {peers} among them; got a group of {dist.get_world_size(group)}")
        self.group, self.topology, self.meter, self.name = group, topology, meter, name
        self.peers, self.members, self.rank = peers, members, rank

    def _own(self, splits: list[int]) -> list[int]:
        """splits over the EP group -> over the group's members; rows for ranks outside the hop are an error."""
        if sum(splits) != sum(splits[p] for p in self.peers):
            stray = [p for p, n in enumerate(splits) if n and p not in self.peers]
            raise RuntimeError(f"rows planned for ranks {stray} outside the {self.name} hop's peers {self.peers}")
        return [splits[p] for p in self.members]

    def start_exchange(self, rows: Tensor, send_splits: list[int] | None, recv_splits: list[int] | None, kind: str,
                       part: str = "payload") -> Pending:
        """Start sending send_splits[p] leading rows to each peer p and receiving recv_splits[p] from each; None for
        both: equal blocks of rows to and from each member of the group (a padded exchange: sizes from the shape,
        nothing read to the host)."""
        rows = rows.contiguous()
        row_bytes = rows.element_size() * math.prod(rows.shape[1:])
        if send_splits is None:
            block = rows.shape[0] // len(self.members)
            if rows.shape[0] != block * len(self.members) or self.members != self.peers or recv_splits is not None:
                raise ValueError(f"an equal-split exchange on the {self.name} hop sends one block per peer to a group "
                                 f"of exactly its peers: got {rows.shape[0]} rows for members {self.members}, "
                                 f"peers {self.peers}")
            send_splits = [block if p in self.peers else 0 for p in range(self.topology.world_size)]
        for peer in self.peers:
            if peer != self.rank and send_splits[peer]:
                self.meter.add(kind, not self.topology.same_node(self.rank, peer), part,
                               send_splits[peer] * row_bytes, peer, self.name)
        if recv_splits is None:
            out = torch.empty_like(rows)
            work = dist.all_to_all_single(out, rows, group=self.group, async_op=True)
        else:
            out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
            work = dist.all_to_all_single(out, rows, self._own(recv_splits), self._own(send_splits),
                                          group=self.group, async_op=True)
        return Pending(work, lambda: out, keep=(rows, out))

    def exchange(self, rows: Tensor, send_splits: list[int], recv_splits: list[int], kind: str,
                 part: str = "payload") -> Tensor:
        """start_exchange, waited for: the rows received, grouped by source rank."""
        return self.start_exchange(rows, send_splits, recv_splits, kind, part).wait()

    def start_counts(self, counts: list[list[int]], kind: str, device: torch.device) -> Pending:
        """Start trading counts (counts[p]: a row of host ints for EP rank p, zeros outside the hop) with
        this hop's peers; the Pending gives, per EP rank, the row that rank sends here (zeros outside)."""
        width = len(counts[0])
        stray = [p for p, row in enumerate(counts) if any(row) and p not in self.peers]
        if stray:
            raise RuntimeError(f"rows planned for ranks {stray} outside the {self.name} hop's peers {self.peers}")
        rows = [counts[p] for p in self.peers]
        sent = upload(rows, torch.int64, device)  # on CUDA queued from pinned memory: the host goes on
        one_each = [int(p in self.peers) for p in range(self.topology.world_size)]
        pending = self.start_exchange(sent, one_each, one_each, kind, "meta")

        def recv_counts() -> list[list[int]]:
            got = pending.wait()
            if got.is_meta:  # a rehearsal: counts hold no values; each peer sends what this rank sends itself
                return rehearsal_rule.received_counts(counts, self.peers, self.rank, [0] * width)
            recv = [[0] * width for _ in range(self.topology.world_size)]
            for peer, row in zip(self.peers, got.tolist()):  # host sync: the counts size the exchanges after it
                recv[peer] = row
            return recv
        return Pending(None, recv_counts)


GPU_TRANSPORTS: list[tuple[Callable[[dist.ProcessGroup], bool], type]] = []
"""(capable(group), transport class) pairs that transport_for tries, in order, for intra-node hops."""


def transport_for(group: dist.ProcessGroup, topology: Topology, meter: TrafficMeter, peers: list[int], rank: int,
                  name: str, members: list[int] | None = None) -> HopTransport:
    """The transport of one hop: for the intra-node hop ("node") on its own group, the first registered GPU
    transport capable of that group, else a Channel (torch.distributed all_to_all_single, any backend).

    This is the seam for one-sided GPU transports: a class taking Channel's first six constructor
    arguments and implementing HopTransport with, e.g., torch symmetric memory
    (`torch.distributed._symmetric_memory`: buffers rendezvoused once over the node group, rows written
    straight into the peers' buffers by an all_to_all_vdev-style kernel) or NVSHMEM puts, registered
    with GPU_TRANSPORTS.append((capable, cls)), where capable(group) checks what it needs (an NCCL
    group, its ranks NVLink-connected, symmetric memory available). members: as for Channel (a group
    wider than the hop takes no GPU transport). Nothing is registered in this tree (it has no GPU
    transport), so every hop runs on Channel.
    """
    for capable, cls in GPU_TRANSPORTS if name == "node" and members is None else ():
        if capable(group):
            return cls(group, topology, meter, peers, rank, name)
    return Channel(group, topology, meter, peers, rank, name, members)
