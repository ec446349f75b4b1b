"""Faults of long runs: NaN steps skipped exactly, N in a row stop the run, loss spikes skipped or rolled
back, SIGTERM saves and returns, a killed or a stopped (SIGSTOP) rank ends the run with the rank named."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from launch.parallel.spawn import WorkerError, run_processes
from launch.checkpoint.checkpointer import consolidate, published, verify
from launch.config.run import build_config
from launch.config.ops import OpsSettings
from launch.faults.guard import FaultError, StepGuard
from launch.train.loop import train
from tests.launch.checkpoint.test_checkpoint import config

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)


def model_at(run: Path, step: int) -> dict:
    return consolidate(run / "checkpoint" / f"step{step:08d}")


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_nan_steps_are_skipped_exactly(corpus, tmp_path):
    """Drill NaN into steps 2 and 4: those steps change nothing (weights, router biases), the others do."""
    run = tmp_path / "run"
    records = train(build_config(config(run, corpus, {}, every=1, keep_checkpoints=6, inject_nan_steps=[2, 4])),
                    progress=False)
    assert [r["step_status"] for r in records] == ["ok", "ok", "nonfinite", "ok", "nonfinite", "ok"]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 2, 2]
    for step in range(1, 6):
        skipped = step in (2, 4)
        assert same(model_at(run, step), model_at(run, step + 1)) == skipped, step
    assert records[3]["lr"] == records[2]["lr"]  # the schedule does not advance on a skipped step
    assert all(torch.isfinite(v).all() for v in model_at(run, 6).values() if v.is_floating_point())


def test_bad_steps_in_a_row_stop_the_run(corpus, tmp_path):
    raw = config(tmp_path / "run", corpus, {}, inject_nan_steps=[1, 2], max_bad_steps=2)
    with pytest.raises(FaultError, match=r"2 steps in a row \(steps \[1, 2\]\).*ops.max_bad_steps = 2"):
        train(build_config(raw), progress=False)


def test_robust_zscore_calls_only_the_outlier():
    guard = StepGuard(OpsSettings(spike_policy="skip", spike_window=8, spike_zscore=6.0))
    losses = [5.0, 4.8, 4.7, 4.75, 4.6, 4.65, 30.0, 4.5, float("nan")]
    verdicts = [guard.verdict(i, loss, 1.0) for i, loss in enumerate(losses)]
    assert verdicts == ["ok"] * 6 + ["spike", "ok", "nonfinite"]
    assert 30.0 not in guard.history


def test_the_guards_loss_history_is_checkpointed(corpus, tmp_path):
    """A spike on the first step after a resume is caught: the accepted losses came back with the checkpoint
    (an empty history calls nothing before MIN_SPIKE_HISTORY losses)."""
    run = tmp_path / "run"
    train(build_config(config(run, corpus, {}, steps=5, spike_policy="skip")), progress=False)
    records = train(build_config(config(run, corpus, {}, spike_policy="skip", inject_spike_steps=[5])),
                    resume=True, progress=False)
    assert [(r["step"], r["step_status"]) for r in records] == [(5, "spike")]


def test_spike_skip_leaves_the_model_and_rollback_returns_to_the_checkpoint(corpus, tmp_path):
    skip, back = tmp_path / "skip", tmp_path / "back"
    records = train(build_config(config(skip, corpus, {}, every=1, keep_checkpoints=6, spike_policy="skip",
                                        inject_spike_steps=[4])), progress=False)
    assert [r["step_status"] for r in records] == ["ok"] * 4 + ["spike", "ok"]
    assert same(model_at(skip, 4), model_at(skip, 5)) and not same(model_at(skip, 5), model_at(skip, 6))
    records = train(build_config(config(back, corpus, {}, every=2, keep_checkpoints=6, spike_policy="rollback",
                                        inject_spike_steps=[5])), progress=False)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 4, 5]
    assert records[5]["step_status"] == "spike" and records[5]["rolled_back_to"] == 4
    assert [r["lr"] for r in records[6:]] == [r["lr"] for r in records[4:6]]  # schedule rewound with the weights
    assert records[6]["lm_loss"] < records[5]["lm_loss"] / 100  # the spike's update never happened


def _signal_after_two_steps(rank: int, world: int, raw: dict, sig: int) -> list[dict]:
    """Rank 1 sends itself sig once rank 0 has logged two steps (SIGTERM: preempted; SIGKILL: dies; SIGSTOP: hangs)."""
    metrics = Path(raw["train"]["run_dir"]) / "metrics.jsonl"

    def fail():
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.05)
        os.kill(os.getpid(), sig)

    if rank == 1:
        threading.Thread(target=fail, daemon=True).start()
    return train(build_config(raw), progress=False)


def test_sigterm_saves_and_returns(corpus, tmp_path):
    run = tmp_path / "run"
    raw = config(run, corpus, {"dp": 2, "ep": 2}, steps=500)
    records = run_processes(_signal_after_two_steps, 2, raw, signal.SIGTERM, timeout_s=120)[0]
    assert 2 <= len(records) < 500
    step, folder = published(run / "checkpoint")[0]
    assert step == records[-1]["step"] + 1 and verify(folder) is None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_dead_or_hung_rank_ends_the_run_naming_it(sig, corpus, tmp_path, capfd):
    """The collective timeout (45 s) is far above the watchdog's 5 s: only the watchdog or the launcher can
    end the run before it, and the message names rank 1."""
    raw = config(tmp_path / "run", corpus, {"dp": 2, "ep": 2}, steps=500, heartbeat_timeout_s=5.0)
    with pytest.raises(WorkerError) as failure:
        run_processes(_signal_after_two_steps, 2, raw, sig, timeout_s=45, run_timeout_s=600)
    text = str(failure.value) + capfd.readouterr().err
    if sig == signal.SIGKILL:
        assert "rank 1 died with exit code -9 (SIGKILL)" in text
    else:
        assert "rank 1 stopped publishing progress" in text and "rank 0 died with exit code 3" in text
