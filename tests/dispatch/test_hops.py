"""Hierarchical dispatch on per-hop groups, pipelined in chunks: 4 gloo ranks as 2 simulated nodes x 2, float64.

Each hop's all-to-alls (counts included) run on a group holding exactly that hop's peers, the bytes
counted per hop equal dispatch.predict's per hop, and 1, 2 and 4 chunks give bitwise-equal outputs and
grads (x, routing weights, experts, router), dropless and with capacity drops."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dispatch import EPDispatcher, make_topology
from dispatch.hopgroups import HopGroups, make_hop_groups
from launch.parallel.spawn import run_processes
from dispatch.predict import predict_hops
from moe.config import ModelConfig
from moe.layer import MoELayer

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

WORLD, GPN, HIDDEN, EXPERTS, TOP_K = 4, 2, 16, 8, 3
TOKENS = (6, 0, 13, 3)  # rank 1 sends nothing; rank 3 has fewer tokens than 4 chunks
CHUNKS = (1, 2, 4)
CAPACITY = {"dropless": None, "drops": 0.5}
HOP_PEERS = {"rail": lambda r: [r % GPN, r % GPN + GPN], "node": lambda r: [r - r % GPN, r - r % GPN + 1]}


class CallLog:
    """Records the global ranks of the group of every all_to_all_single issued while installed, and the
    order of issues and waits: events ("issue" | "wait", group ranks, call number)."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []
        self.events: list[tuple[str, tuple[int, ...], int]] = []
        self._real = dist.all_to_all_single

    def __enter__(self) -> CallLog:
        log = self

        class Work:
            def __init__(self, work, ranks: tuple[int, ...], call: int) -> None:
                self.work, self.ranks, self.call = work, ranks, call

            def wait(self):
                out = self.work.wait()
                log.events.append(("wait", self.ranks, self.call))
                return out

        def logged(*args, group=None, **kwargs):
            ranks = dist.get_process_group_ranks(group)
            self.groups.append(ranks)
            self.events.append(("issue", tuple(ranks), len(self.groups)))
            work = self._real(*args, group=group, **kwargs)
            return Work(work, tuple(ranks), len(self.groups)) if work is not None else None
        dist.all_to_all_single = logged
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self._real


def _layer(dispatcher: EPDispatcher, capacity: float | None) -> MoELayer:
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=HIDDEN, num_experts=EXPERTS, top_k=TOP_K, expert_ffn_size=HIDDEN,
                      num_shared_experts=0, capacity_factor=capacity)
    layer = MoELayer(cfg).double()
    layer.to_expert_parallel(dispatcher)
    return layer


