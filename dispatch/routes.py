"""Hops of the flat and hierarchical dispatch: where each routing slot goes next, and to which peers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dispatch.choices import check_choice
from dispatch.layout import device_index, expert_owner, lookup, membership
from dispatch.segment import SegmentPlan, pass_sizes, segment_plan, static_plan
from dispatch.topology import DispatchBackend, Topology


@dataclass
class HopRoute:
    """One all-to-all step as seen by one rank: next rank of each expert's slots, and its peers."""

    next_rank: Tensor  # [E] int64 rank a slot for expert e goes to in this step, -1 if none
    peers: list[int]   # ranks exchanged with in this step (ascending, self included)
    name: str          # the hop's process group: "ep" (flat), "rail" (inter-node) or "node" (intra-node)


@dataclass
class Hop:
    """What one rank sent in a stage: row send_row[i] went out in rank order; reverse info for combine.

    A padded hop (splits None) sent equal blocks of rows to every peer: block p's filled rows first, then
    padding (send_row 0, which back assigns to no row). On a device-split transport (dispatch.device_split) only the
    filled rows moved: sent and received count them per peer of the hop, on the device."""

    send_row: Tensor               # [S] row index (before the hop) of each sent row, grouped by destination
    send_splits: list[int] | None  # [R] rows sent to each rank (None: equal blocks, padded)
    recv_splits: list[int] | None  # [R] rows received from each rank (None: equal blocks, padded)
    back: SegmentPlan              # sums rows returned over send_row into the rows before the hop
    sent: Tensor | None = None      # int64 [peers]: filled rows of each block sent (device-split hops only)
    received: Tensor | None = None  # int64 [peers]: filled rows of each block received (device-split hops only)

    @property
    def arrived_rows(self) -> int:
        """Rows this hop brought here."""
        return self.send_row.numel() if self.recv_splits is None else sum(self.recv_splits)


def routes_for(backend: str, topology: Topology, num_experts: int, rank: int,
               device: torch.device | None = None) -> list[HopRoute]:
    """The stages of backend for rank: flat is one hop to the owner; hierarchical crosses nodes first."""
    owner = expert_owner(num_experts, topology.world_size, device)
    if backend == "flat":
        return [HopRoute(owner, list(range(topology.world_size)), "ep")]
    check_choice("backend", backend, DispatchBackend)
    gpn, node, local = topology.gpus_per_node, topology.node_of(rank), topology.local_rank(rank)
    owner_node = owner // gpn
    across = HopRoute(owner_node * gpn + local, topology.rail_ranks(rank), "rail")
    inside = HopRoute(torch.where(owner_node == node, owner, -1), topology.node_ranks(rank), "node")
    return [across, inside]


def padded_bounds(stages: list[HopRoute], experts_per_rank: int, tokens: int, top_k: int, headroom: float,
                  chunks: int = 1) -> tuple[list[int], int]:
    """(per hop the rows of one chunk sent to each of its peers, rows handed to the rank's experts) of a padded
    dispatch (dispatch.EPDispatcher's exchange "padded") of tokens tokens in chunks chunks along stages (routes_for,
    any device: only the peers are read): headroom times a balanced routing's, capped at what no routing exceeds.
    Each chunk has at most ceil(tokens / chunks) tokens, every chunk the same bounds. A hop of P peers takes each row
    to min(k, P) of them, P / min(k, P) rows in for one sent to a peer; its rows in are the chunk's tokens (first hop)
    or what the hop before brought (balanced: tokens x the copies of the hops before); k pairs per token arrive at a
    rank, over all chunks."""
    bounds, rows_in = [], -(-tokens // chunks)
    expected = rows_in
    for stage in stages:
        peers, copies = len(stage.peers), min(top_k, len(stage.peers))
        bound = min(rows_in, math.ceil(headroom * expected * copies / peers))
        bounds.append(bound)
        rows_in, expected = peers * bound, expected * copies
    return bounds, min(chunks * rows_in * min(top_k, experts_per_rank), math.ceil(headroom * tokens * top_k))


def destinations(ids: Tensor, stage: HopRoute, world_size: int) -> Tensor:
    """[n, R] bool: which ranks each row (expert ids [n, k], -1 = dropped) goes to in stage."""
    return membership(lookup(ids, stage.next_rank), world_size)


def plan_sends(ids: Tensor, stage: HopRoute, world_size: int, source: Tensor | None = None,
               sources: int = 1, max_copies: int = 1) -> tuple[Tensor, list[list[int]], list[int]]:
    """(row of each sent row, grouped by destination rank then row; [rank][s] rows sent to each rank that
    came from source s, where source [n] gives each row's source in [0, sources) (default: all 0); the pass sizes
    of the hop's return sum (segment.pass_sizes: a row's j-th copy went to its j-th destination), for make_hop)."""
    member = destinations(ids, stage, world_size)
    if source is None:
        table = member.sum(0, keepdim=True).t()
    else:
        table = member.new_zeros((sources, world_size), dtype=torch.int64).index_add_(0, source, member.long()).t()
    width = table.shape[1]
    host = torch.cat([table.reshape(-1), pass_sizes(member.sum(1), max_copies)]).tolist()  # host sync: the counts
    counts = [host[r * width:(r + 1) * width] for r in range(world_size)]  # size the exchange (and its return sum)
    send_row = torch.nonzero_static(member.t(), size=sum(map(sum, counts)))[:, 1]  # sized by the counts: no 2nd sync
    return send_row, counts, host[world_size * width:]


def make_hop(send_row: Tensor, send_splits: list[int], recv_splits: list[int], num_rows: int,
             max_copies: int, sizes: list[int] | None = None) -> Hop:
    """A hop record with the reverse summation plan combine needs; a row is sent at most max_copies times (sizes:
    the plan's pass sizes, from plan_sends)."""
    return Hop(send_row, send_splits, recv_splits, segment_plan(send_row, num_rows, max_copies, sizes))


def plan_padded_sends(ids: Tensor, stage: HopRoute, world_size: int, bound: int, max_copies: int
                      ) -> tuple[Tensor, Tensor, Hop]:
    """A padded hop of the rows with expert ids [n, k] (-1: none): bound rows to each of the stage's peers, in peer
    order (each peer's rows in row order, then padding), sized by the shape only, nothing read to the host. Returns
    (filled [peers * bound] bool: which sent rows carry a row, overflow: a 0-dim bool, true when some peer has more
    than bound rows, which are then not sent, the Hop)."""
    peers = device_index(tuple(stage.peers), ids.device)
    member = destinations(ids, stage, world_size).index_select(1, peers)  # [n, peers]
    rows, width = member.shape
    position = member.long().cumsum(0) - 1  # [n, peers] each row's place among the rows going to that peer
    fits = member & (position < bound)
    cell = torch.where(fits, torch.arange(width, device=ids.device) * bound + position, width * bound)
    table = torch.full((width * bound + 1,), rows, dtype=torch.int64, device=ids.device)
    row_ids = torch.arange(rows, device=ids.device).unsqueeze(1).expand(rows, width).reshape(-1)
    table.index_put_((cell.reshape(-1),), row_ids)
    send_row = table[:-1]  # the last cell takes every (row, rank) not sent (discarded)
    filled = send_row < rows
    back = static_plan(send_row, rows, max_copies)  # a row's copies come back in ascending rank, as segment_plan's
    overflow = (member & ~fits).any()
    return filled, overflow, Hop(torch.where(filled, send_row, 0), None, None, back)
