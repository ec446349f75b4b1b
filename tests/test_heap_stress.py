"""The heap-corruption stress (tests/heap_stress.py) as a test: skipped unless MOE_HEAP_STRESS=1, since it takes
many minutes (MOE_HEAP_STRESS_REPEAT: runs per path, default 30; MOE_HEAP_STRESS_PATHS: which paths)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.heap_stress import PATHS

pytestmark = [pytest.mark.slow,  # spawns processes (tests/conftest.py)
              pytest.mark.skipif(os.environ.get("MOE_HEAP_STRESS") != "1",
                                 reason="the heap stress runs by hand: MOE_HEAP_STRESS=1 (minutes per path)")]


@pytest.mark.timeout(6 * 3600)
def test_multi_process_paths_survive_glibc_heap_checks() -> None:
    paths = os.environ.get("MOE_HEAP_STRESS_PATHS", ",".join(PATHS))
    repeat = os.environ.get("MOE_HEAP_STRESS_REPEAT", "30")
    done = subprocess.run([sys.executable, "-m", "tests.heap_stress", "--repeat", repeat, "--paths", paths],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True)
    print(done.stdout, done.stderr[-4000:])
    assert done.returncode == 0, done.stdout
