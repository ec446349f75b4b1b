"""The classic one-hot capacity dispatch (GShard-style einsums + one even all-to-all), the benchmark's peer."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from dispatch.fp8 import decode_fp8, encode_fp8
from dispatch.layout import check_num_experts, check_routing
from dispatch.predict import payload_row_bytes
from dispatch.topology import Topology
from dispatch.traffic import Traffic
from launch.bench.peer_base import PeerDispatcher


def onehot_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(capacity_factor * T * k / E)."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def onehot_masks(indices: Tensor, weights: Tensor, num_experts: int, capacity: int,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(dispatch mask, combine weights), both [T, E, C]; slots past an expert's capacity are dropped.

    Positions are given slot-major (every token's first choice before any second choice), as in GShard.
    """
    tokens, k = indices.shape
    slots = indices.t()
    onehot = F.one_hot(slots.clamp(min=0), num_experts) * (slots >= 0).unsqueeze(-1)
    position = torch.cumsum(onehot.view(k * tokens, num_experts), 0).view(k, tokens, num_experts) - 1
    slot, token, expert = torch.nonzero((onehot == 1) & (position < capacity), as_tuple=True)
    mask = torch.zeros(tokens, num_experts, capacity, dtype=dtype, device=indices.device)
    combine = torch.zeros_like(mask)
    at = (token, expert, position[slot, token, expert])
    mask[at] = 1
    combine[at] = weights[token, slot].to(dtype)
    return mask, combine


def dropped_slots(indices: Tensor, num_experts: int, capacity: int) -> int:
    """Routing slots of this rank past their expert's capacity (which ones depends on order, how many does not)."""
    kept = indices[indices >= 0]
    return int((torch.bincount(kept, minlength=num_experts) - capacity).clamp(min=0).sum())


def onehot_traffic(topology: Topology, num_experts: int, capacity: int, hidden: int, payload: str = "bf16",
                   dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Traffic]]:
    """Per rank {"dispatch", "combine"} traffic: E_local x C rows to every peer each way, whatever the routing."""
    rows = capacity * check_num_experts(num_experts, topology.world_size)
    traffic = [{"dispatch": Traffic(), "combine": Traffic()} for _ in range(topology.world_size)]
    for src in range(topology.world_size):
        for dst in range(topology.world_size):
            if dst != src:
                inter = not topology.same_node(src, dst)
                traffic[src]["dispatch"].add(inter, "payload", rows * payload_row_bytes(hidden, payload, dtype))
                traffic[src]["combine"].add(inter, "payload", rows * hidden * dtype.itemsize)
    return traffic


class OneHotDispatcher(PeerDispatcher):
    """Every rank sends E_local x C rows to every rank, however few tokens are routed (padding included).

    C = ceil(capacity_factor * T * k / E) with T the largest token count in the group (agreed by one
    all-reduce of a scalar, which GShard's static shapes make free), so every rank's buffers match.
    compute_dtype: the dtype the einsums run in (the CPU's native one; rows travel in x's dtype or fp8).
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None, gpus_per_node: int | None = None,
                 capacity_factor: float = 1.0, payload: str = "bf16", compute_dtype: torch.dtype | None = None) -> None:
        if isinstance(capacity_factor, bool) or not 0 < capacity_factor < math.inf:
            raise ValueError(f"capacity_factor = {capacity_factor!r} must be a finite number > 0")
        super().__init__(num_experts, group, gpus_per_node, payload, compute_dtype)
        self.capacity_factor = capacity_factor

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> tuple[Tensor, int, Tensor]:
        """(expert input [E_local, R*C, H], capacity C, combine weights [T, E, C])."""
        check_routing(indices, self.num_experts, weights, x)
        tokens = torch.tensor([x.shape[0]], device=x.device)
        dist.all_reduce(tokens, dist.ReduceOp.MAX, group=self.group)
        capacity = onehot_capacity(int(tokens), indices.shape[1], self.num_experts, self.capacity_factor)
        self.meter.start("dispatch")
        dtype = self.compute_dtype or x.dtype
        mask, combine = onehot_masks(indices, weights, self.num_experts, capacity, dtype)
        buffer = torch.einsum("tec,th->ech", mask, x.to(dtype)).reshape(-1, x.shape[1]).to(x.dtype)
        wire = encode_fp8(buffer) if self.payload == "fp8" else buffer
        received = self._even_exchange(wire, "dispatch")
        rows = decode_fp8(received, x.shape[1], x.dtype) if self.payload == "fp8" else received
        per_rank = self.experts_per_rank
        expert_in = rows.view(self.world_size, per_rank, capacity, -1).transpose(0, 1).reshape(per_rank, -1, x.shape[1])
        return expert_in, capacity, combine

    def combine(self, y: Tensor, combine: Tensor) -> Tensor:
        """Send expert outputs [E_local, R*C, H] back and weigh them into [T, H] with the combine einsum."""
        self.meter.start("combine")
        capacity = combine.shape[2]
        rows = y.reshape(self.experts_per_rank, self.world_size, capacity, -1).transpose(0, 1).reshape(-1, y.shape[-1])
        back = self._even_exchange(rows, "combine")
        back = back.view(self.num_experts, capacity, -1).to(combine.dtype)
        return torch.einsum("tec,ech->th", combine, back).to(y.dtype)

    def _even_exchange(self, rows: Tensor, kind: str) -> Tensor:
        splits = [rows.shape[0] // self.world_size] * self.world_size
        return self.channel.exchange(rows, splits, splits, kind)
