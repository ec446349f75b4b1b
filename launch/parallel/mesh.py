"""The device mesh: rank <-> (pp, dp, cp, tp) coordinates, simulated nodes, and every process group, built once.

Rank order puts TP innermost, then CP, then DP, then PP: rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp.
CP ranks see the same micro-batches (each its zig-zag share of every sequence): like DP ranks they are data
replicas of the stage's dense parameters. EP groups are `ep` consecutive ranks of one stage's dp x cp x tp
block; expert-data-parallel groups join the ranks of a stage that hold the same experts; with hierarchical
dispatch each EP group is cut once more into its ranks per node (node groups) and its ranks per local index
(rail groups). Under DualPipe the stage pair (p, pp-1-p) is held by two pipeline ranks, so the replica groups of
its parameters span both of them. With multi-token prediction under a schedule that puts the first and the last
stage on different pipeline ranks (1F1B, ZB1P, AFAB) the last rank holds a copy of the embedding: its replica
group spans the first and the last pipeline rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from dispatch.hopgroups import HopGroups
from moe.tp import check_tp_group

ONE_NODE = 0  # Layout.gpus_per_node (parallel.gpus_per_node): every rank on one node


@dataclass(frozen=True)
class Layout:
    """Pure arithmetic of a parallel layout (no communication): ranks, nodes and group members."""

    pp: int
    dp: int
    tp: int
    ep: int
    gpus_per_node: int  # or ONE_NODE
    mirrored: bool = False  # DualPipe: pipeline ranks p and pp-1-p hold copies of the same two stages
    cp: int = 1  # context-parallel ranks per sequence
    hop_groups: bool = False  # hierarchical dispatch: per-hop (node, rail) groups inside each EP group
    embed_copy: bool = False  # MTP with the first and last stages on pipeline ranks 0 and pp-1: both hold the embedding

    @property
    def stage_ranks(self) -> int:
        """Ranks holding one pipeline stage: dp x cp x tp."""
        return self.dp * self.cp * self.tp

    @property
    def world_size(self) -> int:
        """Ranks in the layout."""
        return self.pp * self.stage_ranks

    @property
    def node_size(self) -> int:
        """Ranks per (real or simulated) node."""
        return self.world_size if self.gpus_per_node == ONE_NODE else self.gpus_per_node

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """Global rank at coordinates (pp, dp, tp, cp)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) coordinates of a global rank (its CP index: cp_rank)."""
        return rank // self.stage_ranks, rank // (self.cp * self.tp) % self.dp, rank % self.tp

    def cp_rank(self, rank: int) -> int:
        """A global rank's index in its CP group."""
        return rank // self.tp % self.cp

    def node(self, rank: int) -> int:
        """Node holding a global rank."""
        return rank // self.node_size

    def pipeline_group(self, rank: int) -> list[int]:
        """Ranks that pass activations to and from rank, in stage order."""
        _, d, t = self.coords(rank)
        return [self.rank(p, d, t, self.cp_rank(rank)) for p in range(self.pp)]

    def dp_group(self, rank: int) -> list[int]:
        """Ranks holding rank's TP shard of its stages: its data replicas, over DP and CP."""
        p, _, t = self.coords(rank)
        return [self.rank(p, d, t, c) for d in range(self.dp) for c in range(self.cp)]

    def cp_group(self, rank: int) -> list[int]:
        """Ranks sharing rank's sequences (each a zig-zag share of them), in CP order."""
        p, d, t = self.coords(rank)
        return [self.rank(p, d, t, c) for c in range(self.cp)]

    def sequence_group(self, rank: int) -> list[int]:
        """Ranks sharing rank's sequences, each with a CP shard's TP share of them (cp x tp, consecutive): the
        routers sum their balance statistics over them."""
        p, d, _ = self.coords(rank)
        first = self.rank(p, d, 0)
        return list(range(first, first + self.cp * self.tp))

    def tp_group(self, rank: int) -> list[int]:
        """Ranks sharing rank's layers' TP shards."""
        p, d, _ = self.coords(rank)
        return [self.rank(p, d, t, self.cp_rank(rank)) for t in range(self.tp)]

    def ep_group(self, rank: int) -> list[int]:
        """rank's ep consecutive ranks of its stage's dp x cp x tp block: together they hold every expert once."""
        start = rank - rank % self.ep  # blocks (dp x cp x tp ranks) are whole numbers of EP groups
        return list(range(start, start + self.ep))

    def ep_node_group(self, rank: int) -> list[int]:
        """rank's EP group's ranks on rank's node: the peers of the hierarchical dispatch's intra-node hop."""
        per_node = self.ep_gpus_per_node()
        first = rank - rank % per_node  # an EP group's ranks on one node are consecutive, from a multiple of it
        return list(range(first, first + per_node))

    def ep_rail_group(self, rank: int) -> list[int]:
        """rank's EP group's ranks with rank's index on their node, one per node: the inter-node hop's peers."""
        start = rank - rank % self.ep
        return list(range(start + rank % self.ep_gpus_per_node(), start + self.ep, self.ep_gpus_per_node()))

    def expert_dp_group(self, rank: int) -> list[int]:
        """Ranks of rank's stage that hold its experts (dp * cp * tp / ep of them)."""
        block = self.stage_ranks
        first = rank - rank % block
        return list(range(first + rank % self.ep, first + block, self.ep))

    def _mirror(self, group: list[int], twins: bool | None = None) -> list[int]:
        """Under DualPipe (or with twins), group joined with its twin on pipeline rank pp-1-p (the same stages' other
        copy)."""
        if not (self.mirrored if twins is None else twins):
            return group
        shift = (self.pp - 1 - 2 * self.coords(group[0])[0]) * self.stage_ranks
        return sorted(group + [r + shift for r in group])

    def dense_replica_group(self, rank: int) -> list[int]:
        """Ranks holding copies of rank's dense (non-expert) parameters: ZeRO-1 shards over them."""
        return self._mirror(self.dp_group(rank))

    def embed_replica_group(self, rank: int) -> list[int]:
        """Ranks holding copies of the embedding, rank a holder (a first or last stage's): its dense replicas, and
        with embed_copy those of the pipeline rank at the other end."""
        return self._mirror(self.dense_replica_group(rank), self.embed_copy)

    def expert_replica_group(self, rank: int) -> list[int]:
        """Ranks holding copies of rank's experts: ZeRO-1 shards expert state over them."""
        return self._mirror(self.expert_dp_group(rank))

    def ep_groups(self) -> list[list[int]]:
        """Every EP group, in rank order."""
        return [self.ep_group(first) for first in range(0, self.world_size, self.ep)]

    def ep_nodes(self) -> int:
        """Nodes one EP group spans (each holding the same number of its ranks)."""
        return self.ep // self.ep_gpus_per_node()

    def ep_gpus_per_node(self) -> int:
        """Members of an EP group per node; every EP group (ep consecutive ranks from a multiple of ep) spans its
        nodes evenly exactly when ep divides the node size or the node size divides ep."""
        node = self.node_size
        if node % self.ep and self.ep % node:
            raise ValueError(f"parallel.ep = {self.ep} with parallel.gpus_per_node = {self.gpus_per_node}: EP groups "
                             f"would span nodes unevenly; choose ep dividing gpus_per_node or a multiple of it")
        return min(self.ep, node)

    def describe(self) -> str:
        """One line per rank: its coordinates, EP index and node."""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        lines = [f"layout: pp={self.pp} dp={self.dp}{cp} tp={self.tp} ep={self.ep} on {self.world_size // self.node_size} "
                 f"node(s) of {self.node_size}" + (" (DualPipe: stage pairs mirrored)" if self.mirrored else "")]
        for r in range(self.world_size):
            p, d, t = self.coords(r)
            c = f" cp={self.cp_rank(r)}" if self.cp > 1 else ""
            lines.append(f"  rank {r}: pp={p} dp={d}{c} tp={t} ep={r % self.stage_ranks % self.ep} node={self.node(r)}")
        return "\n".join(lines)


