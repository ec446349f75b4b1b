"""moe-plan command line: bad input is a clear error naming the field; a search ranks the layouts that fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.config import load_config
from launch.plan.cli import main
from launch.plan.planner import Machine
from launch.plan.presets import GPUS
from launch.plan.search import search

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")


@pytest.mark.parametrize("argv, message", [
    (["--set", "parallel.pp=8", "--set", "parallel.dp=1", "--set", "parallel.ep=1", "--set",
      "train.grad_accum_steps=16"], "model.num_layers = 4 is fewer than the 16 pipeline stages"),
    (["--set", "parallel.ep=3"], "parallel.ep = 3 must divide dp x tp"),
    (["--gpu", "a100"], "--gpu 'a100' is not a known GPU; choose one of h800, h100, h200, b200"),
    (["--peak-tflops", "100"], "--memory-gb, --intra-node-gbps, --inter-node-gbps must be given"),
    (["--gpu", "h100", "--inter-node-gbps", "0"], "--inter-node-gbps = 0.0 must be > 0"),
    (["--gpus", "8"], "--gpus 8 differs from the config's layout pp x dp x tp = 4"),
    (["--search"], "--search needs --gpus N"),
    (["--measure", "--steps", "0"], "--steps = 0 must be >= 1"),
])
def test_bad_input_is_a_clear_error(argv, message, capsys):
    assert main([TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_search_ranks_fitting_layouts_by_step_time_and_gives_reasons_for_the_rest():
    config = load_config(TINY, ["train.grad_accum_steps=8"])
    tight = Machine(GPUS["h100"], 4)
    result = search(config, 4, tight)
    times = [p.step_seconds for p in result.ranked]
    assert times == sorted(times) and len(times) > 3
    assert {(p.config.parallel.pp, p.config.parallel.dp) for p in result.ranked} >= {(1, 4), (2, 2), (4, 1)}
    assert all(p.fits for p in result.ranked)
    assert any("tensor parallelism" in why for _, why in result.cut)  # tp > 1: the trainer refuses it
