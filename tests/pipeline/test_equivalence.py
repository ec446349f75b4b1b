"""DualPipe / DualPipeV against a single-process reference of the whole model on the same chunks."""

from __future__ import annotations

import pytest
import torch

from launch.parallel.spawn import run_processes
from tests.pipeline.models import calc_diff, make_data, make_stages, reference
from tests.pipeline.workers import BATCH, HIDDEN, equivalence
from tests.spawns import from_shared_spawn

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

# (schedule, ranks, chunks per W action): merged W's (3 does not divide the chunks) as well as DeepSeek's
CASES = [("dualpipev", 1, 1), ("dualpipev", 2, 1), ("dualpipev", 2, 3), ("dualpipev", 4, 1), ("dualpipe", 2, 1),
         ("dualpipe", 4, 1), ("dualpipe", 4, 3)]


def _check(kind: str, world: int, stage_kind: str, results: list[dict], num_chunks: int) -> None:
    num_stages = world if kind == "dualpipe" else 2 * world
    for dtype in (torch.float32, torch.float64):
        ref_loss, ref_grads, ref_out = reference(make_stages(stage_kind, num_stages, HIDDEN, dtype),
                                                 make_data(BATCH, HIDDEN, dtype), num_chunks)
        if kind == "dualpipev":
            loss, fwd_loss = results[0][dtype]["loss"], results[0][dtype]["fwd_loss"]
            outs, fwd_outs = results[0][dtype]["outputs"], results[0][dtype]["fwd_outputs"]
        else:  # the last rank ends the first half's chunks, rank 0 the second half's
            first, last = results[-1][dtype], results[0][dtype]
            loss = torch.cat([first["loss"], last["loss"]])
            fwd_loss = torch.cat([first["fwd_loss"], last["fwd_loss"]])
            outs = tuple(torch.cat(p) for p in zip(first["outputs"], last["outputs"]))
            fwd_outs = tuple(torch.cat(p) for p in zip(first["fwd_outputs"], last["fwd_outputs"]))
        if dtype == torch.float32:
            assert torch.equal(loss, ref_loss), (loss, ref_loss)
            assert torch.equal(fwd_loss, ref_loss)
            assert all(torch.equal(a, b) for a, b in zip(outs, ref_out))
            assert all(torch.equal(a, b) for a, b in zip(fwd_outs, ref_out))
        summed = [[torch.zeros_like(g) for g in grads] for grads in ref_grads]
        for res in results:  # DualPipe: add up the two mirrored copies of each stage
            for module_grads, stage in zip(res[dtype]["grads"], res["held"]):
                for acc, g in zip(summed[stage], module_grads):
                    acc += g
        for stage, (got, want) in enumerate(zip(summed, ref_grads)):
            for g, w in zip(got, want):
                assert calc_diff(g, w) < 1e-12, (stage, calc_diff(g, w))
                if dtype == torch.float64:
                    assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)


def num_chunks(kind: str, world: int) -> int:
    return 2 * max(world, 2) if kind == "dualpipev" else 8


def _equivalence_cases(rank: int, world: int, cases: list[tuple[str, int, int]]) -> list[dict]:
    """equivalence of MLP and MoE stages for each (schedule, ranks, chunks per W action) case, in turn."""
    return [equivalence(rank, world, kind, ("mlp", "moe"), num_chunks(kind, world), merge_w)
            for kind, _, merge_w in cases]


@pytest.fixture(scope="module")
def spawned():
    """A case of CASES -> each rank's equivalence results; the cases of one world size run in one spawn."""
    out = {}

    def run(case: tuple[str, int, int]) -> list[dict]:
        cases = [c for c in CASES if c[1] == case[1]]

        def spawn() -> list[list[dict]]:
            results = run_processes(_equivalence_cases, case[1], cases, timeout_s=180, run_timeout_s=420)
            return [[rank[i] for rank in results] for i in range(len(cases))]
        return from_shared_spawn(out, case, cases, spawn)
    return run


@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind,world,merge_w", CASES)
def test_linear_and_moe_stages_match_reference(kind: str, world: int, merge_w: int, spawned) -> None:
    results = spawned((kind, world, merge_w))
    for stage_kind in ("mlp", "moe"):
        _check(kind, world, stage_kind, [r[stage_kind] for r in results], num_chunks(kind, world))
