"""`moe-bench compare`: per-row ratios between two runs of any suite; a 20% slowdown is flagged, noise is not."""

from __future__ import annotations

import copy
import json

import pytest

from launch.bench.compare import main
from launch.bench.report import HIGHER, LOWER, header, write_json

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

ROWS = [{"optimizer": "zero1", "world_size": 2, "step_ms": 10.0, "gbps": 4.0},
        {"optimizer": "ddp_adamw", "world_size": 2, "step_ms": 20.0, "gbps": 2.0}]


def _write(path, rows, suite="optim", argv=("--steps", "3")):
    write_json(path, header(suite, list(argv)), rows, ["optimizer", "world_size"], {"step_ms": LOWER, "gbps": HIGHER})
    return str(path)


def test_an_injected_20_percent_slowdown_is_flagged_and_5_percent_is_not(tmp_path, capsys):
    new = copy.deepcopy(ROWS)
    new[0]["step_ms"] *= 1.2
    new[1]["step_ms"] *= 1.05
    assert main([_write(tmp_path / "old.json", ROWS), _write(tmp_path / "new.json", new)]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.endswith("SLOWER")]
    assert len(lines) == 1 and lines[0].startswith("zero1 ") and "step_ms" in lines[0] and "1.200" in lines[0]


def test_a_drop_of_a_higher_is_better_metric_counts_as_slower(tmp_path, capsys):
    new = copy.deepcopy(ROWS)
    new[1]["gbps"] = 2.0 / 1.2
    assert main([_write(tmp_path / "old.json", ROWS), _write(tmp_path / "new.json", new), "--threshold", "0.1"]) == 1
    flagged = [line for line in capsys.readouterr().out.splitlines() if line.endswith("SLOWER")]
    assert len(flagged) == 1 and flagged[0].startswith("ddp_adamw ") and "gbps" in flagged[0]
    assert main([_write(tmp_path / "old.json", ROWS), _write(tmp_path / "new.json", new), "--threshold", "0.25"]) == 0


def test_a_real_suite_json_with_one_row_slowed_down(tmp_path, capsys):
    """The kernels suite's CPU JSON has no timings: the compared metrics come from the file, rows match by key."""
    from launch.bench import kernels
    old = tmp_path / "old.json"
    assert kernels.main(["--quiet", "--json", str(old)]) == 0
    doc = json.loads(old.read_text())
    for i, row in enumerate(doc["rows"]):
        row["tflops"] = 100.0 + i
    old.write_text(json.dumps(doc))
    doc["rows"][2]["tflops"] /= 1.2
    (tmp_path / "new.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert main([str(old), str(tmp_path / "new.json")]) == 1
    flagged = [line for line in capsys.readouterr().out.splitlines() if line.endswith("SLOWER")]
    assert len(flagged) == 1 and flagged[0].startswith(f"{doc['rows'][2]['op']} ")


def test_files_of_different_suites_or_without_a_header_are_refused(tmp_path, capsys):
    assert main([_write(tmp_path / "a.json", ROWS), _write(tmp_path / "b.json", ROWS, "pipeline")]) == 2
    (tmp_path / "plain.json").write_text(json.dumps(ROWS))
    assert main([str(tmp_path / "plain.json"), str(tmp_path / "a.json")]) == 2
    out = capsys.readouterr().out
    assert "different suites" in out and "not a moe-bench result file" in out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "a.json"), str(tmp_path / "a.json"), "--threshold", "-1"])


def test_rows_match_by_every_key_field_and_other_options_are_noted(tmp_path, capsys):
    """A row at another world size is not compared with this one; differing command lines are said."""
    new = copy.deepcopy(ROWS)
    new[0]["world_size"] = 4
    new[0]["step_ms"] *= 2
    assert main([_write(tmp_path / "old.json", ROWS), _write(tmp_path / "new.json", new, argv=("--steps", "5"))]) == 0
    out = capsys.readouterr().out
    assert "only in OLD: zero1 2" in out and "only in NEW: zero1 4" in out and "SLOWER" not in out
    assert "note: the options differ: OLD 'moe-bench optim --steps 3', NEW 'moe-bench optim --steps 5'" in out
