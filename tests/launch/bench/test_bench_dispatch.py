"""`moe-bench dispatch` at a tiny size: every row in the JSON, its bytes equal a naive per-token count for all four
dispatches (one-hot, per-expert, flat, hierarchical), every contender passes the correctness check."""

from __future__ import annotations

import json
import math

import pytest
import torch

from launch.bench.dispatch import main
from dispatch.synthetic import synthetic_routing

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

WORLD, GPN, TOKENS, HIDDEN, EXPERTS, TOP_K, SEED = 4, 2, 48, 256, 8, 3, 7
ROW = {"bf16": HIDDEN * 2, "fp8": HIDDEN + 4 * math.ceil(HIDDEN / 128)}
META, COUNT = TOP_K * 8, 8  # per row: fp32 weight + int32 id per slot; per peer and hop: one int64 row count
KEYS = {"backend", "payload", "dispatch_ms", "combine_ms", "algbw_gbps", "inter_node_bytes", "intra_node_bytes",
        "calc_diff", "correct"}
BACKENDS = ("one-hot", "per-expert", "flat", "hierarchical")


def _routing(rank: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(SEED + rank)
    return synthetic_routing(TOKENS, EXPERTS, TOP_K, "uniform", generator=gen)[0].tolist()


def _owner(expert: int) -> int:
    return expert // (EXPERTS // WORLD)


def _node(rank: int) -> int:
    return rank // GPN


def _where(src: int, dst: int) -> str:
    return "inter" if _node(src) != _node(dst) else "intra"


def naive_bytes(backend: str, payload: str) -> dict[str, int]:
    """Summed over ranks: dispatch parts and combine totals, counted token by token."""
    out = dict.fromkeys(("inter_payload", "inter_meta", "intra_payload", "intra_meta", "comb_inter", "comb_intra"), 0)

    def send(src: int, dst: int) -> None:
        where = _where(src, dst)
        out[f"{where}_payload"] += ROW[payload]
        out[f"{where}_meta"] += META
        out[f"comb_{where}"] += HIDDEN * 2  # the row comes back in x's dtype (bf16)

    routings = [_routing(r) for r in range(WORLD)]
    if backend == "one-hot":
        rows = math.ceil(TOKENS * TOP_K / EXPERTS) * EXPERTS // WORLD  # capacity factor 1
        for src in range(WORLD):
            for dst in set(range(WORLD)) - {src}:
                out[f"{_where(src, dst)}_payload"] += rows * ROW[payload]
                out[f"comb_{_where(src, dst)}"] += rows * HIDDEN * 2
        return out
    if backend == "per-expert":  # a row per routed expert, however many share a rank; no routing metadata
        for src in range(WORLD):
            for experts in routings[src]:
                for e in experts:
                    if e >= 0 and _owner(e) != src:
                        out[f"{_where(src, _owner(e))}_payload"] += ROW[payload]
                        out[f"comb_{_where(src, _owner(e))}"] += HIDDEN * 2
            for dst in set(range(WORLD)) - {src}:  # E_local int64 counts to every peer
                out[f"{_where(src, dst)}_meta"] += EXPERTS // WORLD * COUNT
        return out
    for src in range(WORLD):
        for experts in routings[src]:
            owners = {_owner(e) for e in experts}
            if backend == "flat":
                for dst in owners - {src}:
                    send(src, dst)
                continue
            for node in {_node(o) for o in owners}:
                entry = node * GPN + src % GPN  # same local index on the destination node
                if entry != src:
                    send(src, entry)
                for dst in {o for o in owners if _node(o) == node} - {entry}:
                    send(entry, dst)
    remote_peers = WORLD - GPN if backend == "flat" else WORLD // GPN - 1  # hierarchical: one per other node
    out["inter_meta"] += WORLD * COUNT * remote_peers  # each rank tells every peer of every hop its row count
    out["intra_meta"] += WORLD * COUNT * (GPN - 1)
    return out


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    path = tmp_path_factory.mktemp("bench") / "rows.json"
    assert main(["--nproc", str(WORLD), "--gpus-per-node", str(GPN), "--tokens", str(TOKENS), "--hidden", str(HIDDEN),
                 "--experts", str(EXPERTS), "--top-k", str(TOP_K), "--routing", "uniform", "--seed", str(SEED),
                 "--repeats", "2", "--warmup", "0", "--comm", "gloo", "--inter-node-gbps", "50",
                 "--intra-node-gbps", "160", "--predict-v3", "--v3-tokens", "16", "--quiet", "--json", str(path)]) == 0
    return json.loads(path.read_text())["rows"]


def test_every_contender_has_a_correct_row_with_the_required_keys_and_positive_times(rows):
    measured = [r for r in rows if r["section"] == "measured"]
    assert sorted((r["backend"], r["payload"]) for r in measured) == sorted(
        (b, p) for b in BACKENDS for p in ("bf16", "fp8"))
    for r in measured:
        assert KEYS <= set(r)
        assert r["dispatch_ms"] > 0 and r["combine_ms"] > 0 and r["algbw_gbps"] > 0
        assert r["projected_dispatch_ms"] > 0 and r["bytes_match_prediction"] is True
        assert r["correct"] is True and 0 <= r["calc_diff"] < (1e-4 if r["payload"] == "bf16" else 2e-3)


def test_bytes_equal_a_naive_per_token_count(rows):
    for r in (r for r in rows if r["section"] == "measured"):
        want = naive_bytes(r["backend"], r["payload"])
        for part in ("inter_payload", "inter_meta", "intra_payload", "intra_meta"):
            assert r[f"{part}_bytes"] == want[part], (r["backend"], r["payload"], part)
        assert r["inter_node_bytes"] == want["inter_payload"] + want["inter_meta"]
        assert r["intra_node_bytes"] == want["intra_payload"] + want["intra_meta"]
        combine = (r["combine_inter_node_bytes"], r["combine_intra_node_bytes"])
        assert combine == (want["comb_inter"], want["comb_intra"])


def test_algbw_counts_received_token_rows_once_per_destination_rank(rows):
    received = sum(len({_owner(e) for e in experts}) for r in range(WORLD) for experts in _routing(r))
    for r in (r for r in rows if r["section"] == "measured"):
        want = received / WORLD * HIDDEN * 2 / 1e9 / (r["dispatch_ms"] / 1e3)
        assert r["algbw_gbps"] == pytest.approx(want, rel=1e-9)


def test_v3_prediction_keeps_hierarchical_tokens_within_four_nodes(rows):
    v3 = [r for r in rows if r["section"] == "predicted_v3"]
    assert len(v3) == 4
    assert max(r["max_inter_node_copies"] for r in v3 if r["backend"] == "hierarchical") <= 4
    assert min(r["max_inter_node_copies"] for r in v3 if r["backend"] == "flat") > 4


def test_bad_options_are_refused_before_launching():
    with pytest.raises(SystemExit):
        main(["--nproc", "4", "--gpus-per-node", "3"])
    with pytest.raises(SystemExit):
        main(["--inter-node-gbps", "50"])


def test_a_bad_sweep_is_refused_naming_the_sweepable_options():
    with pytest.raises(SystemExit):
        main(["--sweep", "tokenz=8,16"])
    with pytest.raises(SystemExit):
        main(["--sweep", "tokens=8,"])


def test_a_call_over_the_budget_stops_the_run_naming_the_contender(capsys):
    assert main(["--nproc", "2", "--gpus-per-node", "1", "--tokens", "8", "--hidden", "128", "--experts", "4",
                 "--top-k", "2", "--warmup", "0", "--repeats", "1", "--comm", "gloo", "--call-budget", "1e-6",
                 "--quiet"]) == 3
    err = capsys.readouterr().err
    assert "stopped: contender 'one-hot bf16' dispatch was still running after the per-call budget of 1e-06 s" in err
    assert "raise --call-budget" in err
