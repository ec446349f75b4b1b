"""Routers and tokens shared by the MoE tests."""

from __future__ import annotations

import torch

from moe.router import TopKRouter
from tests.moe import naive

HIDDEN = 16
ROUTE_SETTINGS = ("top_k", "score_func", "num_groups", "topk_groups", "capacity_factor", "drop_policy",
                  "norm_topk", "route_scale")


def make_router(num_experts: int = 8, top_k: int = 2, *, seed: int = 0, skew: float = 0.0,
                **settings) -> TopKRouter:
    """A router with O(1) logits, a small random expert_bias, and `skew` added to expert 0's logit."""
    gen = torch.Generator().manual_seed(seed)
    router = TopKRouter(num_experts, top_k, HIDDEN, **settings)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, HIDDEN, generator=gen) * 0.5)
        router.weight[0, 0] += skew
        router.expert_bias.copy_(torch.randn(num_experts, generator=gen) * 0.05)
    return router


def tokens(count: int, seed: int = 1) -> torch.Tensor:
    """count tokens whose feature 0 is the constant 1 (so a skew on weight[:, 0] hits every token)."""
    x = torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = 1.0
    return x


def naive_route(router: TopKRouter, x: torch.Tensor) -> naive.NaiveRoute:
    """The reference decision for the router's settings and parameters."""
    settings = {name: getattr(router, name) for name in ROUTE_SETTINGS}
    return naive.route(x.double().tolist(), router.weight.double().tolist(),
                       router.expert_bias.double().tolist(), **settings)
