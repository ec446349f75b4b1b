"""What the dispatch benchmark's peers share: the EP group, its topology's byte-counting channel, the payload."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dispatch.channel import Channel
from dispatch.choices import check_choice
from dispatch.dispatcher import Payload
from dispatch.layout import check_num_experts
from dispatch.topology import make_topology
from dispatch.traffic import Traffic, TrafficMeter


class PeerDispatcher:
    """Base of the peers: experts split evenly over the group, bytes counted per call (intra/inter-node).

    compute_dtype: the dtype the peer's arithmetic runs in (None: x's); rows travel in x's dtype or fp8."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None, gpus_per_node: int | None = None,
                 payload: str = "bf16", compute_dtype: torch.dtype | None = None) -> None:
        check_choice("payload", payload, Payload)
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.num_experts, self.payload, self.compute_dtype = num_experts, payload, compute_dtype
        self.experts_per_rank = check_num_experts(num_experts, self.world_size)
        self.meter = TrafficMeter()
        self.channel = Channel(self.group, make_topology(self.world_size, gpus_per_node), self.meter)

    @property
    def last_bytes(self) -> dict[str, Traffic]:
        """Traffic of the latest dispatch and combine."""
        return self.meter.last
