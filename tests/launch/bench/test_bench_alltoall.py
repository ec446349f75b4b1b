"""Copies of one token per dispatch, from the routing alone (dispatch.predict and the per-expert peer's prediction,
the same counts their byte counters are checked against in test_bench_dispatch): a token routed to 8 experts is
sent 8 times by the per-expert all-to-all, once per destination rank by flat, once per destination node by
hierarchical. In general, with k experts on r ranks on n nodes: k rows, r rows, n inter-node copies."""

from __future__ import annotations

import pytest
import torch

from dispatch.dispatcher import EPDispatcher
from dispatch.fp8 import fp8_row_bytes
from launch.parallel.spawn import run_processes
from dispatch.predict import inter_node_copies, predict_traffic
from dispatch.topology import make_topology
from launch.bench.alltoall import PerExpertDispatcher, per_expert_traffic

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

HIDDEN, WORLD, GPN = 256, 8, 2  # 8 ranks on 4 nodes
ROW = HIDDEN * 2


def _one_token_on_rank(experts: list[int], num_experts: int, src: int = 1) -> list[torch.Tensor]:
    """Rank src holds one token routed to experts; the other ranks hold none."""
    empty = torch.empty(0, len(experts), dtype=torch.int64)
    return [torch.tensor([experts]) if r == src else empty for r in range(WORLD)]


def _sent_rows(traffic: list[dict], row: int) -> tuple[int, int]:
    """(rows sent to other ranks, of which inter-node) in all ranks' dispatch payloads."""
    total = sum(t["dispatch"].inter_payload + t["dispatch"].intra_payload for t in traffic)
    return total // row, sum(t["dispatch"].inter_payload for t in traffic) // row


CASES = [
    # 8 experts on 8 ranks (one each; the source rank 1 holds one, node = rank // 2): 8 rows made, 7 leave the
    # rank (6 of them to other nodes); flat the same, one per rank; hierarchical one per remote node (3)
    (8, list(range(8)), (7, 6), (7, 6), 3),
    # 8 experts on ranks 2, 3, 4, 6 (two each), all on other nodes: 8 rows, 4 rows, 3 nodes
    (16, [4, 5, 6, 7, 8, 9, 12, 13], (8, 8), (4, 4), 3),
]


@pytest.mark.parametrize("num_experts, experts, per_expert, flat, hierarchical", CASES)
def test_copies_of_one_token_per_dispatch(num_experts, experts, per_expert, flat, hierarchical):
    """(rows sent to other ranks, of which to other nodes) per dispatch, and hierarchical's inter-node copies."""
    topology = make_topology(WORLD, GPN)
    indices = _one_token_on_rank(experts, num_experts, src=1)
    assert _sent_rows(per_expert_traffic(indices, num_experts, topology, HIDDEN), ROW) == per_expert
    assert _sent_rows(predict_traffic(indices, num_experts, topology, HIDDEN, "flat"), ROW) == flat
    hier = predict_traffic(indices, num_experts, topology, HIDDEN, "hierarchical")
    assert _sent_rows(hier, ROW)[1] == hierarchical
    assert int(inter_node_copies(indices[1], 1, num_experts, topology, "hierarchical")[0]) == hierarchical
    assert int(inter_node_copies(indices[1], 1, num_experts, topology, "flat")[0]) == flat[1]


def test_per_expert_bytes_equal_a_naive_count_over_random_routing():
    """Every routed slot whose expert lives elsewhere is one row; each rank sends E_local int64 counts to each peer."""
    num_experts, k, tokens = 16, 4, 40
    topology = make_topology(WORLD, GPN)
    gen = torch.Generator().manual_seed(3)
    indices = [torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(tokens)]) for _ in range(WORLD)]
    for ids in indices:
        ids[::5, 0] = -1  # dropped slots are not sent
    for payload, row in (("bf16", ROW), ("fp8", fp8_row_bytes(HIDDEN))):
        traffic = per_expert_traffic(indices, num_experts, topology, HIDDEN, payload)
        for src, ids in enumerate(indices):
            want = {"inter": 0, "intra": 0}
            for e in ids.flatten().tolist():
                if e >= 0 and e // 2 != src:
                    want["inter" if e // 2 // GPN != src // GPN else "intra"] += row
            got = traffic[src]["dispatch"]
            assert (got.inter_payload, got.intra_payload) == (want["inter"], want["intra"])
            assert (got.inter_meta, got.intra_meta) == (2 * 8 * (WORLD - GPN), 2 * 8 * (GPN - 1))


def _counted_by_the_dispatchers(rank: int, world: int) -> list[dict[str, tuple[int, int]]]:
    """Per case: each contender's (payload rows sent to other ranks, of which inter-node) on this rank, from the
    byte counters of one real dispatch (rank 1 holds the one token, the others none)."""
    out = []
    for num_experts, experts, *_ in CASES:
        indices = _one_token_on_rank(experts, num_experts)[rank]
        x = torch.ones(len(indices), HIDDEN, dtype=torch.bfloat16)
        weights = torch.full(indices.shape, 1.0 / len(experts))
        contenders = {"per-expert": PerExpertDispatcher(num_experts, gpus_per_node=GPN),
                      **{b: EPDispatcher(num_experts, gpus_per_node=GPN, backend=b) for b in ("flat", "hierarchical")}}
        counted = {}
        for name, dispatcher in contenders.items():
            rows, _, handle = dispatcher.dispatch(x, indices, weights)
            out_x = dispatcher.combine(rows, handle)
            assert torch.equal(out_x, x), name  # identity experts, weights summing to 1
            sent = dispatcher.last_bytes["dispatch"]
            counted[name] = ((sent.inter_payload + sent.intra_payload) // ROW, sent.inter_payload // ROW)
        out.append(counted)
    return out


def test_the_dispatchers_byte_counters_send_one_token_as_predicted():
    """8 gloo ranks on 4 simulated nodes, real dispatch calls: the counters give the copies counted above."""
    per_rank = run_processes(_counted_by_the_dispatchers, WORLD, timeout_s=300)
    for case, (_, _, per_expert, flat, hierarchical) in enumerate(CASES):
        total = {name: tuple(sum(r[case][name][i] for r in per_rank) for i in range(2)) for name in per_rank[0][case]}
        assert total["per-expert"] == per_expert and total["flat"] == flat
        assert total["hierarchical"][1] == hierarchical
