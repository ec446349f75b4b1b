"""The mesh's groups: each rank's own group of each kind, from closed forms that agree with the definitions,
created by its members only, so a rank's group-building work does not grow with the world."""

import itertools

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import launch.parallel.mesh
from launch.parallel.mesh import Layout, Mesh


def definition_groups(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group of every kind, straight from the rank order (TP innermost, then DP, then PP)."""
    pp, dp, tp, ep = layout.pp, layout.dp, layout.tp, layout.ep
    rank = layout.rank
    blocks = [[rank(p, d, t) for d in range(dp) for t in range(tp)] for p in range(pp)]
    ep_groups = [b[i:i + ep] for b in blocks for i in range(0, len(b), ep)]
    expert_dp = [b[e::ep] for b in blocks for e in range(ep)]
    dp_groups = [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)]

    def mirror(groups: list[list[int]]) -> list[list[int]]:
        if not layout.mirrored:
            return groups
        block = dp * tp
        return [sorted(g + [r + (pp - 1 - 2 * (g[0] // block)) * block for r in g]) for g in groups
                if g[0] // block < pp // 2]

    by_node = [[[r for r in g if layout.node(r) == n] for n in sorted({layout.node(r) for r in g})] for g in ep_groups]
    return {"ep_node_group": [part for parts in by_node for part in parts],
            "ep_rail_group": [list(rail) for parts in by_node for rail in zip(*parts)],
            "pipeline_group": [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
            "dp_group": dp_groups, "tp_group": [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
            "ep_group": ep_groups, "expert_dp_group": expert_dp,
            "dense_replica_group": mirror(dp_groups), "expert_replica_group": mirror(expert_dp)}


LAYOUTS = [Layout(pp, dp, tp, ep, gpn, mirrored) for pp, dp, tp, ep, gpn, mirrored in itertools.product(
    [1, 2, 4], [1, 2, 4], [1, 2], [1, 2, 4], [0, 1, 2, 4], [False, True])
    if not (dp * tp) % ep and not (mirrored and pp % 2) and not (gpn and (pp * dp * tp) % gpn)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_each_ranks_group_is_the_one_of_the_definition_holding_it(layout):
    for kind, groups in definition_groups(layout).items():
        for r in range(layout.world_size):
            (mine,) = [g for g in groups if r in g] or [[r]]  # mirrored lists hold each rank once
            assert getattr(layout, kind)(r) == mine, (kind, r)


@pytest.mark.parametrize("gpus_per_node, ep, per_node", [(8, 4, 4), (4, 8, 4), (8, 8, 8), (0, 4, 4)])
def test_ep_spans_nodes_evenly(gpus_per_node, ep, per_node):
    layout = Layout(2, 8, 1, ep, gpus_per_node)
    assert layout.ep_gpus_per_node() == per_node and layout.ep_nodes() == ep // per_node
    for group in layout.ep_groups():
        assert {sum(layout.node(r) == n for r in group) for n in {layout.node(r) for r in group}} == {per_node}


def test_ep_across_an_uneven_node_boundary_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match=r"parallel.ep = 4 with parallel.gpus_per_node = 6"):
        Layout(1, 12, 1, 4, 6).ep_gpus_per_node()


@pytest.mark.parametrize("hop_groups", [False, True])
@pytest.mark.parametrize("world", [4, 64, 2048])
def test_a_rank_creates_the_same_groups_of_its_own_whatever_the_world(world, hop_groups, monkeypatch):
    created = []
    real = dist.new_group

    def counting(ranks, **kwargs):
        created.append((len(ranks), kwargs.get("use_local_synchronization")))
        return real(ranks, **kwargs)

    monkeypatch.setattr(launch.parallel.mesh.dist, "new_group", counting)
    dp = world // 4
    layout = Layout(pp=2, dp=dp, tp=2, ep=2, gpus_per_node=1 if hop_groups else 4, mirrored=True,
                    hop_groups=hop_groups)
    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    try:
        mesh = Mesh(layout)
    finally:
        dist.destroy_process_group()
    # pipeline, dp, tp, tp_grad, ep, ep_grad, [hierarchical: the EP group's node (1 rank per node here) and rail
    # (2 nodes) groups, then their grad twins], expert dp (dp x tp / ep), dense and expert replicas (mirrored: x 2)
    hops = [(1, True), (2, True)] * 2 if hop_groups else []
    assert created == [(2, True), (dp, True), (2, True), (2, True), (2, True), (2, True), *hops, (dp, True),
                       (2 * dp, True), (2 * dp, True)]
    assert len(created) == (13 if hop_groups else 9)
    assert mesh.rank == world - 1 and (mesh.hops is not None) == hop_groups
