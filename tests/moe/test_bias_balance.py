"""Aux-loss-free balancing: update_bias follows its formula and evens out a skewed router."""

from __future__ import annotations

import pytest
import torch

from tests.moe.helpers import make_router, tokens


def max_over_mean(router, x: torch.Tensor) -> float:
    """Max expert load over mean expert load for one routed batch."""
    load = router(x).tokens_per_expert.float()
    return (load.max() / load.mean()).item()


def test_update_bias_formula():
    router = make_router(4, 1, bias_update_rate=0.25)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 1.0, -1.0, 0.5]))
    router.update_bias(torch.tensor([10, 2, 4, 4]))  # mean 5: signs +, -, -, -
    assert router.expert_bias.tolist() == [-0.25, 1.25, -0.75, 0.75]


@pytest.mark.parametrize("score_func,top_k,num_experts", [("sigmoid", 1, 8), ("sigmoid", 2, 16), ("softmax", 1, 8)])
def test_bias_updates_balance_a_skewed_router(score_func, top_k, num_experts):
    router = make_router(num_experts, top_k, score_func=score_func, bias_update_rate=0.01, skew=5.0)
    with torch.no_grad():
        router.expert_bias.zero_()
    held_out = tokens(512, seed=999)
    assert max_over_mean(router, held_out) >= 5.0
    for step in range(100):
        router.update_bias(router(tokens(512, seed=10 + step)).tokens_per_expert)
    assert max_over_mean(router, held_out) < 1.5
    assert router.expert_bias.argmin().item() == 0  # the overloaded expert was pushed down the most
