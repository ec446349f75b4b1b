"""moe-bench imbalance: a skewed routing on 2 EP ranks with 0 and 1 redundant experts per rank in one run; the
spare cuts the busiest rank's rows to what moe-plan's imbalance model predicts for that routing, and changes no
output; bad options are refused before anything starts."""

from __future__ import annotations

import json

import pytest

from launch.bench import imbalance

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)
SMALL = ["--ranks", "2", "--experts", "8", "--tokens", "64", "--hidden", "16", "--ffn", "16", "--steps", "1",
         "--warmup", "0", "--quiet"]


def test_a_spare_cuts_the_busiest_rank_as_planned_and_changes_no_output(tmp_path):
    out = tmp_path / "imbalance.json"
    assert imbalance.main([*SMALL, "--spares", "0", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["header"]["suite"] == "imbalance" and doc["metrics"] == {"step_ms": "lower",
                                                                        "busiest_over_mean": "lower"}
    rows = {row["spares"]: row for row in doc["rows"]}
    assert rows[0]["busiest_over_mean"] > rows[1]["busiest_over_mean"] >= 1
    for row in rows.values():  # measured from the dispatch's rows, planned from the loads and moe.replicas.place
        assert row["busiest_over_mean"] == pytest.approx(row["planned_busiest_over_mean"], rel=0.02)
        assert row["max_out_diff"] < 1e-6 and row["step_ms"] > 0 and row["repeats"] == 1
    assert rows[0]["speedup"] == 1.0


@pytest.mark.parametrize("argv, message", [(["--spares", "5"], "--spares 5: parallel.redundant_experts = 5"),
                                           (["--skew", "-1"], "--skew = -1.0")])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        imbalance.main([*SMALL, *argv])
    assert message in capsys.readouterr().err
