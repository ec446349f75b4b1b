"""Rank -> (node, local rank) for an EP group; on CPU the nodes are simulated by gpus_per_node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

DispatchBackend = Literal["flat", "hierarchical"]  # one hop to each expert's rank; or across nodes, then inside one
BACKENDS = get_args(DispatchBackend)


@dataclass(frozen=True)
class Topology:
    """world_size ranks split into nodes of gpus_per_node consecutive ranks."""

    world_size: int
    gpus_per_node: int

    @property
    def num_nodes(self) -> int:
        """Number of (real or simulated) nodes."""
        return self.world_size // self.gpus_per_node

    def node_of(self, rank: int) -> int:
        """Node that holds rank."""
        return rank // self.gpus_per_node

    def local_rank(self, rank: int) -> int:
        """Index of rank inside its node."""
        return rank % self.gpus_per_node

    def rank_at(self, node: int, local_rank: int) -> int:
        """Rank with local index local_rank on node."""
        return node * self.gpus_per_node + local_rank

    def node_ranks(self, rank: int) -> list[int]:
        """Ranks on rank's node, ascending: the peers of the hierarchical dispatch's intra-node hop."""
        first = self.node_of(rank) * self.gpus_per_node
        return list(range(first, first + self.gpus_per_node))

    def rail_ranks(self, rank: int) -> list[int]:
        """Ranks with rank's local index, one per node, ascending: the peers of the inter-node hop."""
        return list(range(self.local_rank(rank), self.world_size, self.gpus_per_node))

    def same_node(self, a: int, b: int) -> bool:
        """Whether ranks a and b share a node."""
        return self.node_of(a) == self.node_of(b)


def make_topology(world_size: int, gpus_per_node: int | None = None) -> Topology:
    """Topology of world_size ranks; gpus_per_node None puts every rank on one node."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size = {world_size!r} must be an integer >= 1")
    if gpus_per_node is None:
        return Topology(world_size, world_size)
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node = {gpus_per_node!r} must be an integer >= 1 or None")
    if world_size % gpus_per_node:
        raise ValueError(f"gpus_per_node = {gpus_per_node} must divide the EP world size {world_size} "
                         f"(allowed: {', '.join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)})")
    return Topology(world_size, gpus_per_node)
