"""All-to-all of variable row counts over one process group, counting the bytes sent to each peer."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from dispatch.topology import Topology
from dispatch.traffic import TrafficMeter


class Channel:
    """One EP group's all-to-all (gloo on CPU, NCCL on CUDA) with per-peer byte accounting."""

    def __init__(self, group: dist.ProcessGroup, topology: Topology, meter: TrafficMeter) -> None:
        self.group, self.topology, self.meter = group, topology, meter
        self.rank = dist.get_rank(group)

    def exchange(self, rows: Tensor, send_splits: list[int], recv_splits: list[int], kind: str,
                 part: str = "payload") -> Tensor:
        """Send send_splits[p] leading rows to each peer p; receive recv_splits[p] rows from each."""
        rows = rows.contiguous()
        row_bytes = rows.element_size() * math.prod(rows.shape[1:])
        for peer, count in enumerate(send_splits):
            if peer != self.rank and count:
                self.meter.add(kind, not self.topology.same_node(self.rank, peer), part, count * row_bytes)
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows, recv_splits, send_splits, group=self.group)
        return out

    def exchange_counts(self, counts: list[int], peers: list[int], kind: str, device: torch.device) -> list[int]:
        """Row counts each peer will send here, in exchange for ours; ranks outside peers send none."""
        stray = [p for p, n in enumerate(counts) if n and p not in peers]
        if stray:
            raise RuntimeError(f"rows planned for ranks {stray} outside this hop's peers {peers}")
        splits = [int(r in peers) for r in range(self.topology.world_size)]
        sent = torch.tensor([counts[p] for p in peers], dtype=torch.int64, device=device)
        received = self.exchange(sent, splits, splits, kind, "meta").tolist()
        recv = [0] * self.topology.world_size
        for peer, count in zip(peers, received):
            recv[peer] = count
        return recv
