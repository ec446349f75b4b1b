"""moe-bench cp on tiny shapes: a row per (length, contender) with the promised fields; CP shards the saved
activations and the bytes sent are the K/V shards' (ring: 3 cp - 2 of them, all-gather: 2 (cp - 1))."""

from __future__ import annotations

import json

import pytest

from launch.bench import cp as bench

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # slow: spawns processes (tests/conftest.py)


def test_rows_bytes_and_activations(tmp_path) -> None:
    out = tmp_path / "cp.json"
    assert bench.main(["--seq", "64", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--steps", "1",
                       "--warmup", "0", "--quiet", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["seq"], r["contender"]): r for r in doc["rows"]}
    assert set(rows) == {(s, c) for s in (64, 128) for c in bench.CONTENDERS}
    assert doc["key"] == ["seq", "contender"] and {"step_ms", "sent_mib", "act_mib"} <= set(doc["metrics"])
    for seq in (64, 128):
        kv_mib = 2 * 2 * (seq // 2) * 8 * 4 / 2**20  # one rank's K and V shards (2 heads, head size 8, float32)
        assert rows[(seq, bench.RING)]["sent_mib"] == pytest.approx(4 * kv_mib)
        assert rows[(seq, bench.ALLGATHER)]["sent_mib"] == pytest.approx(2 * kv_mib)
        assert rows[(seq, bench.NO_CP)]["sent_mib"] == 0
        assert rows[(seq, bench.RING)]["vs_no_cp_act"] < 0.6  # each rank saves its shard's share
        for row in (rows[(seq, c)] for c in bench.CONTENDERS):
            assert row["step_ms"] > 0 and row["max_diff"] < 1e-4


@pytest.mark.parametrize("argv, message", [(["--seq", "30"], "multiple of 2 x --cp = 4"),
                                          (["--cp", "1"], "needs >= 2 ranks"),
                                          (["--heads", "3"], "multiple of --kv-heads")])
def test_bad_options_are_refused(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
