"""moe-bench tp on a tiny stack: three rows (ours TP, ours TP+SP, torch DTensor TP+SP), JSON fields, bad options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.bench import tp as bench

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # slow: spawns processes (tests/conftest.py)


def test_rows_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tp.json"
    assert bench.main(["--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
                       "--seq", "16", "--steps", "1", "--warmup", "0", "--quiet", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["contender"]: r for r in doc["rows"]}
    assert list(rows) == list(bench.CONTENDERS) and doc["header"]["suite"] == "tp"
    ours, ours_sp, peer = (rows[name] for name in bench.CONTENDERS)
    for row in rows.values():
        assert row["step_ms"] > 0 and row["max_diff"] < 1e-4
    assert ours["comm_mib"] == ours_sp["comm_mib"] == peer["comm_mib"] > 0
    assert ours_sp["norm_mib"] == pytest.approx(ours["norm_mib"] / 2, rel=0.05)
    assert ours_sp["act_mib"] <= peer["act_mib"]
    text = capsys.readouterr().out
    assert "torch DTensor TP+SP" in text
    runs = next(line for line in text.splitlines() if line.startswith("note: each contender runs"))
    assert "q/k/v in one Linear" in runs and "gate/up in one Linear" in runs and "hidden 32" in runs
    assert runs.removeprefix("note: ") in doc["header"]["notes"]


def test_options_that_do_not_split_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--heads", "6", "--tp", "4"])
    assert "--heads = 6 must be divisible by --tp = 4" in capsys.readouterr().err
