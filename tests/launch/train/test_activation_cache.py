"""model.activation_cache = "fp8" under dp2 x ep2, flat and hierarchical (gpus_per_node = 1: two simulated nodes),
equals the single process with the same keys, by test_equivalence's float64 checks (losses to 1e-10 relative,
params to calc_diff 1e-12).

Why float64's bounds hold with an FP8 cache: the cache rounds each row's gate|up to e4m3 in 1x128 tiles along the
row, so a layout changes what it keeps only where gate|up itself differs, by float64 reorderings (~1e-16 relative);
a code flips only for a value within that of a rounding boundary (probability ~1e-16 / 2^-4 per element), and a
scale moves by ~1e-16 relative. The rounding is the same on both sides, not a difference between them.
"""

from __future__ import annotations

import pytest

from launch.checkpoint.checkpointer import consolidate
from launch.config.run import build_config
from launch.parallel.spawn import run_processes
from launch.train.loop import train
from tests.launch.train.test_equivalence import (
    LAYOUTS,
    _train_runs,
    check_equal_runs,
    raw_config,
)

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

NAMES = ("dp2 ep2 flat", "dp2 ep2 hierarchical")
SPAWN_S = 600


def cached_raw(run_dir, corpus: str, parallel: dict) -> dict:
    raw = raw_config(str(run_dir), corpus, parallel, None)
    raw["model"]["activation_cache"] = "fp8"
    return raw


@pytest.mark.timeout(2 * SPAWN_S)
def test_fp8_activation_cache_layouts_equal_single_process(corpus, tmp_path):
    one = cached_raw(tmp_path / "one", corpus, {})
    reference = (train(build_config(one), progress=False), consolidate(tmp_path / "one" / "checkpoint"))
    raws = [cached_raw(tmp_path / name.replace(" ", "_"), corpus, LAYOUTS[name]) for name in NAMES]
    results = run_processes(_train_runs, 2, [(raw, False) for raw in raws], timeout_s=SPAWN_S, run_timeout_s=SPAWN_S)
    for i, (name, raw) in enumerate(zip(NAMES, raws)):
        check_equal_runs(results[0][i], raw, reference, LAYOUTS[name], f"activation_cache fp8 {name}")