def _step(layer: MoELayer, rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS[rank], HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
    out, stats = layer(x)
    (out * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "dropped": torch.as_tensor(stats.dropped).detach(),
            **{n: p.grad for n, p in layer.named_parameters()}}


def _main(rank: int, world_size: int) -> dict:
    topology = make_topology(WORLD, GPN)
    hops = make_hop_groups(dist.group.WORLD, topology, grad=True)
    grad_group = dist.new_group(list(range(WORLD)))
    results = {}
    try:  # the node group offered as the rail group
        EPDispatcher(EXPERTS, gpus_per_node=GPN, backend="hierarchical", hops=HopGroups(hops.rail, hops.node))
    except ValueError as error:
        results["swapped"] = str(error)
    for chunks in CHUNKS[:2]:  # plain dispatch + combine: when each exchange is issued and waited for
        dispatcher = EPDispatcher(EXPERTS, gpus_per_node=GPN, backend="hierarchical", hops=hops, chunks=chunks)
        indices = torch.arange(TOKENS[rank] * TOP_K).view(-1, TOP_K) % EXPERTS
        x = torch.randn(TOKENS[rank], HIDDEN, dtype=torch.float64)
        with CallLog() as log:
            recv, _, handle = dispatcher.dispatch(x, indices, torch.ones(indices.shape, dtype=torch.float64))
            dispatch_events = len(log.events)
            dispatcher.combine(recv, handle)
        results["order", chunks] = (log.events[:dispatch_events], log.events[dispatch_events:])
    for name, capacity in CAPACITY.items():
        for chunks in CHUNKS:
            dispatcher = EPDispatcher(EXPERTS, gpus_per_node=GPN, backend="hierarchical", grad_group=grad_group,
                                      hops=hops, chunks=chunks)
            layer = _layer(dispatcher, capacity)
            with CallLog() as log:
                step = _step(layer, rank)
            results[name, chunks] = {"step": step, "groups": log.groups,
                                     "by_hop": {hop: {kind: t.as_dict() for kind, t in kinds.items()}
                                                for hop, kinds in dispatcher.meter.by_hop.items()}}
            if name == "drops":  # the routing each rank dispatched, for the prediction
                dispatcher.meter.by_hop.clear()
                with torch.no_grad():
                    route = layer.router(torch.randn(TOKENS[rank], HIDDEN, dtype=torch.float64,
                                                     generator=torch.Generator().manual_seed(100 + rank)))
                    recv, _, handle = dispatcher.dispatch(torch.zeros(TOKENS[rank], HIDDEN, dtype=torch.float64),
                                                          route.indices, route.weights)
                    dispatcher.combine(recv, handle)
                gathered = [None] * WORLD
                dist.all_gather_object(gathered, route.indices)
                results[name, chunks]["predict"] = (gathered, {hop: {k: t.as_dict() for k, t in kinds.items()}
                                                               for hop, kinds in dispatcher.meter.by_hop.items()})
    return results


@pytest.fixture(scope="module")
def results():
    return run_processes(_main, WORLD, timeout_s=300)


def _overlapped(events: list, rank: int) -> bool:
    """Whether some rail exchange is in flight (issued, not yet waited for) across a whole node exchange."""
    rail, node = tuple(HOP_PEERS["rail"](rank)), tuple(HOP_PEERS["node"](rank))
    at = {(kind, call): i for i, (kind, _, call) in enumerate(events)}
    spans = {group: [(at["issue", call], at["wait", call]) for kind, g, call in events
                     if g == group and kind == "issue"]
             for group in (rail, node)}
    return any(a < c and d < b for a, b in spans[rail] for c, d in spans[node])


def test_hop_groups_unlike_the_hops_and_chunks_without_two_hops_are_refused(results):
    for rank, res in enumerate(results):
        rail, node = HOP_PEERS["rail"](rank), HOP_PEERS["node"](rank)
        assert f"hops.rail must be a process group over global ranks {rail}" in res["swapped"]
        assert f"got {node}" in res["swapped"]
    with pytest.raises(ValueError, match=r"chunks = 2 must be an integer >= 1, and 1 unless backend = 'hierarchical'"):
        EPDispatcher(EXPERTS, backend="flat", chunks=2)
    with pytest.raises(ValueError, match=r"chunks = 0 must be an integer >= 1"):
        EPDispatcher(EXPERTS, backend="hierarchical", chunks=0)


def test_chunks_keep_an_inter_node_exchange_in_flight_across_an_intra_node_one(results):
    for rank, res in enumerate(results):
        for part, name in enumerate(("dispatch", "combine")):
            assert not _overlapped(res["order", 1][part], rank), (rank, name)  # one chunk: the hops in turn
            assert _overlapped(res["order", 2][part], rank), (rank, name)


def test_each_hops_collectives_run_on_a_group_of_exactly_its_peers(results):
    for rank, res in enumerate(results):
        allowed = [peers(rank) for peers in HOP_PEERS.values()]
        for key, run in ((k, v) for k, v in res.items() if k[0] in CAPACITY):
            assert run["groups"], key
            assert all(group in allowed for group in run["groups"]), (rank, key, run["groups"])
            assert {tuple(g) for g in run["groups"]} == {tuple(g) for g in allowed}, (rank, key)


@pytest.mark.parametrize("chunks", CHUNKS)
def test_bytes_counted_per_hop_equal_the_prediction_per_hop(results, chunks):
    for rank, res in enumerate(results):
        indices, counted = res["drops", chunks]["predict"]
        predicted = predict_hops(indices, EXPERTS, make_topology(WORLD, GPN), HIDDEN, "hierarchical", "bf16",
                                 torch.float64, chunks)[rank]
        assert set(counted) <= set(predicted) == {"rail", "node"}
        for hop in predicted:
            for kind in ("dispatch", "combine"):
                expected = predicted[hop][kind].as_dict()
                got = counted.get(hop, {}).get(kind, {k: 0 for k in expected})
                assert got == expected, (rank, hop, kind)
        assert predicted["rail"]["dispatch"].intra_node == predicted["node"]["dispatch"].inter_node == 0


@pytest.mark.parametrize("capacity", list(CAPACITY))
@pytest.mark.parametrize("chunks", CHUNKS[1:])
def test_chunked_outputs_and_grads_are_bitwise_equal_to_one_chunk(results, capacity, chunks):
    for rank, res in enumerate(results):
        one, many = res[capacity, 1]["step"], res[capacity, chunks]["step"]
        assert one.keys() == many.keys()
        for name, value in one.items():
            assert (value is None) == (many[name] is None), (rank, name)
            if value is not None:
                assert torch.equal(value, many[name]), (rank, capacity, chunks, name)


def test_the_capacity_case_drops_and_rows_cross_nodes(results):
    assert sum(int(res["drops", 1]["step"]["dropped"].sum()) for res in results) > 0
    assert sum(int(res["dropless", 1]["step"]["dropped"].sum()) for res in results) == 0
    for capacity in CAPACITY:
        assert sum(res[capacity, 1]["by_hop"]["rail"]["dispatch"]["inter_payload"] for res in results) > 0
        assert sum(res[capacity, 1]["by_hop"]["node"]["dispatch"]["intra_payload"] for res in results) > 0
    step = results[2]["dropless", 1]["step"]
    assert step["x_grad"].abs().sum() > 0 and step["experts.w_down"].abs().sum() > 0
