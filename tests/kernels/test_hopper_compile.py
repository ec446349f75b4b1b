"""Without a GPU, the Triton kernels still compile for an H100 (sm_90) to TMA loads feeding wgmma."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90_with_tma_and_wgmma():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.kernels.hopper_compile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ops = json.loads(done.stdout)
    assert set(ops) == {"mgrouped", "kgrouped", "quantize_rows", "quantize_blocks", "quantize_kgrouped",
                        "retile_kgrouped"}
    for gemm in ("mgrouped", "kgrouped"):
        assert {"ttng.warp_group_dot", "ttng.async_tma_copy_global_to_local"} <= set(ops[gemm])
