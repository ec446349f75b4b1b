"""moe-bench optim on a tiny model: one row per contender with the JSON fields the issue names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.bench import optim as bench

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # slow: spawns processes (tests/conftest.py)


def test_rows_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "optim.json"
    assert bench.main(["--layers", "2", "--hidden", "32", "--steps", "2", "--warmup", "1",
                       "--adamw", "for-loop", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    names = ["zero1", "zero2", "zero3", bench.PEER, "fsdp2", "ddp_adamw"]
    assert [r["optimizer"] for r in rows] == names
    params = 2 * (32 * 32 + 32)
    for row in rows:
        assert row["world_size"] == 2 and row["step_ms"] > 0
    optimizer = {r["optimizer"]: r["optimizer_state_bytes"] / params for r in rows}
    for name in ("zero1", "zero2", "zero3"):
        assert optimizer[name] == pytest.approx(6, rel=0.01), name
    assert 6 <= optimizer[bench.PEER] < 12
    assert optimizer["ddp_adamw"] == pytest.approx(12, rel=0.01)
    # params + grads + AdamW state per param at 2 ranks: zero1 4 + (4 full + 2 reduced shard) + 4; zero2 frees the
    # full grads (a 2-byte receive row instead); zero3 holds a 2-byte master shard instead of the params; FSDP2
    # 2 + 2 + 4 (sharded grads, no receive row); DDP 4 + 4 + 8
    held = {r["optimizer"]: r["state_bytes"] / params for r in rows}
    for name, want in {"zero1": 14, "zero2": 12, "zero3": 10, "fsdp2": 8, "ddp_adamw": 16}.items():
        assert held[name] == pytest.approx(want, rel=0.01), name
    assert "zero_redundancy" in capsys.readouterr().out


def test_an_iteration_over_the_call_budget_stops_the_run_naming_the_contender(capsys) -> None:
    assert bench.main(["--layers", "1", "--hidden", "8", "--steps", "1", "--warmup", "0", "--call-budget", "1e-9",
                       "--quiet"]) == 3
    err = capsys.readouterr().err
    assert "stopped: contender 'zero1' training iteration was still running after the per-call budget of 1e-09 s" in err
    assert "raise --call-budget" in err
