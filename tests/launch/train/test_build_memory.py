"""A rank materialises only its own stages and experts: the build's real memory is far below the full model's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[3]


def test_rank_build_grows_rss_by_well_under_the_full_model():
    out = subprocess.run([sys.executable, "-m", "tests.launch.build_rss"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout)
    assert figures["full"] >= 4 * figures["rank"]  # the config makes one rank's share small
    assert figures["growth"] < 0.4 * figures["full"], figures
    assert figures["growth"] >= figures["rank"] * 0.9, figures  # the rank's own tensors are really there
