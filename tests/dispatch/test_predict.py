"""Traffic prediction (no communication): the acceptance ratios and the DeepSeek-V3-scale node limit."""

from __future__ import annotations

import pytest
import torch

from dispatch import make_topology
from dispatch.predict import inter_node_copies, predict_traffic
from dispatch.synthetic import synthetic_routing


def _routings(world: int, tokens: int, experts: int, top_k: int, groups: int, keep: int) -> list[torch.Tensor]:
    return [synthetic_routing(tokens, experts, top_k, "node-limited", num_groups=groups, topk_groups=keep,
                              generator=torch.Generator().manual_seed(r))[0] for r in range(world)]


def _summed(traffic: list[dict], kind: str = "dispatch"):
    total = traffic[0][kind]
    for rank in traffic[1:]:
        total = total + rank[kind]
    return total


def test_hierarchical_halves_inter_node_bytes_and_fp8_halves_the_payload():
    topo, hidden = make_topology(4, 2), 1024
    indices = _routings(4, 4096, 32, 8, groups=2, keep=1)
    flat = _summed(predict_traffic(indices, 32, topo, hidden, "flat", "bf16"))
    hier = _summed(predict_traffic(indices, 32, topo, hidden, "hierarchical", "bf16"))
    hier_fp8 = _summed(predict_traffic(indices, 32, topo, hidden, "hierarchical", "fp8"))
    assert hier.inter_node <= 0.55 * flat.inter_node
    assert hier.inter_payload <= 0.55 * flat.inter_payload
    payload = hier_fp8.inter_payload + hier_fp8.intra_payload
    assert payload <= 0.52 * (hier.inter_payload + hier.intra_payload)
    assert hier_fp8.inter_meta == hier.inter_meta  # routing metadata is counted apart, unchanged by fp8


def test_combine_sends_back_one_row_per_row_received():
    topo = make_topology(4, 2)
    indices = _routings(4, 64, 32, 8, groups=2, keep=1)
    for backend in ("flat", "hierarchical"):
        traffic = predict_traffic(indices, 32, topo, 256, backend, "fp8", torch.float32)
        dispatch, combine = _summed(traffic), _summed(traffic, "combine")
        rows = dispatch.inter_payload / (256 + 4 * 2)
        assert combine.inter_payload == rows * 256 * 4 and combine.inter_meta == 0


def test_deepseek_v3_scale_hierarchical_crosses_to_at_most_four_nodes():
    topo = make_topology(64, 8)
    indices = _routings(64, 256, 256, 8, groups=8, keep=4)
    for rank in (0, 21, 63):
        hier = inter_node_copies(indices[rank], rank, 256, topo, "hierarchical")
        flat = inter_node_copies(indices[rank], rank, 256, topo, "flat")
        assert int(hier.max()) <= 4 and int(flat.max()) > 4
        assert (hier <= flat).all()


def test_prediction_rejects_a_routing_per_rank_mismatch():
    with pytest.raises(ValueError, match="expected one per rank"):
        predict_traffic([torch.zeros(2, 2, dtype=torch.long)], 8, make_topology(4, 2), 16)
