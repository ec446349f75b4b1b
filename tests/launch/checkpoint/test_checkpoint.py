"""Sharded DCP checkpoints: resume in another layout continues the 1-process run, atomic publication,
refused damaged checkpoints, a rank killed mid-save, keep-last-N, async saves, export.

Model and data are test_equivalence's tiny float64 config; every resumed run is compared with one
uninterrupted single-process run of 6 steps (losses to 1e-10 relative, final parameters by calc_diff).
Runs cut at step 3 are configured for 3 steps: the 3 warmup steps keep their LRs those of the 6-step run.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from launch.parallel.spawn import WorkerError, run_processes
from launch.checkpoint.checkpointer import Checkpointer, consolidate, export, latest_valid, published, verify
from launch.checkpoint.chunks import Reader
from launch.checkpoint.hf.export import saved_config
from launch.config.run import RENAMED, build_config
from launch.train.loop import train
from launch.train_cli import main
from moe.model import MoETransformer
from tests.launch.train.test_equivalence import calc_diff, raw_config, release_groups

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

STEPS = 6
HALF = 3
PP2_EP2 = {"pp": 2, "dp": 2, "ep": 2, "schedule": "dualpipev"}
PP2_DP2 = {"pp": 2, "dp": 2, "schedule": "dualpipev"}
PP2_V = {"pp": 2, "schedule": "dualpipev"}
PP2_DUALPIPE = {"pp": 2, "schedule": "dualpipe"}
DP2_EP2 = {"dp": 2, "ep": 2}
# redundant experts re-placed after steps 1, 3 and 5: the cut at HALF = 3 falls inside a load window (steps 2-3), which
# the checkpoint must carry for the resumed run to place after step 3 as the uninterrupted one does
DP2_EP2_SPARE = {**DP2_EP2, "redundant_experts": 1, "rebalance_every": 2}


def config(run_dir, corpus: str, parallel: dict, steps: int = STEPS, every: int = 0, **ops) -> dict:
    raw = raw_config(str(run_dir), corpus, parallel, None)
    raw["train"].update(steps=steps, checkpoint_every=every, warmup_steps=HALF)  # LRs of steps < HALF: any train.steps
    raw["ops"] = ops
    return raw


def _runs(rank: int, world: int, runs: list[tuple[dict, bool]]) -> list[list[dict]]:
    return [release_groups(train(build_config(raw), resume=resume, progress=False)) for raw, resume in runs]


def assert_continues(records: list[dict], reference: list[dict], first: int) -> None:
    assert [r["step"] for r in records] == list(range(first, STEPS))
    for got, want in zip(records, reference[first:]):
        for key in ("loss", "lm_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-10), (got["step"], key)


def assert_same_model(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if value.is_floating_point() and value.abs().sum() > 0:
            assert calc_diff(got[key], value) < 1e-12, key
        else:
            assert torch.equal(got[key], value), key


def test_reshard_between_layouts_continues_the_single_process_run(corpus, saved_reference, tmp_path):
    """pp2 x ep2 (4 ranks) -> 1 process; pp2 dp2 -> pp2 dp2 ep2 (4 ranks); 1 process -> dp2 ep2 (2 ranks). In the
    dp2 ep2 spawn also: dp2 ep2 with redundant experts cut at HALF (inside a load window) and resumed equals
    its uninterrupted run bit for bit: losses, params and the placement in the final checkpoint."""
    want, ref_dir = saved_reference
    a, b, c = tmp_path / "pp2ep2", tmp_path / "pp2dp2", tmp_path / "one"
    cut, whole = tmp_path / "spare_cut", tmp_path / "spare_whole"
    saved_a, saved_b, resumed_b = run_processes(_runs, 4, [
        (config(a, corpus, PP2_EP2, steps=HALF), False), (config(b, corpus, PP2_DP2, steps=HALF), False),
        (config(b, corpus, PP2_EP2), True)], timeout_s=300)[0]
    resumed_a = train(build_config(config(a, corpus, {})), resume=True, progress=False)
    train(build_config(config(c, corpus, {}, steps=HALF)), progress=False)
    resumed_c, saved_d, resumed_d, whole_d = run_processes(_runs, 2, [
        (config(c, corpus, DP2_EP2), True), (config(cut, corpus, DP2_EP2_SPARE, steps=HALF), False),
        (config(cut, corpus, DP2_EP2_SPARE), True), (config(whole, corpus, DP2_EP2_SPARE), False)], timeout_s=300)[0]
    check_bitwise_resume(saved_d + resumed_d, whole_d, cut, whole)
    assert_continues(saved_a + resumed_a, want, 0)
    assert_continues(saved_b + resumed_b, want, 0)
    assert_continues(resumed_c, want, HALF)
    final = consolidate(ref_dir / "checkpoint")
    for run in (a, b, c):
        assert [s for s, _ in published(run / "checkpoint")] == [STEPS, HALF]
        assert_same_model(consolidate(run / "checkpoint"), final)


def check_bitwise_resume(resumed: list[dict], whole: list[dict], resumed_dir: Path, whole_dir: Path) -> None:
    """A run cut and resumed in its own layout equals its uninterrupted run exactly: every step's losses and
    grad norm, the final checkpoint's tensors (redundant experts' placements included, each using a spare slot)."""
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == list(range(STEPS))
    for got, ref in zip(resumed, whole):
        assert [got[k] for k in ("loss", "lm_loss", "aux_loss", "grad_norm")] == [
            ref[k] for k in ("loss", "lm_loss", "aux_loss", "grad_norm")], got["step"]
    got, ref = consolidate(resumed_dir / "checkpoint"), consolidate(whole_dir / "checkpoint")
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    placements = [ref[k] for k in ref if k.endswith(".replica_placement")]
    assert placements and any((p >= 0).any() for p in placements)


def test_reshard_through_plain_dualpipe_continues_the_single_process_run(corpus, saved_reference, tmp_path):
    """pp2 DualPipeV (steps 0-1) -> pp2 DualPipe (step 2: each rank holds both stage copies, ZeRO-1 shards a
    stage over its two holders) -> 1 process (steps 3-5), all within the warmup's LRs up to the last cut."""
    want, ref_dir = saved_reference
    run = tmp_path / "run"
    first, second = run_processes(_runs, 2, [(config(run, corpus, PP2_V, steps=2), False),
                                             (config(run, corpus, PP2_DUALPIPE, steps=HALF), True)], timeout_s=300)[0]
    last = train(build_config(config(run, corpus, {})), resume=True, progress=False)
    assert_continues(first + second + last, want, 0)
    assert [s for s, _ in published(run / "checkpoint")] == [STEPS, HALF, 2]
    assert_same_model(consolidate(run / "checkpoint"), consolidate(ref_dir / "checkpoint"))


