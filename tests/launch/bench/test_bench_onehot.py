"""OneHotDispatcher (GShard one-hot capacity dispatch) against a naive slot-major reference, on 4 gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

from dispatch import make_topology
from dispatch.fp8 import dequantize_fp8, quantize_fp8
from launch.parallel.spawn import run_processes
from launch.bench.onehot import OneHotDispatcher, dropped_slots, onehot_masks, onehot_traffic
from tests.dispatch.cases import EXPERTS, GPUS_PER_NODE, HIDDEN, TOP_K, WORLD, dyadic_tokens, routing_case

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

CASES = ("uniform_dropped", "one_expert")  # one_expert overflows expert 5 at any capacity below the token count
CAPACITY_FACTORS = (0.5, 4.0)


def naive_slots(indices: torch.Tensor, capacity: int) -> dict[tuple[int, int], tuple[int, int]]:
    """{(token, slot): (expert, position)} of the kept slots: every token's first choice, then every second..."""
    filled = [0] * EXPERTS
    kept = {}
    for slot in range(indices.shape[1]):
        for token in range(indices.shape[0]):
            expert = int(indices[token, slot])
            if expert >= 0 and filled[expert] < capacity:
                kept[token, slot] = (expert, filled[expert])
                filled[expert] += 1
    return kept


def _capacity(factor: float, case: str) -> int:
    most_tokens = max(routing_case(case, r)[0].shape[0] for r in range(WORLD))
    return math.ceil(factor * most_tokens * TOP_K / EXPERTS)


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for payload in ("bf16", "fp8"):
        for factor in CAPACITY_FACTORS:
            dispatcher = OneHotDispatcher(EXPERTS, gpus_per_node=GPUS_PER_NODE, capacity_factor=factor,
                                          payload=payload)
            for case in CASES:
                indices, weights = routing_case(case, rank)
                x = dyadic_tokens(indices.shape[0], torch.float32, rank)
                expert_in, capacity, combine = dispatcher.dispatch(x, indices, weights)
                y = dispatcher.combine(expert_in, combine)
                traffic = {kind: dispatcher.last_bytes[kind].as_dict() for kind in ("dispatch", "combine")}
                out[payload, factor, case] = {"expert_in": expert_in, "capacity": capacity, "combine": y,
                                              "traffic": traffic}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_processes(_worker, WORLD, timeout_s=120)


def _sent(x: torch.Tensor, payload: str) -> torch.Tensor:
    return dequantize_fp8(*quantize_fp8(x), torch.float32) if payload == "fp8" else x


@pytest.mark.parametrize("payload", ("bf16", "fp8"))
@pytest.mark.parametrize("factor", CAPACITY_FACTORS)
@pytest.mark.parametrize("case", CASES)
def test_identity_experts_combine_to_x_times_the_kept_weights(results, payload, factor, case):
    capacity = _capacity(factor, case)
    for rank, res in enumerate(results):
        got = res[payload, factor, case]
        assert got["capacity"] == capacity
        indices, weights = routing_case(case, rank)
        x = _sent(dyadic_tokens(indices.shape[0], torch.float32, rank), payload)
        kept_weight = torch.zeros(indices.shape[0])
        for token, slot in naive_slots(indices, capacity):
            kept_weight[token] += weights[token, slot]
        torch.testing.assert_close(got["combine"], x * kept_weight.unsqueeze(1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("payload", ("bf16", "fp8"))
@pytest.mark.parametrize("case", CASES)
def test_expert_inputs_hold_the_kept_tokens_at_their_slots_and_zeros_elsewhere(results, payload, case):
    factor, per_rank = CAPACITY_FACTORS[0], EXPERTS // WORLD
    capacity = _capacity(factor, case)
    want = torch.zeros(WORLD, per_rank, WORLD, capacity, HIDDEN)  # [owner, local expert, source, position]
    for src in range(WORLD):
        indices = routing_case(case, src)[0]
        x = _sent(dyadic_tokens(indices.shape[0], torch.float32, src), payload)
        for (token, _), (expert, position) in naive_slots(indices, capacity).items():
            want[expert // per_rank, expert % per_rank, src, position] = x[token]
    for rank, res in enumerate(results):
        got = res[payload, factor, case]["expert_in"]
        assert torch.equal(got, want[rank].reshape(per_rank, WORLD * capacity, HIDDEN)), f"rank {rank}"


def test_capacity_really_drops_and_the_dropped_count_matches_the_reference():
    for case in CASES:
        for rank in range(WORLD):
            indices = routing_case(case, rank)[0]
            for factor in CAPACITY_FACTORS:
                capacity = _capacity(factor, case)
                routed = int((indices >= 0).sum())
                assert dropped_slots(indices, EXPERTS, capacity) == routed - len(naive_slots(indices, capacity))
    indices = routing_case("one_expert", 2)[0]
    assert dropped_slots(indices, EXPERTS, _capacity(0.5, "one_expert")) > 0


def test_masks_place_each_kept_slot_once_with_its_weight():
    indices, weights = routing_case("uniform_dropped", 2)
    capacity = 3
    mask, combine = onehot_masks(indices, weights, EXPERTS, capacity, torch.float64)
    want_mask, want_combine = torch.zeros_like(mask), torch.zeros_like(combine)
    for (token, slot), (expert, position) in naive_slots(indices, capacity).items():
        want_mask[token, expert, position] = 1
        want_combine[token, expert, position] = weights[token, slot]
    assert torch.equal(mask, want_mask) and torch.equal(combine, want_combine)


@pytest.mark.parametrize("payload", ("bf16", "fp8"))
def test_every_rank_sends_full_padded_buffers_to_every_peer(results, payload):
    topology = make_topology(WORLD, GPUS_PER_NODE)
    row_bytes = {"bf16": HIDDEN * 4, "fp8": HIDDEN + 4 * math.ceil(HIDDEN / 128)}[payload]  # x is fp32 here
    for case in CASES:
        rows = _capacity(CAPACITY_FACTORS[1], case) * EXPERTS // WORLD
        for rank, res in enumerate(results):
            traffic = res[payload, CAPACITY_FACTORS[1], case]["traffic"]
            remote = sum(not topology.same_node(rank, p) for p in range(WORLD))
            local_peers = WORLD - 1 - remote
            assert traffic["dispatch"]["inter_payload"] == remote * rows * row_bytes
            assert traffic["dispatch"]["intra_payload"] == local_peers * rows * row_bytes
            assert traffic["combine"]["inter_payload"] == remote * rows * HIDDEN * 4
            assert traffic["dispatch"]["inter_meta"] == traffic["dispatch"]["intra_meta"] == 0
            predicted = onehot_traffic(topology, EXPERTS, rows * WORLD // EXPERTS, HIDDEN, payload, torch.float32)
            assert traffic == {kind: t.as_dict() for kind, t in predicted[rank].items()}


def test_bad_payload_and_capacity_factor_are_refused_before_any_communication():
    with pytest.raises(ValueError, match="payload"):
        OneHotDispatcher(EXPERTS, payload="int8")
    with pytest.raises(ValueError, match="capacity_factor"):
        OneHotDispatcher(EXPERTS, capacity_factor=0.0)
