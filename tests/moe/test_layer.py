"""MoELayer against a per-token loop reference, and gradcheck in float64."""

from __future__ import annotations

import pytest
import torch

from moe.config import ModelConfig
from moe.layer import MoELayer
from tests.moe import naive
from tests.moe.helpers import naive_route


def tiny_layer(dtype: torch.dtype = torch.float32, hidden: int = 16, experts: int = 8, **settings) -> MoELayer:
    """A small MoE layer whose parameters are O(1)/sqrt(fan-in), so its output is O(1)."""
    cfg = ModelConfig(hidden_size=hidden, num_heads=2, num_kv_heads=1, num_experts=experts,
                      expert_ffn_size=hidden // 2, top_k=2, num_shared_experts=1, **settings)
    layer = MoELayer(cfg).to(dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 1.5 / param.shape[-1] ** 0.5)
    return layer


def reference_output(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Route every token with the naive router, then run its experts and the shared expert one by one."""
    flat = x.reshape(-1, x.shape[-1])
    route = naive_route(layer.router, flat)
    lists = lambda t: t.double().tolist()  # noqa: E731
    shared = (lists(layer.shared.gate_up.weight), lists(layer.shared.down.weight))
    out = naive.moe_layer(lists(flat), route, lists(layer.experts.w_gate_up), lists(layer.experts.w_down), shared)
    return torch.tensor(out, dtype=torch.float64).view_as(x)


@pytest.mark.parametrize("settings", [
    {}, {"capacity_factor": 0.5}, {"capacity_factor": 0.7, "drop_policy": "position"},
    {"score_func": "sigmoid", "num_groups": 4, "topk_groups": 2, "route_scale": 2.5}])
def test_layer_equals_per_token_loop(settings):
    layer = tiny_layer(**settings)
    x = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(1))
    out, stats = layer(x, seq_len=16)
    expected = reference_output(layer, x)
    assert expected.abs().max() > 0.5  # a wrong expert or weight would show far above the tolerance
    assert (out.double() - expected).abs().max().item() <= 1e-5
    if "capacity_factor" in settings:
        assert stats.dropped.item() > 0
    assert stats.tokens_per_expert.sum().item() == 64 * 2 - stats.dropped.item()


@pytest.mark.slow  # takes seconds
def test_layer_gradcheck_float64():
    """Exact float64 gradients for the expert and shared-expert weights, through dispatch and combine."""
    layer = tiny_layer(torch.float64, hidden=8, experts=4, capacity_factor=0.75)
    x = torch.randn(12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert layer(x)[1].dropped.item() > 0
    params = dict(layer.named_parameters())
    trained = ["experts.w_gate_up", "experts.w_down", "shared.gate_up.weight", "shared.down.weight"]

    def run(*values):
        return torch.func.functional_call(layer, {**params, **dict(zip(trained, values))}, (x,))[0]

    inputs = tuple(params[name].detach().clone().requires_grad_() for name in trained)
    assert torch.autograd.gradcheck(run, inputs)


@pytest.mark.slow  # takes seconds
def test_layer_gradcheck_through_router():
    """Gradients w.r.t. x and the router weight; the router scores in fp32 by contract, so the
    finite-difference step is 1e-2 (no routing decision flips at this step for this data)."""
    layer = tiny_layer(torch.float64, capacity_factor=0.75, aux_loss_coeff=0.1)
    x = torch.randn(12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    params = dict(layer.named_parameters())

    def run(inp, router_weight):
        out, stats = torch.func.functional_call(layer, {**params, "router.weight": router_weight}, (inp,))
        return out, stats.aux_loss

    inputs = (x.clone().requires_grad_(), params["router.weight"].detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(run, inputs, eps=1e-2, atol=2e-4, rtol=1e-3)
