"""`moe-bench pipeline` runs every schedule on a tiny model and writes the promised JSON fields."""

from __future__ import annotations

import json

import pytest

from launch.bench.pipeline import main

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

FIELDS = {"schedule", "world_size", "num_chunks", "step_ms", "idle_fraction", "peak_mem_bytes"}


@pytest.mark.timeout(300)
def test_bench_writes_a_row_per_schedule(tmp_path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert main(["--layers", "4", "--hidden", "32", "--batch", "16", "--chunks", "4", "--steps", "1",
                 "--warmup", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    names = [r["schedule"] for r in rows]
    assert names == ["1 process", "ours DualPipeV", "ours DualPipeV, W per chunk", "ours DualPipe", "ours 1F1B",
                     "ours AFAB", "torch DualPipeV", "torch ZBVZeroBubble", "torch 1F1B", "torch GPipe",
                     "torch Interleaved1F1B"]
    for r in rows:
        assert FIELDS <= set(r) and r["world_size"] == 2 and r["num_chunks"] == 4
        assert r["step_ms"] > 0 and len(r["idle_fraction"]) == 2 and r["peak_mem_bytes"] > 0
        if r["schedule"].startswith("ours"):  # measured wait next to the simulator's from measured costs
            for key in ("wait_fraction", "sim_wait_fraction", "sampled_wait_fraction", "median_wait_fraction"):
                assert len(r[key]) == 2 and all(0 <= x < 1 for x in r[key]), (key, r[key])
            assert len(r["sim_rel_diff"]) == 2
    assert "torch DualPipeV" in capsys.readouterr().out


def test_bench_rejects_a_batch_the_chunks_do_not_divide() -> None:
    with pytest.raises(SystemExit):
        main(["--batch", "10", "--chunks", "4"])