class Mesh:
    """This rank's place in a Layout and its process groups (all created here, in one order on every rank)."""

    def __init__(self, layout: Layout) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs torch.distributed initialised (launch.train.loop does it for one process)")
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"the launcher started {dist.get_world_size()} ranks but the config's layout "
                             f"parallel.pp x dp x cp x tp = {layout.pp} x {layout.dp} x {layout.cp} x {layout.tp} needs "
                             f"{layout.world_size}")
        self.layout = layout
        self.rank = dist.get_rank()
        self.pp_rank, self.dp_rank, self.tp_rank = layout.coords(self.rank)
        self.cp_rank = layout.cp_rank(self.rank)
        self.world = dist.group.WORLD
        self.pipeline = self._mine(layout.pipeline_group)
        self.dp = self._mine(layout.dp_group)
        self.tp = self._mine(layout.tp_group)
        self.tp_grad = self._mine(layout.tp_group)  # TP collectives of backward, in flight beside a forward's
        check_tp_group(self.tp, layout.tp)
        self.ep = self._mine(layout.ep_group)
        self.ep_grad = self._mine(layout.ep_group)  # EP gradient exchanges, in flight beside the forward's
        self.hops = HopGroups(*(self._mine(kind) for kind in (layout.ep_node_group, layout.ep_rail_group) * 2)) \
            if layout.hop_groups else None  # node, rail, then their grad twins
        self.expert_dp = self._mine(layout.expert_dp_group)
        # CP ring transfers, forward and (in flight beside a forward's) backward; only where sequences are split
        self.cp = self._mine(layout.cp_group) if layout.cp > 1 else None
        self.cp_grad = self._mine(layout.cp_group) if layout.cp > 1 else None
        # CP x TP: the routers' statistics group (forward only; its twin marks their regions safe beside a backward)
        both = layout.cp > 1 and layout.tp > 1
        self.sequence = self._mine(layout.sequence_group) if both else None
        self.sequence_grad = self._mine(layout.sequence_group) if both else None
        self.dense_replicas = self._mine(layout.dense_replica_group)
        self.expert_replicas = self._mine(layout.expert_replica_group)
        ends = self.pp_rank in (0, layout.pp - 1)
        self.embed_replicas = self._mine(layout.embed_replica_group) if layout.embed_copy and ends else self.dense_replicas

    def _mine(self, group_of: Callable[[int], list[int]]) -> ProcessGroup:
        """This rank's group of one kind, created by its members only (a store barrier among them, none with
        the rest of the world): O(group) work per rank whatever the world size."""
        return dist.new_group(group_of(self.rank), use_local_synchronization=True)
