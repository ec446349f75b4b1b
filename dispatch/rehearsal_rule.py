"""The rehearsal routing rule: the host-side counts a dispatch would have read from the device, for meta tensors.

A rehearsal runs one rank of a full layout with every tensor on `meta` and the `fake` process group:
tensors have shapes but no values and collectives move no data, so nothing can count the routing
(bincount, nonzero, `.tolist()` of counts or offsets, the counts an all-to-all brings back). Every
site that needs such counts asks this module instead, under one branch on `tensor.is_meta`, and the
counts follow ONE rule: the balanced routing that moe-plan (launch/plan/) assumes when it sizes a
layout's memory (T*k expert slot rows per rank); its traffic model differs, see the end.

The rule. Every source rank routes alike: T tokens (its x.shape[0]), k slots each, E experts over
an EP group of R ranks (L = E/R consecutive experts per rank, N nodes of G = R/N ranks).

1. Each expert receives c_e = floor(T*k/E) slots from each source rank, plus one more for the
   lowest (T*k mod E) expert ids. With a capacity C (the router's, per source rank), expert e keeps
   min(C, c_e) of them (the rest are dropped); dropless keeps all. Call the kept count c'_e.
2. A token's k slots land on min(k, R) distinct EP ranks, so a source sends rank r
   rows_r = min(T, S_r) token rows, S_r = sum of c'_e over r's experts (one row per slot when k <= R).
3. Those ranks lie on as many distinct nodes as they can (one rank per node until every node has
   one), so a source sends node n node_rows_n = min(T, sum of rows_r over n's ranks) token rows.
4. Flat dispatch: one hop, rank s sends rows_r rows to every rank r. Hierarchical dispatch: the
   inter-node hop sends node_rows_n rows to the rank with s's local index on node n (the copy for
   s's own node is a self-send); the intra-node hop then sends N * rows_r rows to each rank r of
   s's node (the rows N rail peers relayed here for r). Either way rank r receives R * rows_r token
   rows, R * sum(c'_e) slot rows after expansion, R * c'_e of them for each local expert e.
5. Because every rank routes alike, what each peer of a hop sends here equals what this rank
   sends itself in that hop (received_counts).
6. Wherever rows sorted by group are split over G groups without the counts at hand (grouped GEMM
   offsets, the FP8 weight grad's columns), M rows split as balanced_split(M, G): the
   same floor-plus-remainder-to-the-lowest-ids split as rule 1 (kernels.grouped_ref holds it, since
   kernels may not import dispatch). A fixed-order sum of P values into N rows (dispatch.segment)
   takes them spread evenly over the rows: its pass j adds min(N, max(0, P - j*N)) of them.
7. A dispatch pipelined in C chunks sends each peer, in each hop, balanced_split(rows, C) of the rows
   rule 4 gives that hop (chunk_counts): the chunks add up to the unchunked dispatch.

8. A real-device rehearsal (tensors with values, collectives still fake) routes by the rule too (forcing):
   slot j of token t takes position p = (t k + j) mod E of a round-robin over the experts, and position p
   is expert L * r + p // R of rank r = (q mod N) * G + q // N, q = p mod R: a token's consecutive slots
   go to consecutive q, so to min(k, R) distinct ranks spread over min(k, N) nodes (rules 2 and 3), and
   each expert takes T*k/E slots (rule 1's counts exactly when E divides T*k; otherwise its remainder
   lands on other experts, as many of them).

The router marks its meta indices with the capacity it applied (mark_capacity); a dispatcher reads
it back (capacity_of). Unmarked indices count as dropless.

Against moe-plan: its memory model holds T*k expert slot rows per rank, as here. Its traffic model
samples a node-limited routing instead (DeepSeek-V3: topk_groups = 4 of 8 node-sized groups), where a
token's experts can share ranks and reach at most 4 nodes; rule 3 spreads them over all nodes, an
upper bound on the hierarchical inter-node hop (V3, T = 4096: 7 remote node copies per token here,
3.47 there; token rows received per rank 32768 here, about 30660 there, from 7.48 ranks per token).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dispatch.choices import check_choice
from dispatch.topology import DispatchBackend, Topology
from kernels.grouped_ref import balanced_split

__all__ = ["DispatchPlan", "assignment", "balanced_split", "capacity_of", "chunk_counts", "expert_slots", "forced",
           "forcing", "mark_capacity", "node_rows", "pass_offsets", "plan_dispatch", "rank_rows", "received_counts"]

_CAPACITY_ATTR = "_rehearsal_capacity"
_forcing: list[Topology] = []  # the EP topology routing follows while a real-device rehearsal runs (rule 8)


def expert_slots(tokens: int, top_k: int, num_experts: int, capacity: int | None = None) -> list[int]:
    """Rule 1: slots each expert keeps from one source rank of `tokens` tokens."""
    slots = balanced_split(tokens * top_k, num_experts)
    return slots if capacity is None else [min(capacity, n) for n in slots]


def rank_rows(tokens: int, top_k: int, num_experts: int, ep: int, capacity: int | None = None) -> list[int]:
    """Rule 2: token rows one source rank sends each of the ep ranks (experts in blocks of E/ep)."""
    slots, per_rank = expert_slots(tokens, top_k, num_experts, capacity), num_experts // ep
    return [min(tokens, sum(slots[r * per_rank:(r + 1) * per_rank])) for r in range(ep)]


def node_rows(rows: list[int], topology: Topology, tokens: int) -> list[int]:
    """Rule 3: token rows one source rank sends each node, from its rows per rank."""
    gpn = topology.gpus_per_node
    return [min(tokens, sum(rows[n * gpn:(n + 1) * gpn])) for n in range(topology.num_nodes)]


@dataclass
class DispatchPlan:
    """One rank's dispatch under the rule: per hop the rows sent to (and received from) each group rank,
    and the slot rows that arrive for each local expert."""

    sends: list[list[int]]
    recvs: list[list[int]]
    expert_rows: list[int]

    @property
    def received_rows(self) -> int:
        """Token rows that arrive here (before expansion to one row per local expert)."""
        return sum(self.recvs[-1])


def plan_dispatch(tokens: int, top_k: int, num_experts: int, topology: Topology, rank: int, backend: str,
                  capacity: int | None = None) -> DispatchPlan:
    """Rule 4: the hops of a flat or hierarchical dispatch by `rank` of the group topology describes."""
    world, nodes = topology.world_size, topology.num_nodes
    rows = rank_rows(tokens, top_k, num_experts, world, capacity)
    if backend == "flat":
        hops = [(rows, list(range(world)))]
    elif backend == "hierarchical":
        node, local = topology.node_of(rank), topology.local_rank(rank)
        across = [0] * world
        for n, count in enumerate(node_rows(rows, topology, tokens)):
            across[topology.rank_at(n, local)] = count
        inside = [nodes * rows[r] if topology.node_of(r) == node else 0 for r in range(world)]
        hops = [(across, topology.rail_ranks(rank)), (inside, topology.node_ranks(rank))]
    else:
        check_choice("backend", backend, DispatchBackend)
    per_rank = num_experts // world
    slots = expert_slots(tokens, top_k, num_experts, capacity)[rank * per_rank:(rank + 1) * per_rank]
    return DispatchPlan([sends for sends, _ in hops], [received_counts(sends, peers, rank) for sends, peers in hops],
                        [world * n for n in slots])


def received_counts(send_splits: list, peers: list[int], rank: int, zero: Any = 0) -> list:
    """Rule 5: what each group rank sends here in a hop where this rank sends send_splits[p] (a count, or a
    row of counts) to each rank p (peers only); zero for the others."""
    members = set(peers)
    return [send_splits[rank] if p in members else zero for p in range(len(send_splits))]


def chunk_counts(counts: list[int], chunks: int) -> list[list[int]]:
    """Rule 7: a hop's rows per rank split over the chunks of a pipelined dispatch, [rank][chunk]."""
    return [balanced_split(n, chunks) for n in counts]


