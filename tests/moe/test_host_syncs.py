"""Host syncs of one MoE layer's forward + backward (router, expert-parallel dispatch, experts, combine) on one
gloo rank, seen by the suite's sync detector (tests/syncs.py): on the exact exchange a fixed number, the same for
any number of experts and tokens, only the sizes a dispatch needs on the host (each such read is commented where it
happens); on the padded exchange (issue 48) none."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dispatch import EPDispatcher
from moe.config import ModelConfig
from moe.layer import MoELayer
from tests.dispatch.test_segment_ops import one_rank  # noqa: F401 (a fixture)
from tests.syncs import SyncDetector

HIDDEN = 16


def layer_syncs(experts: int, tokens: int, backend: str, capacity_factor: float | None,
                exchange: str = "exact") -> Counter[str]:
    """Host syncs of one MoE layer's forward and backward, by kind (a collective's list splits apart)."""
    torch.manual_seed(experts + tokens)
    cfg = ModelConfig(hidden_size=HIDDEN, num_experts=experts, top_k=4, expert_ffn_size=16, num_groups=4,
                      topk_groups=2, capacity_factor=capacity_factor, score_func="sigmoid", aux_loss_coeff=0.01)
    layer = MoELayer(cfg)
    layer.to_expert_parallel(EPDispatcher(experts, backend=backend, gpus_per_node=1, exchange=exchange))
    x = torch.randn(2, tokens // 2, HIDDEN, requires_grad=True)
    with SyncDetector() as detector:
        out, stats = layer(x, seq_len=tokens // 2)
        (out.square().sum() + stats.aux_loss).backward()
    assert x.grad is not None and layer.experts.w_down.grad is not None
    return Counter(kind for kind, _ in detector.kinds() if kind != "all_to_all_single(list splits)")


def budget(hops: int) -> Counter[str]:
    """The syncs a layer needs on the exact exchange: per hop, its send splits read with the passes of its combine
    sums (dispatch.routes.plan_sends, dispatch.segment.pass_sizes) and the counts its peers send (dispatch.channel);
    the pairs kept for this rank's experts read with the passes of their sums (dispatch.permute.make_permutation).
    Each read of a plan's passes apart from its counts was a sync more: 3 * hops + 3 in all before; the routing
    check's flag (dispatch.layout.check_routing) is a device-side assert since issue 48. (The counts each hop trades
    go up from the host through dispatch.upload.upload: queued from pinned memory on CUDA, no wait.)"""
    return Counter({"Tensor.tolist": 2 * hops + 1})


@pytest.mark.parametrize("backend, hops", [("flat", 1), ("hierarchical", 2)])
@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_host_syncs_are_the_sizes_dispatch_needs_for_any_experts_and_tokens(one_rank, backend, hops, capacity_factor):
    for experts in (8, 64):
        for tokens in (64, 512):
            assert layer_syncs(experts, tokens, backend, capacity_factor) == budget(hops), (experts, tokens)


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_padded_exchange_reads_nothing(one_rank, capacity_factor):
    for experts in (8, 64):
        assert layer_syncs(experts, 64, "flat", capacity_factor, "padded") == Counter()
