"""moe-bench layer without the peers installed (as in CI): our rows at EP 1 and 2 (outputs checked against one
float64 process), each missing or failing peer's row says why, the JSON has the suite fields, bad options are
refused before anything starts; the check skips only the tokens whose top-k the dtype's rounding can flip."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from launch.bench import layer
import torch

from launch.bench.peers.fwdbwd import decided_tokens, relative_error, time_steps

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # slow: spawns processes (tests/conftest.py)
TINY = ["--hidden", "16", "--ffn", "16", "--experts", "4", "--top-k", "2", "--batch", "1", "--seq", "8",
        "--repeats", "2", "--warmup", "1", "--quiet"]


def _rows(path: Path) -> dict[tuple[str, int], dict]:
    doc = json.loads(path.read_text())
    assert set(doc) == {"header", "key", "metrics", "rows"} and doc["header"]["suite"] == "layer"
    assert doc["metrics"] == {"step_ms": "lower"} and doc["key"][:2] == ["contender", "ep"]
    return {(r["contender"], r["ep"]): r for r in doc["rows"]}


def test_our_rows_and_a_missing_peers_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(layer, "PEERS_HOME", tmp_path / "no-peers-here")
    out = tmp_path / "layer.json"
    assert layer.main([*TINY, "--ep", "1,2", "--rounds", "2", "--json", str(out)]) == 0
    rows = _rows(out)
    assert set(rows) == {(name, ep) for name in ("ours", "torchtitan", "megatron") for ep in (1, 2)}
    for ep, local in ((1, 4), (2, 2)):
        ours = rows["ours", ep]
        assert ours["status"] == "ok" and ours["step_ms"] > 0 and ours["step_ms_spread"] >= 0
        assert ours["max_rel_diff"] < 1e-5 and ours["tolerance"] == 1e-4
        assert ours["repeats"] == 4 and len(ours["round_medians_ms"]) == 2 and ours["vs_ours"] == 1.0
        assert ours["local_experts"] == local and (ours["hidden"], ours["experts"], ours["dtype"]) == (16, 4, "float32")
        for peer in ("torchtitan", "megatron"):
            row = rows[peer, ep]
            assert row["step_ms"] is None and row["vs_ours"] is None
            assert row["status"].startswith("not installed") and f"--peer-python {peer}=PYTHON" in row["status"]
    assert "not installed" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is not None, reason="torchtitan installed here")
def test_a_peer_that_cannot_run_says_why_in_its_row(tmp_path):
    """The peer script runs on both EP ranks in an interpreter without its library (ours), or in none."""
    out = tmp_path / "layer.json"
    assert layer.main([*TINY, "--ep", "2", "--rounds", "1", "--peer-python", f"torchtitan={sys.executable}",
                       "--peer-python", f"megatron={tmp_path / 'missing' / 'python'}", "--json", str(out)]) == 0
    rows = _rows(out)
    assert rows["ours", 2]["status"] == "ok"
    assert rows["torchtitan", 2]["status"] == "not importable: No module named 'torchtitan'"
    assert rows["megatron", 2]["status"].startswith(f"cannot run {tmp_path / 'missing' / 'python'}")


def test_a_step_over_the_call_budget_stops_the_run_naming_it(capsys):
    assert layer.main([*TINY, "--ep", "1", "--peers", "", "--call-budget", "1e-9"]) == 3
    assert "stopped: ours EP=1 forward+backward was still running after the per-call budget" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--ep", "3"], ["--ep", "0"], ["--peers", "deepspeed"], ["--repeats", "0"],
                                  ["--peer-python", "torchtitan"], ["--peer-python", "vllm=/usr/bin/python3"],
                                  ["--dtype", "float16"], ["--shape", "huge"], ["--top-k", "9"]])
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        layer.main(argv)
    assert stop.value.code == 2 and "moe-bench layer: error" in capsys.readouterr().err


def test_time_steps_times_repeats_after_warmup_with_a_barrier_before_each():
    calls, barriers = [], []
    seconds = time_steps(lambda: calls.append(1), warmup=2, repeats=3, barrier=lambda: barriers.append(1))
    assert len(seconds) == 3 and len(calls) == 5 and len(barriers) == 5 and all(s >= 0 for s in seconds)


def test_a_near_tie_at_the_kth_logit_is_skipped_in_bfloat16_and_checked_in_float32():
    logits = torch.tensor([[3.0, 2.0, 1.99999, 0.0], [3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    assert decided_tokens(logits, 2, torch.bfloat16).tolist() == [False, True]
    assert decided_tokens(logits, 2, torch.float32).tolist() == [True, True]
    assert decided_tokens(logits, 4, torch.bfloat16).tolist() == [True, True]  # all experts: nothing to flip


def test_a_bfloat16_router_picks_the_float64_top_k_on_every_decided_token():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4096, 128, generator=gen), torch.randn(8, 128, generator=gen) * 0.02
    x16, w16 = x.bfloat16(), w.bfloat16()
    exact = x16.double() @ w.double().T  # what write_weights routes: the dtype's inputs, fp32 weights, in float64
    picks = (x16 @ w16.T).float().topk(2, -1).indices.sort(-1).values  # logits rounded to bf16, as a bf16 router
    decided = decided_tokens(exact, 2, torch.bfloat16)
    agree = (picks == exact.topk(2, -1).indices.sort(-1).values).all(-1)
    assert agree[decided].all() and not agree.all()  # flips happen, and only on near ties
    assert 0.8 < decided.double().mean() < 1.0


def test_the_output_check_ignores_tokens_it_does_not_count():
    reference = torch.ones(1, 3, 2, dtype=torch.float64)
    out = reference.clone()
    out[0, 1] += 0.5
    assert relative_error(out, reference, torch.tensor([[True, False, True]])) == 0
    assert relative_error(out, reference, torch.tensor([[True, True, True]])) == 0.5
