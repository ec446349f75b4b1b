"""moe-bench clock: the sustained share of a burst's rate from timed windows, and its rows without a GPU."""

from __future__ import annotations

import json

import pytest

from launch.bench.clock import held, main
from launch.plan.efficiency import ATTENTION_SUSTAINED_CLOCK, SUSTAINED_CLOCK

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)


def test_the_sustained_rate_is_the_median_of_the_windows_after_the_clock_settles():
    # 1e12 FLOPs a call: 1 ms in the burst (1000 TFLOPS), then the clock falls over the first windows and stays
    windows = [1.00e-3, 1.05e-3, 1.10e-3, 1.17e-3, 1.17e-3, 1.18e-3]
    got = held(1.0e-3, windows, 1e12)
    assert got.burst_tflops == pytest.approx(1000.0)
    assert got.settled.samples == windows[2:] and got.sustained_tflops == pytest.approx(1e12 / 1.17e-3 / 1e12)
    assert got.clock == pytest.approx(1.0 / 1.17)
    with pytest.raises(ValueError, match="no timed window"):
        held(1.0e-3, [], 1e12)


def test_without_a_gpu_every_kind_of_work_is_a_row_beside_the_planners_factor(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    path = tmp_path / "clock.json"
    assert main(["--seconds", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["work"]: r["planned_clock"] for r in rows} == {
        "bf16 GEMM": SUSTAINED_CLOCK, "fp8 GEMM": SUSTAINED_CLOCK, "attention": ATTENTION_SUSTAINED_CLOCK}
    assert all(r["clock"] is None and r["call_ms"] is None for r in rows)
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--seconds", "0"], ["--window", "0"], ["--rest", "-1"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert "--seconds > 0" in capsys.readouterr().err
