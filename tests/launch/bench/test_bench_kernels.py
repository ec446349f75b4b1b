"""`moe-bench kernels` on CPU: checks every op's accuracy, says timings need a GPU, writes the JSON rows."""

import json

import pytest

from kernels.shapes import JAGGED
from launch.bench import kernels as bench
from launch.bench.cli import main as moe_bench

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)


def test_cpu_run_checks_correctness_and_writes_null_timings(tmp_path, capsys):
    path = tmp_path / "kernels.json"
    assert moe_bench(["kernels", "--json", str(path)]) == 0
    assert "timings need a GPU" in capsys.readouterr().out
    rows = json.loads(path.read_text())["rows"]
    assert {(r["op"], r["backend"]) for r in rows} == {(op, b) for op in ("forward", "dgrad", "wgrad")
                                                       for b in ("torch", "triton")}
    for row in rows:
        assert {"op", "shape", "tflops", "peer", "peer_tflops"} <= set(row)
        assert row["tflops"] is None and row["peer_tflops"] is None
        assert 0 < row["calc_diff"] < 1e-3
        assert row["shape"] == {"group_sizes": [0, 130, 1, 200, 0, 67], "N": 128, "K": 256}


def test_gpu_accounting_with_a_fixed_clock(monkeypatch, capsys):
    """The timed path on CPU tensors with every call taking 2 ms: TFLOPS = 2*M*N*K / 2 ms, the fp8 peer
    (CUDA-only) is reported as skipped, cases over --max-total-rows are left out."""
    monkeypatch.setattr(bench, "_event_seconds", lambda fn, calls: (fn(), 2e-3)[1])
    args = bench.parse_args(["--shapes", "256x128", "--groups", "2,4", "--rows", "16,64", "--max-total-rows", "128"])
    rows = bench.gpu_rows(args, device="cpu")
    shapes = sorted({(r["shape"]["groups"], r["shape"]["rows_per_group"]) for r in rows})
    assert shapes == [(2, 16), (2, 64), (4, 16)]
    assert len(rows) == 3 * 3 * 2
    for r in rows:
        m = r["shape"]["groups"] * r["shape"]["rows_per_group"]
        assert r["tflops"] == 2.0 * m * 128 * 256 / 2.0 / 1e9
        assert r["ms"] == 2.0 and r["ms_spread"] == 0.0 and r["repeats"] == args.repeats  # the harness's fields
        if r["peer"] == "torch._grouped_mm bf16":
            assert r["peer_tflops"] == r["tflops"] and r["ratio"] == 1.0 and r["ratio_spread"] == 0.0
        else:
            assert r["peer_tflops"] is None and r.get("ratio") is None
        assert r["calc_diff"] < 2e-3  # bf16 inputs and fp32 output of the reference path
        assert r["bitwise_stable"] is True  # a second call of our kernel gave the same bits
    assert "skipped" in capsys.readouterr().err


def test_planned_tflops_names_the_gpu_and_prices_each_op_as_the_planner_does():
    """moe-plan's figure beside a measurement: the preset found from CUDA's device name, each op priced as
    launch.plan.efficiency prices that linear's forward, input grad and weight grad."""
    from launch.plan.efficiency import GemmModel
    from launch.plan.presets import GPUS, preset_for_device

    assert preset_for_device("NVIDIA H100 80GB HBM3") is GPUS["h100"]
    assert preset_for_device("NVIDIA H200") is GPUS["h200"]
    assert preset_for_device("NVIDIA GB200") is GPUS["gb200"] and preset_for_device("NVIDIA B200") is GPUS["b200"]
    assert preset_for_device("NVIDIA A100-SXM4-80GB") is None
    model = GemmModel(GPUS["h100"])
    shape = {"groups": 8, "rows_per_group": 512, "N": 768, "K": 2048}
    flops = 2.0 * 8 * 512 * 768 * 2048
    forward, dgrad, wgrad = model.linear(512, 768, 2048, "bf16", 8)
    assert bench.planned_tflops(model, "forward", shape, "bf16") == flops / forward / 1e12
    assert bench.planned_tflops(model, "dgrad", shape, "bf16") == flops / dgrad / 1e12
    assert bench.planned_tflops(model, "wgrad", shape, "fp8-block") == flops / model.linear(512, 768, 2048, "fp8-block", 8)[2] / 1e12
    assert bench.planned_tflops(None, "forward", shape, "bf16") is None


def test_dry_run_lists_the_issue_table_without_cuda(capsys):
    """The default cases are issue 47's table: forward and dgrad at 2 (N, K) x 6 group layouts (jagged with an empty
    and a 4093-row group), wgrad at 2 x 3; both our kernels of each op; a grid replaces the table."""
    assert bench.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "30 cases"
    cases = bench.cases(bench.parse_args([]))
    assert [op for op, *_ in cases].count("wgrad") == 6 and len(cases) == 30
    assert ("forward", 4096, 7168, (4096,) * 8) in cases and ("dgrad", 7168, 2048, JAGGED) in cases
    assert 0 in JAGGED and 4093 in JAGGED and sum(JAGGED) == 8 * 4096
    assert all("ours (fast, reference)" in line for line in lines[:-1])
    grid = bench.cases(bench.parse_args(["--shapes", "256x128", "--groups", "2", "--rows", "16"]))
    assert grid == [(op, 128, 256, (16, 16)) for op in ("forward", "dgrad", "wgrad")]
