"""moe-bench checkpoint: the default is the 242M-parameter model on the tiny config's 4-process layout; the memory
probe sees an allocation made and freed inside its block."""

from __future__ import annotations

import time

import pytest
import torch

from launch.bench.checkpoint import DEFAULT_CONFIG, main, peak_rise, single_process_params, widened
from launch.config.run import build_config, read_toml

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)


def test_the_default_is_241m_params_on_the_tiny_layout():
    cfg = build_config(widened(read_toml(DEFAULT_CONFIG)))
    assert round(single_process_params(cfg) / 1e6) == 242 and cfg.parallel.world_size == 4
    assert cfg.train.dtype == "float32"


def test_peak_rise_sees_memory_freed_inside_the_block():
    # 256 MiB: glibc may keep up to 64 MiB freed by earlier tests resident and hand it out again without a rise
    with peak_rise() as peak:
        held = torch.ones(256 * 2**20 // 4)
        time.sleep(0.05)
        del held
    assert peak[0] >= 128 * 2**20


def test_a_call_over_the_budget_stops_the_run_naming_it(capsys):
    assert main(["--as-is", "--call-budget", "1e-9"]) == 3
    err = capsys.readouterr().err
    assert "moe-bench checkpoint: stopped:" in err and "state dict of the trainer's state" in err
