"""The routing weight folded before the down projection (model.activation_cache "fp8") through the EP dispatcher:
flat, hierarchical, hierarchical in chunks and the fp8 payload handing FP8Rows to the experts, each on a 1-rank gloo
group, equal the single-process layer (LocalDispatcher) with the same keys; the unweighted combine keeps nothing.

Bound: one rank moves no value between ranks; the two paths differ only in the order of fp32 sums (combine's
k = 2 partial sums, the routing weights' grads gathered per row), so every entry is within 2 n u max|entry|,
u = 2^-24, n = TOP_K + 2 (measured: bitwise equal under every ATEN_CPU_CAPABILITY and 5 seeds)."""

from __future__ import annotations

import copy

import pytest
import torch

from dispatch import EPDispatcher
from dispatch.synthetic import synthetic_routing
from moe.config import ModelConfig
from moe.layer import MoELayer
from tests.dispatch.test_segment_ops import one_rank  # noqa: F401  (fixture)

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 128, 64, 4, 2, 20
VARIANTS = {"flat": {}, "hierarchical": {"backend": "hierarchical", "gpus_per_node": 1},
            "hierarchical in 2 chunks": {"backend": "hierarchical", "gpus_per_node": 1, "chunks": 2},
            "fp8 payload, FP8Rows": {"payload": "fp8", "fp8_rows": True}}
BOUND = 2 * (TOP_K + 2) * 2.0 ** -24


def grads(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().requires_grad_()
    out, _ = layer(x)
    out.backward(dy)
    return {"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in layer.named_parameters() if p.grad is not None}}


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_folded_ep_layer_equals_the_local_one(variant):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=HIDDEN, num_experts=EXPERTS, top_k=TOP_K, expert_ffn_size=FFN,
                      activation_cache="fp8", expert_precision="fp8" if "fp8" in variant else "native")
    local = MoELayer(cfg)
    ep = copy.deepcopy(local)
    ep.to_expert_parallel(EPDispatcher(EXPERTS, **VARIANTS[variant]))
    assert ep.fold_weights
    x, dy = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN)
    want, got = grads(local, x, dy), grads(ep, x, dy)
    assert set(got) == set(want) >= {"out", "x", "router.weight", "experts.w_gate_up", "experts.w_down"}
    for key in want:
        assert (got[key] - want[key]).abs().max() <= BOUND * want[key].abs().max(), (variant, key)


@pytest.mark.usefixtures("one_rank")
def test_unweighted_combine_keeps_nothing_of_the_expert_output():
    gen = torch.Generator().manual_seed(0)
    indices, weights = synthetic_routing(TOKENS, EXPERTS, TOP_K, generator=gen)
    dispatcher = EPDispatcher(EXPERTS)
    x = torch.randn(TOKENS, HIDDEN, generator=gen, requires_grad=True)
    rows, _, handle = dispatcher.dispatch(x, indices, weights.requires_grad_())
    y = rows * 2
    for weighted, kept in ((True, [y.shape]), (False, [])):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(saved.append, lambda t: t):  # no backward runs
            dispatcher.combine(y, handle, weighted)
        assert [t.shape for t in saved if t.shape == y.shape] == kept
