"""Routing cases shared by the dispatch tests: every rank can rebuild every rank's inputs from (case, rank)."""

from __future__ import annotations

from typing import Iterator

import torch

from dispatch import BACKENDS, PAYLOADS, EPDispatcher
from dispatch.synthetic import synthetic_routing

WORLD, GPUS_PER_NODE, EXPERTS, TOP_K, HIDDEN = 4, 2, 8, 3, 160
CASES = ("uniform_dropped", "one_expert", "node_limited")


def dispatchers(num_experts: int) -> Iterator[tuple[str, str, EPDispatcher]]:
    """(backend, payload, dispatcher) for every backend and payload over the world of simulated nodes."""
    for backend in BACKENDS:
        for payload in PAYLOADS:
            yield backend, payload, EPDispatcher(num_experts, gpus_per_node=GPUS_PER_NODE, backend=backend,
                                                 payload=payload)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2*sum(x*y)/sum(x*x+y*y) in float64 (0 when equal)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom) if denom > 0 else 0.0


def routing_case(case: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, weights) of rank in case; weights are dyadic and nonzero even on dropped slots."""
    gen = torch.Generator().manual_seed(1000 * CASES.index(case) + rank)
    tokens = (0, 7, 33, 20)[rank]  # rank 0 sends nothing
    if case == "one_expert":  # every token's first slot hits expert 5; other slots dropped or on expert 4
        indices = torch.full((tokens, TOP_K), -1, dtype=torch.long)
        indices[:, 0] = 5
        indices[: tokens // 2, 1] = 4
    elif case == "uniform_dropped":
        indices = synthetic_routing(tokens, EXPERTS, TOP_K, generator=gen)[0]
        indices[torch.rand(tokens, TOP_K, generator=gen) < 0.3] = -1
    else:
        indices = synthetic_routing(tokens, EXPERTS, TOP_K, "node-limited", num_groups=2, topk_groups=1,
                                    generator=gen)[0]
    weights = torch.randint(1, 9, (tokens, TOP_K), generator=gen).float() / 8
    return indices, weights


def dyadic_tokens(rows: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Tokens whose products with dyadic weights and small sums are exact in fp32."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-16, 17, (rows, HIDDEN), generator=gen).double() / 8).to(dtype)


def expected_combine(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                     expert_scale: torch.Tensor) -> torch.Tensor:
    """sum_k w_k * expert_scale[e_k] * x over kept slots, in float64."""
    kept = indices >= 0
    scale = torch.where(kept, weights.double() * expert_scale[indices.clamp(min=0)], 0.0)
    return x.double() * scale.sum(1, keepdim=True)
