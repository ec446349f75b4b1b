"""Runtime behaviour: the B/W split defers weight grads into W actions; bad input fails early."""

from __future__ import annotations

import pytest
import torch

from launch.parallel.spawn import run_processes
from kernels.backend import BACKEND_ENV
from tests.pipeline.models import calc_diff
from tests.pipeline.models import criterion, make_data
from tests.pipeline.workers import (BATCH, HIDDEN, bad_inputs, bw_split, context_stages, ep_overlap, in_turn,
                                    mixed_messages, p2p_both_ways, p2p_fixed, p2p_messages, sent_messages, with_context)

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

TORCH = {BACKEND_ENV: "torch"}  # the FP8 experts run the torch reference on CPU
STAGE_KINDS = ["mlp", "moe", "moe-fp8"]
# the 2-rank runs of these tests: name -> (worker, its arguments after rank and world, environment)
RUNS = {**{f"bw_split {kind}": (bw_split, (8, kind), TORCH) for kind in STAGE_KINDS},
        "bw_split merged W": (bw_split, (8, "mlp", 8), {}), "ep_overlap": (ep_overlap, (4,), {}),
        "p2p_messages": (p2p_messages, (), {}), "p2p_fixed": (p2p_fixed, (), {}),
        "p2p_both_ways": (p2p_both_ways, (), {}), "with_context": (with_context, (4,), {})}


