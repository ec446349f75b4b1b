"""moe-plan --validate: every published run of the calibration file is planned in its own layout and printed
beside its published throughput with the ratio; a run outside the band is marked; the search never ranks a
layout that does not fit."""

from __future__ import annotations

import json
import re
from pathlib import Path

from launch.config import load_config
from launch.plan.calibrate import BAND, load_runs, plan_run
from launch.plan.cli import main
from launch.plan.planner import Machine
from launch.plan.presets import GPUS
from launch.plan.search import search

ROOT = Path(__file__).resolve().parents[2]


def test_every_calibration_run_names_its_source_and_plans_in_its_own_layout():
    runs = load_runs()
    assert len(runs) >= 6 and len({r.name for r in runs}) == len(runs)
    for run in runs:
        assert run.source and run.tokens_per_s_per_gpu > 0 and run.gpu in GPUS
        if run.config is None:  # no public layout: listed, not planned
            assert plan_run(run) is None
            continue
        config = load_config(ROOT / run.config, run.set)
        assert config.parallel.world_size == run.gpus
        assert plan_run(run).config.parallel == config.parallel  # the run's own layout, not a searched one


def test_validate_prints_predicted_published_and_ratio_and_marks_misses(tmp_path, capsys):
    out = tmp_path / "validate.json"
    assert main(["--validate", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["runs"]
    assert [r["name"] for r in rows] == [r.name for r in load_runs()]
    header = next(line for line in text.splitlines() if line.strip().startswith("run"))
    assert all(word in header for word in ("predicted tok/s/GPU", "published", "ratio", "peak memory"))
    for row in rows:
        line = next(line for line in text.splitlines() if line.strip().startswith(row["name"] + " "))
        if row["predicted_tokens_per_s_per_gpu"] is None:
            assert line.rstrip().endswith("not planned")
            continue
        ratio = row["predicted_tokens_per_s_per_gpu"] / row["published_tokens_per_s_per_gpu"]
        assert row["ratio"] == ratio
        assert f"{ratio:.2f}" in line and f"{row['predicted_tokens_per_s_per_gpu']:,.0f}" in line
        assert line.rstrip().endswith("ok" if abs(ratio - 1) <= BAND else "MISS")
        assert re.search(r"GB (fits|DOES NOT FIT)", line)
        assert row["source"] in text


def test_search_never_ranks_a_layout_that_does_not_fit_above_one_that_does():
    config = load_config(ROOT / "configs" / "tiny.toml", ["train.grad_accum_steps=8", "train.micro_batch_size=64",
                                                          "train.seq_len=256", "model.max_seq_len=256"])
    roomy = search(config, 4, Machine(GPUS["h100"], 4))
    peaks = sorted(p.peak_memory for p in roomy.ranked)
    limit = peaks[len(peaks) // 2] / 1e9  # a GPU that holds only the leaner half of the layouts
    tight = Machine(GPUS["h100"].__class__(**{**GPUS["h100"].__dict__, "memory_gb": limit}), 4)
    result = search(config, 4, tight)
    assert result.ranked and any("does not fit" in why for _, why in result.cut)
    assert all(p.fits for p in result.ranked)
    times = [p.step_seconds for p in result.ranked]
    assert times == sorted(times)
