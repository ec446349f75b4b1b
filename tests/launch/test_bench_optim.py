"""moe-bench optim on a tiny model: one row per contender with the JSON fields the issue names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.bench import optim as bench

pytestmark = pytest.mark.timeout(300)


def test_rows_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "optim.json"
    assert bench.main(["--layers", "2", "--hidden", "32", "--steps", "2", "--warmup", "1",
                       "--adamw", "for-loop", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["optimizer"] for r in rows] == ["zero1", bench.PEER, "ddp_adamw"]
    params = 2 * (32 * 32 + 32)
    for row in rows:
        assert row["world_size"] == 2 and row["step_ms"] > 0
    ours, peer, ddp = (r["optimizer_state_bytes"] / params for r in rows)
    assert ours == pytest.approx(6, rel=0.01) and 6 <= peer < 12
    assert ddp == pytest.approx(12, rel=0.01)
    assert "zero_redundancy" in capsys.readouterr().out


def test_an_iteration_over_the_call_budget_stops_the_run_naming_the_contender(capsys) -> None:
    assert bench.main(["--layers", "1", "--hidden", "8", "--steps", "1", "--warmup", "0", "--call-budget", "1e-9",
                       "--quiet"]) == 3
    err = capsys.readouterr().err
    assert "stopped: contender 'zero1' training iteration was still running after the per-call budget of 1e-09 s" in err
    assert "raise --call-budget" in err
