"""Bad router settings: a ValueError naming the field, from the router and from ModelConfig alike."""

from __future__ import annotations

import pytest
import torch

from moe.config import ModelConfig
from moe.router import TopKRouter

BAD_SETTINGS = [
    (dict(num_experts=8, top_k=9), r"top_k = 9 must be <= num_experts = 8"),
    (dict(num_experts=8, top_k=0), r"top_k = 0 must be an integer >= 1"),
    (dict(num_experts=8, num_groups=2, topk_groups=3), r"topk_groups = 3 must be <= num_groups = 2"),
    (dict(num_experts=6, num_groups=4), r"num_experts = 6 must be divisible by num_groups = 4"),
    (dict(num_experts=8, top_k=4, num_groups=4, topk_groups=1),
     r"topk_groups = 1 groups of 2 experts cannot hold top_k = 4"),
    (dict(capacity_factor=0.0), r"capacity_factor = 0.0 must be > 0"),
    (dict(capacity_factor=-1.5), r"capacity_factor = -1.5 must be > 0"),
    (dict(capacity_factor=float("nan")), r"capacity_factor = nan must be > 0"),
    (dict(capacity_factor="1.0"), r"capacity_factor = '1.0' must be > 0"),
    (dict(capacity_factor=float("inf")), r"capacity_factor = inf must be > 0 and finite, or None for dropless"),
    (dict(capacity_factor=True), r"capacity_factor = True must be > 0"),
    (dict(score_func="tanh"), r"score_func = 'tanh' is not allowed; choose one of 'softmax', 'sigmoid'"),
    (dict(drop_policy="random"), r"drop_policy = 'random' is not allowed; choose one of 'probs', 'position'"),
]


def router_kwargs(num_experts: int = 8, top_k: int = 2, **settings) -> dict:
    """TopKRouter arguments with defaults for the ones a case leaves out."""
    return dict(num_experts=num_experts, top_k=top_k, hidden_size=16, **settings)


@pytest.mark.parametrize("settings,message", BAD_SETTINGS)
def test_router_rejects_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        TopKRouter(**router_kwargs(**settings))


@pytest.mark.parametrize("settings,message", BAD_SETTINGS)
def test_model_config_rejects_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**settings)


def test_router_rejects_wrong_input_shape():
    router = TopKRouter(**router_kwargs())
    with pytest.raises(ValueError, match=r"router input must be \[T, 16\]"):
        router(torch.zeros(4, 8))
