"""Synthetic routings for tests and benchmarks: uniform, skewed (Zipf-like) and node-limited top-k."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from dispatch.choices import check_choice

Routing = Literal["uniform", "skewed", "node-limited"]
ROUTINGS = get_args(Routing)


def synthetic_routing(num_tokens: int, num_experts: int, top_k: int, routing: str = "uniform", *,
                      num_groups: int = 1, topk_groups: int = 1, skew: float = 1.0,
                      generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """(indices [T, k] int64 distinct experts per token, weights [T, k] fp32 summing to 1 per token).

    uniform: every expert equally likely; skewed: expert e drawn with probability ~ 1/(e+1)^skew;
    node-limited: DeepSeek-style, experts only from the topk_groups best of num_groups groups.
    """
    check_choice("routing", routing, Routing)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k = {top_k} must be in [1, num_experts = {num_experts}]")
    gumbel = -torch.empty(num_tokens, num_experts).exponential_(generator=generator).log()
    scores = gumbel
    if routing == "skewed":
        scores = gumbel - skew * torch.log1p(torch.arange(num_experts, dtype=torch.float32))
    if routing == "node-limited":
        if num_experts % num_groups or not 1 <= topk_groups <= num_groups:
            raise ValueError(f"node-limited routing needs num_groups ({num_groups}) dividing num_experts "
                             f"({num_experts}) and 1 <= topk_groups ({topk_groups}) <= num_groups")
        if topk_groups * (num_experts // num_groups) < top_k:
            raise ValueError(f"topk_groups = {topk_groups} groups cannot hold top_k = {top_k} experts")
        grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
            1, group_score.topk(topk_groups, dim=-1).indices, True)
        scores = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    top = scores.topk(top_k, dim=-1)
    return top.indices, top.values.softmax(-1)
