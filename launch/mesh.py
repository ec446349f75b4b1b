"""The device mesh: rank <-> (pp, dp, tp) coordinates, simulated nodes, and every process group, built once.

Rank order puts TP innermost, then DP, then PP: rank = (pp * dp_size + dp) * tp_size + tp. EP groups
are `ep` consecutive ranks of one stage's dp x tp block; expert-data-parallel groups join the ranks
of a stage that hold the same experts. Under DualPipe the stage pair (p, pp-1-p) is held by two
pipeline ranks, so the replica groups of its parameters span both of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch.distributed as dist
from torch.distributed import ProcessGroup

from moe.tp import check_tp_group


@dataclass(frozen=True)
class Layout:
    """Pure arithmetic of a parallel layout (no communication): ranks, nodes and group members."""

    pp: int
    dp: int
    tp: int
    ep: int
    gpus_per_node: int  # 0: every rank on one node
    mirrored: bool = False  # DualPipe: pipeline ranks p and pp-1-p hold copies of the same two stages

    @property
    def world_size(self) -> int:
        """Ranks in the layout."""
        return self.pp * self.dp * self.tp

    @property
    def node_size(self) -> int:
        """Ranks per (real or simulated) node."""
        return self.gpus_per_node or self.world_size

    def rank(self, pp: int, dp: int, tp: int) -> int:
        """Global rank at coordinates (pp, dp, tp)."""
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) coordinates of a global rank."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def node(self, rank: int) -> int:
        """Node holding a global rank."""
        return rank // self.node_size

    def pipeline_groups(self) -> list[list[int]]:
        """Ranks that pass activations to each other, in stage order (one group per dp, tp)."""
        return [[self.rank(p, d, t) for p in range(self.pp)] for d, t in product(range(self.dp), range(self.tp))]

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same TP shard of the same stages (one group per pp, tp)."""
        return [[self.rank(p, d, t) for d in range(self.dp)] for p, t in product(range(self.pp), range(self.tp))]

    def tp_groups(self) -> list[list[int]]:
        """Ranks sharing one layer's TP shards (one group per pp, dp)."""
        return [[self.rank(p, d, t) for t in range(self.tp)] for p, d in product(range(self.pp), range(self.dp))]

    def _block(self, pp: int) -> list[int]:
        """The dp x tp ranks of one pipeline stage, in rank order."""
        return [self.rank(pp, d, t) for d, t in product(range(self.dp), range(self.tp))]

    def ep_groups(self) -> list[list[int]]:
        """ep consecutive ranks of a stage's dp x tp block: together they hold every expert once."""
        return [block[i:i + self.ep] for block in map(self._block, range(self.pp))
                for i in range(0, len(block), self.ep)]

    def expert_dp_groups(self) -> list[list[int]]:
        """Ranks of a stage that hold the same experts (dp * tp / ep of them)."""
        return [block[e::self.ep] for block in map(self._block, range(self.pp)) for e in range(self.ep)]

    def _mirror(self, groups: list[list[int]]) -> list[list[int]]:
        """Under DualPipe, join each group of pipeline rank p with its twin of rank pp-1-p."""
        if not self.mirrored:
            return groups
        by_pp = {self.coords(g[0])[0]: [] for g in groups}
        for g in groups:
            by_pp[self.coords(g[0])[0]].append(g)
        return [sorted(a + b) for p in range(self.pp // 2) for a, b in zip(by_pp[p], by_pp[self.pp - 1 - p])]

    def dense_replica_groups(self) -> list[list[int]]:
        """Ranks holding copies of the same dense (non-expert) parameters: ZeRO-1 shards over them."""
        return self._mirror(self.dp_groups())

    def expert_replica_groups(self) -> list[list[int]]:
        """Ranks holding copies of the same experts: ZeRO-1 shards expert state over them."""
        return self._mirror(self.expert_dp_groups())

    def ep_nodes(self) -> int:
        """Nodes one EP group spans (each holding the same number of its ranks)."""
        return len({self.node(r) for r in self.ep_groups()[0]})

    def ep_gpus_per_node(self) -> int:
        """Members of an EP group per node, checked equal on every node it spans."""
        for group in self.ep_groups():
            counts = {}
            for r in group:
                counts[self.node(r)] = counts.get(self.node(r), 0) + 1
            if len(set(counts.values())) > 1:
                raise ValueError(f"parallel.ep = {self.ep} with parallel.gpus_per_node = {self.gpus_per_node}: the EP "
                                 f"group {group} spans nodes unevenly ({counts} ranks per node); choose ep dividing "
                                 f"gpus_per_node or a multiple of it")
        return self.ep // self.ep_nodes()

    def describe(self) -> str:
        """One line per rank: its coordinates, EP index and node."""
        lines = [f"layout: pp={self.pp} dp={self.dp} tp={self.tp} ep={self.ep} on {self.world_size // self.node_size} "
                 f"node(s) of {self.node_size}" + (" (DualPipe: stage pairs mirrored)" if self.mirrored else "")]
        for r in range(self.world_size):
            p, d, t = self.coords(r)
            lines.append(f"  rank {r}: pp={p} dp={d} tp={t} ep={(d * self.tp + t) % self.ep} node={self.node(r)}")
        return "\n".join(lines)


class Mesh:
    """This rank's place in a Layout and its process groups (all created here, in one order on every rank)."""

    def __init__(self, layout: Layout) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs torch.distributed initialised (launch.train does it for one process)")
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"the launcher started {dist.get_world_size()} ranks but the config's layout "
                             f"parallel.pp x dp x tp = {layout.pp} x {layout.dp} x {layout.tp} needs {layout.world_size}")
        self.layout = layout
        self.rank = dist.get_rank()
        self.pp_rank, self.dp_rank, self.tp_rank = layout.coords(self.rank)
        self.world = dist.group.WORLD
        self.pipeline = self._mine(layout.pipeline_groups())
        self.dp = self._mine(layout.dp_groups())
        self.tp = self._mine(layout.tp_groups())
        self.tp_grad = self._mine(layout.tp_groups())  # TP collectives of backward, in flight beside a forward's
        check_tp_group(self.tp, layout.tp)
        self.ep = self._mine(layout.ep_groups())
        self.ep_grad = self._mine(layout.ep_groups())  # EP gradient exchanges, in flight beside the forward's
        self.expert_dp = self._mine(layout.expert_dp_groups())
        self.dense_replicas = self._mine(layout.dense_replica_groups())
        self.expert_replicas = self._mine(layout.expert_replica_groups())

    def _mine(self, groups: list[list[int]]) -> ProcessGroup:
        """Create every group of the list (each rank must) and return the one holding this rank."""
        mine = None
        for ranks in groups:
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine
