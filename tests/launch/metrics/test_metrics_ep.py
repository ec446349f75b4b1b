"""Metrics of an expert-parallel step (4 gloo ranks, 2 simulated nodes) against independent counts of every
rank's routing indices: per-expert loads summed over the ranks, their statistics, dropped slots, and the
traffic tables against the dispatcher's own intra/inter-node byte counters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dispatch import EPDispatcher
from launch.parallel.spawn import run_processes
from launch.metrics.records import decode_array, moe_layer_metrics, traffic_metrics
from moe.config import ModelConfig
from moe.layer import MoELayer

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

WORLD, GPUS_PER_NODE, EXPERTS, HIDDEN = 4, 2, 8, 32
TOKENS = (20, 0, 33, 27)  # rank 1 routes no tokens of its own


def _record_step(rank: int, world_size: int) -> dict:
    """One EP forward; this rank's routing indices, local loads, the loads summed over the ranks and its counters."""
    cfg = ModelConfig(hidden_size=HIDDEN, num_experts=EXPERTS, top_k=3, expert_ffn_size=16, num_shared_experts=1,
                      capacity_factor=1.0)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    dispatcher = EPDispatcher(EXPERTS, group=dist.group.WORLD, gpus_per_node=GPUS_PER_NODE, backend="flat")
    layer.to_expert_parallel(dispatcher)
    with torch.no_grad():
        layer.router.expert_bias[5] = -1e4  # never chosen: a dead expert
    indices = []
    layer.router.register_forward_hook(lambda _m, _i, out: indices.append(out.indices.clone()))
    x = torch.randn(TOKENS[rank], HIDDEN, generator=torch.Generator().manual_seed(rank))
    _, stats = layer(x)
    summed = stats.tokens_per_expert.detach().to(torch.int64).clone()
    dist.all_reduce(summed)  # what the trainer does before writing the step's record
    traffic = dispatcher.total_bytes["dispatch"]
    return {"indices": indices[0].numpy(), "local_load": stats.tokens_per_expert.detach().numpy(),
            "summed_load": summed.numpy(), "dropped": int(stats.dropped),
            "intra_payload": traffic.intra_payload, "inter_payload": traffic.inter_payload}


@pytest.fixture(scope="module")
def ranks():
    return run_processes(_record_step, WORLD, timeout_s=180)


def test_loads_summed_over_ep_ranks_match_a_count_of_every_ranks_indices(ranks):
    chosen = np.concatenate([r["indices"].reshape(-1) for r in ranks])
    counts = np.bincount(chosen[chosen >= 0], minlength=EXPERTS)
    for r in ranks:  # each rank counts the tokens it routed, not the ones its experts received
        own = r["indices"].reshape(-1)
        assert r["local_load"].tolist() == np.bincount(own[own >= 0], minlength=EXPERTS).tolist()
        assert r["summed_load"].tolist() == counts.tolist()
    dropped = sum(r["dropped"] for r in ranks)
    assert dropped == int((chosen < 0).sum()) and dropped > 0  # capacity_factor 1.0 drops slots
    moe = moe_layer_metrics([torch.from_numpy(ranks[0]["summed_load"])], [torch.zeros(EXPERTS)], [dropped], [{}])["moe"]
    assert decode_array(moe["load"]).tolist() == [counts.tolist()]
    mean = counts.mean()
    assert moe["max_over_mean"] == [pytest.approx(counts.max() / mean, abs=1e-4)]
    assert moe["cv"] == [pytest.approx(math.sqrt(((counts - mean) ** 2).mean()) / mean, abs=1e-4)]
    assert moe["dead"] == [int((counts == 0).sum())] and counts[5] == 0
    share = counts[counts > 0] / counts.sum()
    assert moe["entropy"] == [pytest.approx(-(share * np.log(share)).sum() / math.log(EXPERTS), abs=1e-4)]
    assert moe["dropped"] == [dropped]


def test_traffic_tables_match_rows_counted_from_the_indices_and_the_dispatch_counters(ranks):
    per_rank = EXPERTS // WORLD
    row_bytes = HIDDEN * 4  # payload "bf16" sends float32 x in its own dtype
    sent = np.zeros((WORLD, WORLD), dtype=np.int64)
    for src, r in enumerate(ranks):  # flat dispatch sends a token once to every rank owning one of its experts
        for token in r["indices"]:
            for peer in {int(e) // per_rank for e in token if e >= 0} - {src}:
                sent[src, peer] += row_bytes
    traffic = traffic_metrics(sent.tolist(), gpus_per_node=GPUS_PER_NODE)["traffic"]
    assert traffic["intra_node_bytes"] == sum(r["intra_payload"] for r in ranks)
    assert traffic["inter_node_bytes"] == sum(r["inter_payload"] for r in ranks)
    node = [[sent[a:a + 2, b:b + 2].sum() for b in (0, 2)] for a in (0, 2)]
    assert traffic["node_bytes"] == node and traffic["inter_node_bytes"] > 0 and traffic["intra_node_bytes"] > 0
