"""The trainer's ZeRO-1 reduction overlapped with the backward: started before the backward ends, same results.

Each layout trains 3 float64 steps twice in the same processes, with parallel.overlap_grad_reduce on and off,
step 1 poisoned with NaN (skipped). The runs must agree bitwise (losses, grad norms, step verdicts, final
parameters: the reductions add the same numbers in the same order, only earlier), and with overlap every
bucket's reduction must start before the step's backward ends (on ranks holding two stages, some before
its last backward action starts), where without overlap they start in the clip.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from launch.parallel.spawn import run_processes
from launch.checkpoint.checkpointer import consolidate
from launch.config.run import build_config
from launch.train.loop import train
from optim.shard import ShardedParams
from optim.zero import ZeroOptimizer
from pipeline.runtime import PipelineRuntime
from pipeline.schedules import Op
from tests.launch.train.test_equivalence import raw_config, release_groups

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

LAYOUTS = {
    "pp2 dualpipev, 2 pipeline steps per step": {"pp": 2, "schedule": "dualpipev", "num_chunks": 4},
    "pp2 dualpipev merged W": {"pp": 2, "schedule": "dualpipev", "chunks_per_weight_grad": 4},
    "pp2 dualpipe (mirrored stage copies)": {"pp": 2, "schedule": "dualpipe"},
    "pp2 1f1b": {"pp": 2, "schedule": "1f1b"},
    "dp2 ep2": {"dp": 2, "ep": 2},
}
BACKWARD_OPS = (Op.B, Op.W, Op.FB)
STEPS = 3


def _record(events: list, name: str, method):
    """Wrap method so each call appends (name, its first argument after self) to events before it runs and
    (name + " end", None) after."""
    def wrapped(self, *args, **kwargs):
        events.append((name, args[0] if args else None))
        try:
            return method(self, *args, **kwargs)
        finally:
            events.append((name + " end", None))
    return wrapped


def _train_with_events(rank: int, world: int, raws: list[dict]) -> list[tuple[list[dict], list]]:
    """Train each config; the events of each run: runtime actions, bucket launches, clips, zero_grads, in order."""
    out = []
    for raw in raws:
        events: list = []
        patches = [(PipelineRuntime, "_run", "action"), (ShardedParams, "launch", "launch"),
                   (ZeroOptimizer, "clip_grad_norm_", "clip"), (ZeroOptimizer, "zero_grad", "zero_grad")]
        saved = [getattr(cls, attr) for cls, attr, _ in patches]
        for (cls, attr, name), method in zip(patches, saved):
            setattr(cls, attr, _record(events, name, method))
        try:
            records = release_groups(train(build_config(raw), progress=False))
        finally:
            for (cls, attr, _), method in zip(patches, saved):
                setattr(cls, attr, method)
        out.append((records, [(kind, getattr(arg, "op", arg)) for kind, arg in events]))
    return out


def early_launches(events: list) -> list[tuple[int, int, int]]:
    """Per training step (from one zero_grad to the next): bucket launches (before the step's last backward
    action starts, before it ends, in all); without a pipeline the backward ends where the clip starts."""
    steps: list[list] = []
    for kind, arg in events:
        if kind == "zero_grad":
            steps.append([])
        elif steps:
            steps[-1].append((kind, arg))
    counts = []
    for step in steps:
        clip = next(i for i, (k, _) in enumerate(step) if k == "clip")
        last = max((i for i, (k, a) in enumerate(step[:clip]) if k == "action" and a in BACKWARD_OPS), default=clip)
        end = next(i for i, (k, _) in enumerate(step[last:], last) if k in ("action end", "clip"))
        launches = [i for i, (k, _) in enumerate(step) if k == "launch"]
        counts.append((sum(i < last for i in launches), sum(i < end for i in launches), len(launches)))
    return counts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(f"def f_{i}(x):\n    return x * {i}  # {i % 7}\n" for i in range(600)))
    return str(path)


def run_dir(root: Path, layout: str, overlap: bool) -> Path:
    return root / layout.replace(" ", "_") / f"overlap_{overlap}"


def overlap_raw(root: Path, corpus: str, layout: str, overlap: bool) -> dict:
    """The layout with overlap_grad_reduce on or off: STEPS steps, capacity 1.0, step 1 poisoned with NaN."""
    raw = raw_config(str(run_dir(root, layout, overlap)), corpus, {**LAYOUTS[layout], "overlap_grad_reduce": overlap},
                     1.0)
    raw["train"]["steps"] = STEPS
    raw["ops"] = {"inject_nan_steps": [1]}
    return raw


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> tuple[Path, dict[str, list]]:
    """Every layout with overlap on and off, all trained in one spawn (the layouts are of one world size): their
    root dir (run_dir) and layout -> per rank [(records, events) with overlap, (...) without]."""
    root = tmp_path_factory.mktemp("overlap")
    raws = [overlap_raw(root, corpus, layout, overlap) for layout in LAYOUTS for overlap in (True, False)]
    world, = {build_config(raw).parallel.world_size for raw in raws}
    per_rank = run_processes(_train_with_events, world, raws, timeout_s=300, run_timeout_s=1200)
    return root, {layout: [runs[2 * i:2 * i + 2] for runs in per_rank] for i, layout in enumerate(LAYOUTS)}


@pytest.mark.timeout(1320)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_overlapped_reduction_starts_early_and_changes_nothing(layout, trained):
    root, runs = trained
    for rank, ((on, on_events), (off, off_events)) in enumerate(runs[layout]):
        early, late = early_launches(on_events), early_launches(off_events)
        assert len(early) == STEPS and all(0 < during == total for _, during, total in early), (rank, early)
        if "dualpipe" in layout:  # two stages per rank: one's buckets go out while the other's backward runs
            assert all(before > 0 for before, _, _ in early), (rank, early)
        assert all(during == 0 for _, during, _ in late), (rank, late)
        assert [e[-1] for e in early] == [e[-1] for e in late], rank
        if rank == 0:
            assert [r["step_status"] for r in on] == [r["step_status"] for r in off] == ["ok", "nonfinite", "ok"]
            for got, want in zip(on, off):
                for key in ("loss", "lm_loss", "aux_loss", "grad_norm"):
                    assert got[key] == want[key] or math.isnan(got[key]) and math.isnan(want[key]), (got["step"], key)
    state_on, state_off = (consolidate(run_dir(root, layout, overlap) / "checkpoint") for overlap in (True, False))
    assert set(state_on) == set(state_off)
    for key, value in state_off.items():
        assert torch.equal(state_on[key], value), key
