"""Multi-process EP dispatch/combine: 4 gloo ranks as 2 simulated nodes x 2, both backends and payloads."""

from __future__ import annotations

import pytest
import torch

from dispatch import BACKENDS, PAYLOADS, EPDispatcher, make_topology
from dispatch.fp8 import dequantize_fp8, quantize_fp8
from launch.parallel.spawn import run_processes
from dispatch.predict import predict_traffic
from tests.dispatch.cases import (CASES, EXPERTS, GPUS_PER_NODE, HIDDEN, WORLD, calc_diff, dispatchers,
                                  dyadic_tokens, expected_combine, routing_case)

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

EXPERT_SCALE = torch.arange(1, EXPERTS + 1, dtype=torch.float64)  # expert e multiplies its rows by e+1


def _run_case(dispatcher: EPDispatcher, rank: int, case: str, payload: str) -> dict:
    indices, weights = routing_case(case, rank)
    exact = payload != "fp8"
    x = dyadic_tokens(indices.shape[0], torch.float32, rank) if exact else torch.randn(indices.shape[0], HIDDEN)
    recv_x, info, handle = dispatcher.dispatch(x, indices, weights)
    per_rank = dispatcher.experts_per_rank
    scale = EXPERT_SCALE[rank * per_rank:(rank + 1) * per_rank].float().repeat_interleave(info.tokens_per_local_expert)
    out = dispatcher.combine(recv_x * scale.unsqueeze(1), handle)
    identity = dispatcher.combine(recv_x, handle)
    traffic = {kind: dispatcher.last_bytes[kind].as_dict() for kind in ("dispatch", "combine")}

    x64 = x.double().requires_grad_()
    w = weights.clone().requires_grad_()
    recv, info64, handle64 = dispatcher.dispatch(x64, indices, w)
    grad_out = torch.randn(x64.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    (dispatcher.combine(recv, handle64) * grad_out).sum().backward()
    kept = (indices >= 0).double()
    sent = dequantize_fp8(*quantize_fp8(x), torch.float64) if payload == "fp8" else x.double()
    return {
        "scaled": (out.double(), expected_combine(x, indices, weights, EXPERT_SCALE)),
        "identity": (identity.double(), expected_combine(x, indices, weights, torch.ones(EXPERTS, dtype=torch.float64))),
        "rows": info.tokens_per_local_expert.tolist(),
        "grad_x": (x64.grad, grad_out * (weights.double() * kept).sum(1, keepdim=True)),
        "grad_w": (w.grad.double(), (grad_out * sent).sum(1, keepdim=True) * kept),
        "traffic": traffic,
    }


def _all_cases(rank: int, world_size: int) -> dict:
    return {(backend, payload, case): _run_case(dispatcher, rank, case, payload)
            for backend, payload, dispatcher in dispatchers(EXPERTS) for case in CASES}


@pytest.fixture(scope="module")
def results():
    return run_processes(_all_cases, WORLD, timeout_s=240)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_combine_of_identity_and_scaled_experts_is_exact_for_unquantised_payload(results, backend, case):
    for rank, res in enumerate(results):
        for check in ("identity", "scaled"):
            got, want = res[backend, "bf16", case][check]
            assert torch.equal(got, want), f"rank {rank} {check}: max err {(got - want).abs().max()}"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_payload_combine_is_close(results, backend, case):
    for rank, res in enumerate(results):
        for check in ("identity", "scaled"):
            got, want = res[backend, "fp8", case][check]
            assert calc_diff(got, want) < 1e-3, f"rank {rank} {check}"


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_are_the_combine_and_dispatch_of_gradients(results, backend, payload):
    for rank, res in enumerate(results):
        for case in CASES:
            got, want = res[backend, payload, case]["grad_x"]
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            got, want = res[backend, payload, case]["grad_w"]  # fp8: straight-through, so <g, sent row>
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # weights travel as fp32


def test_rows_per_local_expert_match_the_routing(results):
    for case in CASES:
        routed = torch.cat([routing_case(case, r)[0].reshape(-1) for r in range(WORLD)])
        per_expert = torch.bincount(routed[routed >= 0], minlength=EXPERTS).view(WORLD, -1).tolist()
        for backend in BACKENDS:
            assert [res[backend, "bf16", case]["rows"] for res in results] == per_expert
    assert sum(results[0]["flat", "bf16", "one_expert"]["rows"]) == 0  # a rank that receives nothing


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_measured_bytes_equal_the_prediction(results, backend, payload):
    topology = make_topology(WORLD, GPUS_PER_NODE)
    for case in CASES:
        indices = [routing_case(case, r)[0] for r in range(WORLD)]
        predicted = predict_traffic(indices, EXPERTS, topology, HIDDEN, backend, payload, torch.float32)
        for rank, res in enumerate(results):
            measured = res[backend, payload, case]["traffic"]
            for kind in ("dispatch", "combine"):
                assert measured[kind] == predicted[rank][kind].as_dict(), (case, rank, kind)
        assert sum(p["dispatch"].inter_payload for p in predicted) > 0