def test_damaged_checkpoints_are_refused_and_the_previous_one_used(corpus, saved_reference, tmp_path, capfd):
    """Keep 2 of saves at 2, 4, 6; truncate then corrupt step 6: both refused by name, the run resumes at 4."""
    want, _ = saved_reference
    run = tmp_path / "run"
    train(build_config(config(run, corpus, {}, every=2, keep_checkpoints=2)), progress=False)
    root = run / "checkpoint"
    assert [s for s, _ in published(root)] == [6, 4]
    assert not list(root.glob(".*tmp"))
    newest = root / "step00000006"
    shard = sorted(newest.glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    assert "truncated" in verify(newest)
    shard.write_bytes(data[:50] + bytes([data[50] ^ 0xFF]) + data[51:])
    assert "CRC-32" in verify(newest)
    assert latest_valid(root) == root / "step00000004"
    capfd.readouterr()
    resumed = train(build_config(config(run, corpus, {}, every=2, keep_checkpoints=2)), resume=True, progress=False)
    err = capfd.readouterr().err
    assert "step00000006 refused" in err and "CRC-32" in err
    assert_continues(resumed, want, 4)


def _die_while_saving(rank: int, world: int, raw: dict) -> list[dict]:
    """Rank 1 truncates its step-4 shard file and kills itself before the checkpoint is published."""
    import launch.checkpoint.checkpointer as checkpoint

    table = checkpoint.file_table

    def dying(folder, names):
        if rank == 1 and folder.name == ".step00000004.tmp":
            for name in names:
                path = folder / name
                path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return table(folder, names)

    checkpoint.file_table = dying
    return train(build_config(raw), progress=False)


def test_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(corpus, saved_reference, tmp_path):
    want, _ = saved_reference
    run = tmp_path / "run"
    with pytest.raises(WorkerError, match="rank 1 died"):
        run_processes(_die_while_saving, 2, config(run, corpus, DP2_EP2, every=2), timeout_s=60)
    root = run / "checkpoint"
    assert (root / ".step00000004.tmp").is_dir()
    assert latest_valid(root) == root / "step00000002"
    resumed = train(build_config(config(run, corpus, {})), resume=True, progress=False)
    assert_continues(resumed, want, 2)


def test_async_saves_hold_the_same_numbers_and_export_loads(corpus, saved_reference, tmp_path):
    """Async (DCP helper thread) checkpoints equal the synchronous run's bitwise; export feeds MoETransformer."""
    _, ref_dir = saved_reference
    run = tmp_path / "run"
    train(build_config(config(run, corpus, {}, every=2, keep_checkpoints=5, async_checkpoint=True)), progress=False)
    assert [s for s, _ in published(run / "checkpoint")] == [6, 4, 2]
    for step in (2, 4, 6):
        got = consolidate(run / "checkpoint" / f"step{step:08d}")
        want = consolidate(ref_dir / "checkpoint" / f"step{step:08d}")
        assert all(torch.equal(got[k], want[k]) for k in want) and set(got) == set(want), step
    path = export(run / "checkpoint", tmp_path / "model.pt")
    assert main(["export", str(run / "checkpoint"), str(tmp_path / "cli.pt")]) == 0
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "none.pt")]) == 2
    assert all(torch.equal(a, b) for a, b in zip(torch.load(path).values(), torch.load(tmp_path / "cli.pt").values()))
    cfg = build_config(config(run, corpus, {}))
    model = MoETransformer(cfg.model).double()
    model.load_state_dict(torch.load(path))
    want = consolidate(ref_dir / "checkpoint")
    assert all(torch.equal(value, want[key]) for key, value in model.state_dict().items())


def test_a_checkpoint_saved_with_old_key_names_resumes(corpus, saved_reference, tmp_path, monkeypatch):
    """A checkpoint whose saved config spells [parallel]'s renamed keys the old way (RENAMED) resumes the run, and its
    saved config reads with the current names."""
    want, _ = saved_reference
    run = tmp_path / "run"
    save, old_name = Checkpointer.save, {new: old for old, new in RENAMED["parallel"].items()}

    def save_with_old_names(self, state, step, config):
        parallel = {old_name.get(key, key): value for key, value in config["parallel"].items()}
        save(self, state, step, {**config, "parallel": parallel})

    monkeypatch.setattr(Checkpointer, "save", save_with_old_names)
    train(build_config(config(run, corpus, {}, steps=HALF)), progress=False)
    monkeypatch.undo()
    folder = run / "checkpoint" / f"step{HALF:08d}"
    stored = Reader(str(folder)).read_metadata().state_dict_metadata
    assert all(f"meta/config.parallel.{old}" in stored for old in RENAMED["parallel"])
    assert set(saved_config(Reader(str(folder)))["parallel"]) >= set(RENAMED["parallel"].values())
    assert_continues(train(build_config(config(run, corpus, {})), resume=True, progress=False), want, HALF)