@pytest.fixture(scope="module")
def spawned() -> dict[str, list]:
    """Name -> each rank's result of that run of RUNS, all run in turn in one spawn."""
    results = run_processes(in_turn, 2, list(RUNS.values()), timeout_s=150, run_timeout_s=540)
    return {name: [rank[i] for rank in results] for i, name in enumerate(RUNS)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage_kind", STAGE_KINDS)
def test_weight_grads_are_computed_in_w_actions(stage_kind: str, spawned) -> None:
    results = spawned[f"bw_split {stage_kind}"]
    for rank, res in enumerate(results):
        split, fused = res[True], res[False]
        assert split["w_actions"] > 0
        in_w = [s for s in split["seen"] if s[0] == "W"]
        # every W action accumulates the two watched weights of its stage: the two Linear layers of
        # an MLP stage, w_gate_up and w_down of the grouped experts of a MoE stage
        assert len(in_w) == 2 * split["w_actions"]
        assert ("B", True) not in split["seen"]  # a split B never touches weight grads
        assert all(op != "W" for op, _ in fused["seen"])
        assert len(split["seen"]) == len(fused["seen"])
        for g_split, g_fused in zip(split["grads"], fused["grads"]):
            assert calc_diff(g_split, g_fused) < 1e-12
    assert torch.equal(results[0][True]["loss"], results[0][False]["loss"])


@pytest.mark.timeout(600)
def test_a_merged_w_accumulates_each_weight_once_for_all_its_chunks(spawned) -> None:
    results = spawned["bw_split merged W"]
    for res in results:
        split, fused = res[True], res[False]
        assert split["w_actions"] == 2  # one per stage: all 8 chunks' weight grads together
        assert split["seen"] == [("W", False)] * 4  # each of the 2 x 2 Linear weights accumulated once
        assert len(fused["seen"]) == 4 * 8
        for g_split, g_fused in zip(split["grads"], fused["grads"]):
            assert calc_diff(g_split, g_fused) < 1e-12
    assert torch.equal(results[0][True]["loss"], results[0][False]["loss"])


@pytest.mark.timeout(120)
def test_bad_input_raises_clear_errors() -> None:
    errors = run_processes(bad_inputs, 1, timeout_s=60)[0]
    assert "even number of ranks" in errors["odd_ranks"]
    assert "pair (m0, m1)" in errors["modules"]
    assert "num_chunks = 1 is too few" in errors["few_chunks"]
    assert "batch size 32, not divisible" in errors["indivisible"]
    assert "needs inputs" in errors["missing_inputs"]
    assert "merge_w = 0" in errors["merge_w"] and "integer >= 1" in errors["merge_w"]
    assert "1 when split_bw is False" in errors["merge_w_unsplit"]


@pytest.mark.timeout(600)
def test_ep_overlap_runs_backward_while_communication_is_in_flight(spawned) -> None:
    results = spawned["ep_overlap"]
    for res in results:
        on, off = res[True], res[False]
        assert torch.equal(on["loss"], off["loss"])
        for a, b in zip(on["grads"], off["grads"]):
            assert torch.equal(a, b)
        # with overlap, some backward runs between a forward's comm start and its completion
        assert "comm started,backward" in ",".join(on["log"])
        assert "comm started,backward" not in ",".join(off["log"])
        # a pair's forward share is recorded where its forward ran whole before its backward
        assert on["shares"] == {} and on["pairs"] > 0
        assert len(off["shares"]) == off["pairs"] and all(0 < x < 1 for x in off["shares"].values())
    assert not torch.equal(results[0][True]["loss"], results[1][True]["loss"])


@pytest.mark.timeout(600)
def test_p2p_negotiates_shapes_dtypes_and_counts_per_message(spawned) -> None:
    received = spawned["p2p_messages"][1]
    sent = sent_messages()
    assert len(received) == len(sent)
    for got, want in zip(received, sent):
        assert len(got) == len(want)
        for (t, flag), w in zip(got, want):
            assert t.dtype == w.dtype and t.shape == w.shape and torch.equal(t, w.detach())
            assert flag == w.requires_grad


@pytest.mark.timeout(600)
def test_p2p_with_a_fixed_layout_sends_payloads_only_intact_and_refuses_other_shapes(spawned) -> None:
    results = spawned["p2p_fixed"]
    for rank, res in enumerate(results):
        g = torch.Generator().manual_seed(1 - rank)  # the peer's messages, drawn again here
        for got in res["got"]:
            want = [torch.randn(2, 3, 4, generator=g), torch.randint(-9, 9, (5,), generator=g, dtype=torch.int8)]
            assert [(t.dtype, t.shape) for t, _ in got] == [(w.dtype, w.shape) for w in want]
            assert all(torch.equal(t, w) and flag for (t, flag), w in zip(got, want))
        assert res["sizes"] == [2 * 3 * 4 * 4 + 5]  # the posted buffer holds the payload alone: no header
        assert "differ from the fixed message" in res["error"] and "(2, 3, 5)" in res["error"]


@pytest.mark.timeout(600)
def test_p2p_messages_cross_both_ways_on_two_streams_intact_and_in_order(spawned) -> None:
    results = spawned["p2p_both_ways"]
    for rank, received in enumerate(results):
        sent = mixed_messages(1 - rank, len(received))
        for got, want in zip(received, sent):
            assert [t.dtype for t, _ in got] == [w.dtype for w in want]
            assert all(torch.equal(t, w) for (t, _), w in zip(got, want))


@pytest.mark.timeout(600)
def test_context_reaches_every_stage_with_its_chunk(spawned) -> None:
    """step(context=): each stage of DualPipeV (rank 1 holds only middle stages) gets its chunk's rows of the context;
    losses and grads as one process running the stages in order on each chunk."""
    chunks = RUNS["with_context"][1][0]
    results = spawned["with_context"]
    stages = context_stages(4)
    data = make_data(BATCH, HIDDEN, torch.float64)
    scale = torch.arange(1, BATCH + 1, dtype=torch.float64).unsqueeze(1) / BATCH
    losses = []
    for x, skip, label, rows in zip(*(t.chunk(chunks) for t in (*data, scale))):
        h = (x, skip)
        for stage in stages:
            h = stage(*h, rows)
        loss = criterion(*h, label)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(results[0]["loss"], torch.stack(losses), rtol=1e-12, atol=0)
    for res in results:
        for index, grads in zip(res["held"], res["grads"]):
            for got, want in zip(grads, stages[index].parameters()):
                assert calc_diff(got, want.grad) < 1e-12