def pass_offsets(values: int, targets: int, passes: int) -> list[int]:
    """Rule 6: where each pass of a fixed-order sum of values into targets starts, then values."""
    return [min(values, j * targets) for j in range(passes)] + [values]


def mark_capacity(indices: Tensor, capacity: int | None) -> Tensor:
    """Record on meta indices the per-expert capacity the router applied (None: dropless); returns indices."""
    if indices.is_meta:
        setattr(indices, _CAPACITY_ATTR, capacity)
    return indices


def capacity_of(indices: Tensor) -> int | None:
    """The capacity mark_capacity recorded on indices (None when unmarked: dropless)."""
    return getattr(indices, _CAPACITY_ATTR, None)


def assignment(tokens: int, top_k: int, num_experts: int, topology: Topology, device: torch.device) -> Tensor:
    """Rule 8: [tokens, top_k] expert ids (int64, on device) routing by the rule over topology's EP ranks."""
    ranks, per_node, nodes = topology.world_size, topology.gpus_per_node, topology.num_nodes
    position = torch.arange(tokens * top_k, device=device) % num_experts
    q = position % ranks
    rank = (q % nodes) * per_node + q // nodes
    return (rank * (num_experts // ranks) + position // ranks).view(tokens, top_k)


@contextmanager
def forcing(topology: Topology) -> Iterator[None]:
    """Routers route by rule 8 over topology (the EP group's) while the block runs (a real-device rehearsal)."""
    _forcing.append(topology)
    try:
        yield
    finally:
        _forcing.pop()


def forced() -> Topology | None:
    """The EP topology routing is forced onto (forcing), or None."""
    return _forcing[-1] if _forcing else None
