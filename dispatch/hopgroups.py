"""Process groups of the hierarchical dispatch's two hops, per EP rank: its node's and its rail's EP ranks."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from dispatch.topology import Topology


@dataclass(frozen=True)
class HopGroups:
    """One EP rank's hop groups: `node` holds the EP ranks on its node (the intra-node hop), `rail` the EP
    ranks with its local index, one per node (the inter-node hop); the *_grad twins, over the same ranks,
    carry gradient exchanges (None: gradients share the forward's groups)."""

    node: dist.ProcessGroup
    rail: dist.ProcessGroup
    node_grad: dist.ProcessGroup | None = None
    rail_grad: dist.ProcessGroup | None = None


def make_hop_groups(group: dist.ProcessGroup, topology: Topology, grad: bool,
                    timeout: timedelta | None = None) -> HopGroups:
    """This rank's HopGroups inside EP group `group` (with grad twins when grad), each made by its members
    only: every rank of the group calls this once, at the same point of its own group creations."""
    ranks, me = dist.get_process_group_ranks(group), dist.get_rank(group)

    def make(peers: list[int]) -> dist.ProcessGroup:
        return dist.new_group([ranks[p] for p in peers], timeout=timeout, use_local_synchronization=True)

    node, rail = topology.node_ranks(me), topology.rail_ranks(me)
    made = [make(peers) for peers in ((node, rail, node, rail) if grad else (node, rail))]
    return HopGroups(*made)


def check_hop_group(hop: dist.ProcessGroup | None, name: str, group: dist.ProcessGroup, peers: list[int]) -> None:
    """ValueError unless hop holds exactly the global ranks of group's EP ranks peers."""
    expected = [dist.get_process_group_ranks(group)[p] for p in peers]
    got = None if hop is None else dist.get_process_group_ranks(hop)
    if got != expected:
        raise ValueError(f"hops.{name} must be a process group over global ranks {expected} (this EP rank's "
                         f"{name.removesuffix('_grad')} peers), got {got}")
