"""The standard per-expert all-to-all peer (Megatron-Core's alltoall token dispatcher), with byte counters.

One row per (token, expert) routing slot, permuted so each expert's rows are contiguous, one
all_to_all_single with per-rank splits summed from the per-expert counts (exchanged first), then the
received chunks re-sorted from (source rank, local expert) to (local expert, source rank) order for
the grouped GEMM. No node awareness and no dedup: a token routed to k experts is sent k times, even
when several of them live on one rank. Routing weights stay on the source rank and are applied when
the rows come back (combine), so only the rows and the count exchange travel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dispatch.fp8 import decode_fp8, encode_fp8
from dispatch.layout import check_num_experts, check_routing, expert_owner
from dispatch.predict import COUNT_BYTES, payload_row_bytes
from dispatch.topology import Topology
from dispatch.traffic import Traffic
from launch.bench.peer_base import PeerDispatcher


def per_expert_traffic(indices_per_rank: list[Tensor], num_experts: int, topology: Topology, hidden: int,
                       payload: str = "bf16", dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Traffic]]:
    """Per rank {"dispatch", "combine"} Traffic PerExpertDispatcher counts for this routing (no communication):
    a row per routing slot to the expert's rank, E_local int64 counts to every peer."""
    world = topology.world_size
    per_rank = check_num_experts(num_experts, world)
    owner = expert_owner(num_experts, world)
    traffic = [{"dispatch": Traffic(), "combine": Traffic()} for _ in range(world)]
    for src, ids in enumerate(indices_per_rank):
        check_routing(ids, num_experts)
        rows_to = torch.bincount(owner[ids[ids >= 0].long().cpu()], minlength=world).tolist()
        for dst, rows in enumerate(rows_to):
            if dst != src:
                inter = not topology.same_node(src, dst)
                traffic[src]["dispatch"].add(inter, "meta", per_rank * COUNT_BYTES)
                traffic[src]["dispatch"].add(inter, "payload", rows * payload_row_bytes(hidden, payload, dtype))
                traffic[dst]["combine"].add(inter, "payload", rows * hidden * dtype.itemsize)
    return traffic


class PerExpertDispatcher(PeerDispatcher):
    """dispatch(x, indices, weights) -> (rows [N, H] grouped by local expert, rows per local expert, handle);
    combine(y, handle) -> [T, H] = sum_k weights[t, k] * y(t, k). compute_dtype: the dtype the weighted sum
    runs in (the CPU's native one; the rows travel in x's dtype or fp8)."""

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, tuple]:
        """Permute one row per kept slot by expert, exchange counts, then rows; group them by local expert."""
        check_routing(indices, self.num_experts, weights, x)
        self.meter.start("dispatch")
        token, slot = torch.nonzero(indices >= 0, as_tuple=True)
        order = torch.argsort(indices[token, slot], stable=True)
        token, slot = token[order], slot[order]
        per_expert = torch.bincount(indices[token, slot], minlength=self.num_experts)
        ranks, local = self.world_size, self.experts_per_rank
        ones = [1] * ranks
        counts = self.channel.exchange(per_expert.view(ranks, local), ones, ones, "dispatch", "meta")  # [src, local]
        send_splits, recv_splits = per_expert.view(ranks, local).sum(1).tolist(), counts.sum(1).tolist()
        rows = x[token]
        wire = encode_fp8(rows) if self.payload == "fp8" else rows
        received = self.channel.exchange(wire, send_splits, recv_splits, "dispatch")
        received = decode_fp8(received, x.shape[1], x.dtype) if self.payload == "fp8" else received
        chunks = received.split(counts.flatten().tolist())
        expert_rows = torch.cat([chunks[src * local + e] for e in range(local) for src in range(ranks)])
        handle = (token, weights[token, slot], counts, send_splits, recv_splits, x.shape[0])
        return expert_rows, counts.sum(0), handle

    def combine(self, y: Tensor, handle: tuple) -> Tensor:
        """Undo the expert grouping, send the rows back, weigh and sum them per token."""
        token, weight, counts, send_splits, recv_splits, num_tokens = handle
        self.meter.start("combine")
        ranks, local = self.world_size, self.experts_per_rank
        chunks = y.split(counts.t().flatten().tolist())
        by_source = torch.cat([chunks[e * ranks + src] for src in range(ranks) for e in range(local)])
        back = self.channel.exchange(by_source, recv_splits, send_splits, "combine")
        dtype = self.compute_dtype or y.dtype
        out = torch.zeros(num_tokens, y.shape[1], dtype=dtype, device=y.device)
        out.index_add_(0, token, back.to(dtype) * weight.to(dtype).unsqueeze(1))
        return out.to(y.dtype)
