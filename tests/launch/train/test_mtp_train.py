"""The trainer with multi-token prediction: a run resumed from its checkpoint (MTP params and their optimizer
state in it) continues the uninterrupted run."""

from __future__ import annotations

import pytest

from launch.checkpoint.checkpointer import consolidate
from launch.config.run import build_config
from launch.train.loop import train
from tests.launch.train.test_equivalence import STEPS, calc_diff, raw_config


@pytest.mark.slow  # takes seconds
def test_mtp_run_resumes_from_its_checkpoint(tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text("".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(800)))
    cut = 3

    def raw(name: str, steps: int) -> dict:
        out = raw_config(str(tmp_path / name), str(corpus), {}, None, "mla", mtp_depth=2)
        out["train"].update(steps=steps, warmup_steps=cut)  # the warmup covers the cut: LRs do not depend on steps
        return out
    whole = train(build_config(raw("whole", STEPS)), progress=False)
    train(build_config(raw("cut", cut)), progress=False)
    resumed = train(build_config(raw("cut", STEPS)), resume=True, progress=False)
    assert [r["step"] for r in resumed] == list(range(cut, STEPS))
    for got, want in zip(resumed, whole[cut:]):
        for key in ("loss", "lm_loss", "mtp_loss_1", "mtp_loss_2"):
            assert got[key] == pytest.approx(want[key], rel=1e-12), (got["step"], key)
    state, want_state = consolidate(tmp_path / "cut" / "checkpoint"), consolidate(tmp_path / "whole" / "checkpoint")
    assert any(key.startswith("mtp.1.") for key in want_state) and set(state) == set(want_state)
    for key, value in want_state.items():
        if value.is_floating_point() and value.abs().sum() > 0:
            assert calc_diff(state[key], value) < 1e-12, key
