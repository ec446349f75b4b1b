"""moe-bench data: its rows (ours and the peer, prepare and load), the JSON file, bad arguments refused."""

from __future__ import annotations

import json

import pytest

from launch.bench.data import main

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)


def test_rows_of_prepare_and_load_beside_the_peer(tmp_path, capsys):
    out = tmp_path / "data.json"
    assert main(["--mbytes", "0.2", "--steps", "3", "--seq-len", "64", "--dp", "2", "--quiet",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["path"], r["stage"]): r for r in result["rows"]}
    assert [stage for _, stage in rows] == ["prepare"] * 2 + ["load, DP rank 0 of 2"] * 3
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert result["key"] == ["path", "stage"] and result["metrics"]["tokens_per_s"] == "higher"
    assert "DataFeed over shards, prefetch 1" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--mbytes", "-1"], ["--dp", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert argv[0] in capsys.readouterr().err
