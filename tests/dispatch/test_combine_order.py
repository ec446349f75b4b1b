"""Combine's pre-reduction, bit for bit: one partial sum per (token, rank), then per node, at fixed rounding points.

4 gloo ranks as 2 simulated nodes x 2, 16 experts, top-8 (up to 4 experts of a token on one rank),
non-dyadic weights. fp32 tokens make the summation order visible; bf16 tokens the places where
partial sums are rounded to bf16 (the order hardly shows through bf16 rounding).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dispatch import BACKENDS, PAYLOADS, EPDispatcher, make_topology
from dispatch.fp8 import dequantize_fp8, quantize_fp8
from launch.parallel.spawn import run_processes
from dispatch.synthetic import synthetic_routing
from tests.dispatch.cases import GPUS_PER_NODE, HIDDEN, WORLD, dispatchers

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

EXPERTS, TOP_K, TOKENS = 16, 8, (0, 9, 40, 25)  # rank 0 sends nothing
CASES = ("uniform_dropped", "node_limited")
SCALE = torch.linspace(0.7, 3.1, EXPERTS)  # expert e multiplies its rows by SCALE[e] (in fp32, result in x's dtype)
PER_RANK = EXPERTS // WORLD
DTYPES = (torch.bfloat16, torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _inputs(case: str, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, indices, weights) of rank: uniform with 20% of slots dropped, or within one node's experts."""
    gen = torch.Generator().manual_seed(50 + 10 * CASES.index(case) + rank)
    indices = synthetic_routing(TOKENS[rank], EXPERTS, TOP_K, case.replace("_dropped", "").replace("_", "-"),
                                num_groups=2, topk_groups=1, generator=gen)[0]
    if case == "uniform_dropped":
        indices[torch.rand(indices.shape, generator=gen) < 0.2] = -1
    x = torch.randn(TOKENS[rank], HIDDEN, generator=gen).to(dtype)
    return x, indices, torch.rand(indices.shape, generator=gen)


def _rounded_sum(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """0 + parts[0] + parts[1] + ... in fp32, rounded once to dtype."""
    acc = torch.zeros(HIDDEN)
    for part in parts:
        acc = acc + part.float()
    return acc.to(dtype)


def reference_combine(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, backend: str) -> torch.Tensor:
    """Per token: each rank sums w * y over its experts in ascending expert order (fp32, rounded to x's dtype);
    flat sums those partials over ranks; hierarchical over the ranks of a node, then over nodes."""
    topology = make_topology(WORLD, GPUS_PER_NODE)
    dtype, rows = x.dtype, []
    for t in range(x.shape[0]):
        slots = sorted((int(e), k) for k, e in enumerate(indices[t]) if e >= 0)
        partial = {}
        for rank in range(WORLD):
            mine = [weights[t, k] * (x[t].float() * SCALE[e]).to(dtype).float() for e, k in slots
                    if e // PER_RANK == rank]
            if mine:
                partial[rank] = _rounded_sum(mine, dtype)
        if backend == "flat":
            rows.append(_rounded_sum([partial[r] for r in sorted(partial)], dtype))
            continue
        nodes = sorted({topology.node_of(r) for r in partial})
        rows.append(_rounded_sum([_rounded_sum([partial[r] for r in sorted(partial) if topology.node_of(r) == n],
                                               dtype) for n in nodes], dtype))
    return torch.stack(rows) if rows else torch.zeros(0, HIDDEN, dtype=dtype)


def _scaled_combine(dispatcher: EPDispatcher, rank: int, case: str, dtype: torch.dtype) -> torch.Tensor:
    x, indices, weights = _inputs(case, rank, dtype)
    recv, info, handle = dispatcher.dispatch(x, indices, weights)
    scale = SCALE[rank * PER_RANK:(rank + 1) * PER_RANK].repeat_interleave(info.tokens_per_local_expert)
    return dispatcher.combine((recv.float() * scale.unsqueeze(1)).to(dtype), handle)


def _combine_twice(rank: int, world_size: int) -> dict:
    return {(backend, payload, case, dtype): [_scaled_combine(dispatcher, rank, case, dtype) for _ in range(2)]
            for backend, payload, dispatcher in dispatchers(EXPERTS) for case, dtype in itertools.product(CASES, DTYPES)}


def test_combine_equals_the_ordered_pre_reduction_bitwise_and_repeats():
    results = run_processes(_combine_twice, WORLD, timeout_s=240)
    for rank, res in enumerate(results):
        assert len(res) == len(BACKENDS) * len(PAYLOADS) * len(CASES) * len(DTYPES)
        for (backend, payload, case, dtype), outs in res.items():
            first, second = (_bits(out) for out in outs)
            assert torch.equal(first, second), (backend, payload, case, dtype, rank)  # run to run
            x, indices, weights = _inputs(case, rank, dtype)
            sent = dequantize_fp8(*quantize_fp8(x), dtype) if payload == "fp8" else x
            want = _bits(reference_combine(sent, indices, weights, backend))
            assert torch.equal(first, want), (backend, payload, case, dtype, rank)


def test_the_reference_tells_orders_and_rounding_points_apart():
    for dtype in DTYPES:  # two nodes per token: the extra bf16 rounding per node, or the fp32 grouping, shows
        x, indices, weights = _inputs("uniform_dropped", 2, dtype)
        assert not torch.equal(reference_combine(x, indices, weights, "flat"),
                               reference_combine(x, indices, weights, "hierarchical"))
        x, indices, weights = _inputs("node_limited", 2, dtype)  # one node per token: nothing to tell apart
        assert torch.equal(reference_combine(x, indices, weights, "flat"),
                           reference_combine(x, indices, weights, "hierarchical"))
    x, indices, weights = _inputs("uniform_dropped", 2, torch.float32)
    reversed_order = torch.stack([
        sum((weights[t, k] * (x[t] * SCALE[e]) for k, e in reversed(list(enumerate(indices[t].tolist()))) if e >= 0),
            torch.zeros(HIDDEN)) for t in range(x.shape[0])])
    assert not torch.equal(reference_combine(x, indices, weights, "flat"), reversed_order)  # fp32 shows the order
