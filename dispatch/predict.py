"""Predict each rank's dispatch/combine traffic from the routing alone (no communication), for planners."""

from __future__ import annotations

import torch
from torch import Tensor

from dispatch.fp8 import fp8_row_bytes
from dispatch.layout import check_routing, expert_owner, lookup, membership
from dispatch.routes import destinations, routes_for
from dispatch.topology import Topology
from dispatch.traffic import Traffic

COUNT_BYTES = 8  # one int64 row count per peer and hop
META_BYTES_PER_SLOT = 8  # fp32 weight + int32 expert id per routing slot and row


def payload_row_bytes(hidden: int, payload: str, dtype: torch.dtype) -> int:
    """Bytes of one dispatched token row on the wire."""
    return fp8_row_bytes(hidden) if payload == "fp8" else hidden * dtype.itemsize


def predict_hops(indices_per_rank: list[Tensor], num_experts: int, topology: Topology, hidden: int,
                 backend: str = "flat", payload: str = "bf16", dtype: torch.dtype = torch.bfloat16,
                 chunks: int = 1) -> list[dict[str, dict[str, Traffic]]]:
    """Per rank, per hop ("ep"; or "rail" then "node"), {"dispatch": Traffic, "combine": Traffic} that
    EPDispatcher's meter counts on that hop's group (TrafficMeter.by_hop) for this routing.

    indices_per_rank[r] is rank r's [T_r, k] routing; dtype is x's dtype (combine travels in it). With
    chunks, a hop's counts travel once per chunk (the first hop's in one exchange), a later hop's
    broken down by the previous hop's peers when chunks > 1; the rows are the same.
    """
    if len(indices_per_rank) != topology.world_size:
        raise ValueError(f"indices_per_rank has {len(indices_per_rank)} entries, expected one per rank "
                         f"({topology.world_size})")
    for ids in indices_per_rank:
        check_routing(ids, num_experts)
    world = topology.world_size
    stages = [routes_for(backend, topology, num_experts, r) for r in range(world)]
    row_bytes = payload_row_bytes(hidden, payload, dtype)
    combine_bytes = hidden * dtype.itemsize
    traffic = [{stage.name: {"dispatch": Traffic(), "combine": Traffic()} for stage in stages[r]} for r in range(world)]
    rows = [ids.long().cpu() for ids in indices_per_rank]
    for hop in range(len(stages[0])):
        arrived: list[list[Tensor]] = [[] for _ in range(world)]
        for src in range(world):
            stage = stages[src][hop]
            sent = traffic[src][stage.name]["dispatch"]
            member = destinations(rows[src], stage, world)
            meta = (rows[src].shape[1] * META_BYTES_PER_SLOT)
            counts = chunks * (len(stages[src][hop - 1].peers) if hop and chunks > 1 else 1) * COUNT_BYTES
            for peer in stage.peers:
                if peer != src:
                    sent.add(not topology.same_node(src, peer), "meta", counts)
            for dst, count in enumerate(member.sum(0).tolist()):
                arrived[dst].append(rows[src][member[:, dst]])
                if dst != src and count:
                    inter = not topology.same_node(src, dst)
                    sent.add(inter, "payload", count * row_bytes)
                    sent.add(inter, "meta", count * meta)
                    traffic[dst][stage.name]["combine"].add(inter, "payload", count * combine_bytes)
        rows = [torch.cat(parts) for parts in arrived]
    return traffic


def predict_traffic(indices_per_rank: list[Tensor], num_experts: int, topology: Topology, hidden: int,
                    backend: str = "flat", payload: str = "bf16", dtype: torch.dtype = torch.bfloat16,
                    chunks: int = 1) -> list[dict[str, Traffic]]:
    """Per rank {"dispatch": Traffic, "combine": Traffic} that EPDispatcher will count for this routing:
    predict_hops summed over the hops."""
    per_hop = predict_hops(indices_per_rank, num_experts, topology, hidden, backend, payload, dtype, chunks)
    return [{kind: sum((hops[name][kind] for name in hops), Traffic()) for kind in ("dispatch", "combine")}
            for hops in per_hop]


def received_rows(indices_per_rank: list[Tensor], num_experts: int, world_size: int) -> list[int]:
    """Token rows each rank receives (once per source token, however many of its experts it holds)."""
    owner = expert_owner(num_experts, world_size)
    return [int(sum(membership(lookup(ids.long().cpu(), owner), world_size)[:, r].sum()
                    for ids in indices_per_rank)) for r in range(world_size)]


def inter_node_copies(indices: Tensor, rank: int, num_experts: int, topology: Topology, backend: str) -> Tensor:
    """[T] copies of each of rank's tokens that cross to another node (flat: per rank, hierarchical: per node)."""
    first = routes_for(backend, topology, num_experts, rank)[0]
    member = destinations(indices.long(), first, topology.world_size)
    remote = torch.tensor([not topology.same_node(rank, r) for r in range(topology.world_size)])
    return (member & remote).sum(1)
