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


def test_gluon_kernels_compile_for_sm90a_without_spills_barriers_or_serialised_wgmma():
    """Every checked Gluon config compiles to TMA + wgmma within the checks (tests/kernels/gluon_compile.py), and
    each check fails on its planted variant: 7 stages (shared memory over 227 KB), `bar.sync 0` after the main
    loop's wgmma, the wgrad at BLOCK_N 128 (spills), a ptxas log with C7514. The same script runs by hand under
    Triton 3.6."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                        reason="this Triton has no Gluon (triton.experimental.gluon): the fast kernels need >= 3.6")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.kernels.gluon_compile", "--planted"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = json.loads(done.stdout)
    for name in ("bn128_s5", "bn128_s6", "bn64_s6", "wgrad_bn64_s6"):
        assert reports[name]["ok"], (name, reports[name])
    planted = {name: report for name, report in reports.items() if name.startswith("planted")}
    assert not any(report["ok"] for report in planted.values())
    assert planted["planted_stages7"]["shared_bytes"] > 227 * 1024
    assert planted["planted_bar_sync_0"]["main_loop_cta_barriers"]
    assert planted["planted_wgrad_bn128"]["spill_bytes"] > 0
    assert planted["planted_c7514"]["c7514"]
