"""The trainer's step record against an independent count of the routing indices of that step, on one
process and on the default 4-process layout (pp 2 DualPipeV x dp 2, EP 2 over 2 simulated nodes)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from launch.parallel.spawn import run_processes
from launch.config.run import load_config
from launch.metrics.records import decode_array
from launch.train.loop import train
from moe.model import MoETransformer

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"


def train_one_step_recording_routes(rank: int, world_size: int, run_dir: str, layout: list[str]) -> dict:
    """Train one step with every MoE layer's training-mode routing indices recorded on this rank."""
    routes: dict[int, list[np.ndarray]] = {}
    build = MoETransformer.__init__

    def keep(index: int):
        def hook(router, _inputs, out) -> None:
            if router.training:  # not the held-out evaluation
                routes.setdefault(index, []).append(out.indices.numpy().copy())
        return hook

    def build_and_hook(model: MoETransformer, cfg, *args) -> None:
        build(model, cfg, *args)
        for index, layer in enumerate(model.moe_layers()):
            layer.router.register_forward_hook(keep(index))

    MoETransformer.__init__ = build_and_hook
    try:
        cfg = load_config(CONFIG, ["train.steps=1", f"train.run_dir={run_dir}", "train.checkpoint_every=0",
                                   "train.eval_batches=0", "data.max_bytes=100000", *layout])
        records = train(cfg, progress=False)
    finally:
        MoETransformer.__init__ = build
    return {"records": records, "routes": {i: np.concatenate(r) for i, r in routes.items()}, "calls": routes,
            "experts": cfg.model.num_experts, "ep": cfg.parallel.ep, "top_k": cfg.model.top_k}


def check_record_against_routes(record: dict, routes: list[dict[int, np.ndarray]], experts: int) -> None:
    moe = record["moe"]
    load = decode_array(moe["load"])
    assert load.shape == (len(moe["dead"]), experts)
    for layer in range(load.shape[0]):
        chosen = np.concatenate([r[layer].reshape(-1) for r in routes if layer in r])
        counts = np.bincount(chosen[chosen >= 0], minlength=experts)
        assert load[layer].tolist() == counts.tolist(), layer
        mean = counts.mean()
        assert moe["max_over_mean"][layer] == pytest.approx(counts.max() / mean, abs=1e-4)
        assert moe["cv"][layer] == pytest.approx(math.sqrt(((counts - mean) ** 2).mean()) / mean, abs=1e-4)
        assert moe["dead"][layer] == int((counts == 0).sum())
        share = counts[counts > 0] / counts.sum()
        assert moe["entropy"][layer] == pytest.approx(-(share * np.log(share)).sum() / math.log(experts), abs=1e-4)
        assert moe["dropped"][layer] == int((chosen < 0).sum())
    assert record["dropped_tokens"] == sum(moe["dropped"])


def check_stragglers_against_routes(record: dict, results: list[dict]) -> None:
    """The "stragglers" section (and the per-rank table where present) against rows counted from every rank's
    routing indices, exchange by exchange: the ranks holding a layer form its EP group (one copy per position
    here), in rank order; the n-th call of a layer on each of them is one all-to-all."""
    experts, ep, k = results[0]["experts"], results[0]["ep"], results[0]["top_k"]
    section = record["stragglers"]
    rows = decode_array(section["rows"])
    assert section["ep"] == ep and rows.shape == (len(record["moe"]["dead"]), ep)
    table = decode_array(record["ranks"]["expert_rows"]) if "expert_rows" in record.get("ranks", {}) else None
    excess = 0.0
    for layer in range(rows.shape[0]):
        holders = [r for r, result in enumerate(results) if layer in result["calls"]]
        assert len(holders) == ep
        calls = [results[r]["calls"][layer] for r in holders]
        per_call = np.array([[sum(int(((c >= 0) & (c // (experts // ep) == j)).sum()) for c in exchange)
                              for j in range(ep)] for exchange in zip(*calls)])
        balanced = np.array([[c.shape[0] * k] for c in calls[0]])
        assert rows[layer].tolist() == per_call.sum(0).tolist(), layer
        assert section["busiest_over_mean"][layer] == pytest.approx((per_call / balanced).max(), abs=1e-4)
        excess += per_call.sum(0).max() - per_call.sum(0).mean()
        if table is not None:
            assert [table[r, layer] for r in holders] == per_call.sum(0).tolist()
            assert all(table[r, layer] == 0 for r in range(len(results)) if r not in holders)
    assert section["share"] > 0 if excess else section["share"] == 0


def test_single_process_record_matches_the_routing_indices(tmp_path):
    torch.manual_seed(0)
    layout = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none",
              "parallel.gpus_per_node=0", "parallel.dispatch_backend=flat"]
    result = train_one_step_recording_routes(0, 1, str(tmp_path), layout)
    check_record_against_routes(result["records"][0], [result["routes"]], result["experts"])
    check_stragglers_against_routes(result["records"][0], [result])


def test_four_process_ep_record_matches_every_ranks_routing_indices(tmp_path):
    results = run_processes(train_one_step_recording_routes, 4, str(tmp_path), [], timeout_s=300)
    record = results[0]["records"][0]
    check_record_against_routes(record, [r["routes"] for r in results], results[0]["experts"])
    check_stragglers_against_routes(record, results)
    assert len(record["ranks"]["peak_memory_bytes"]) == 4 and all(m > 0 for m in record["ranks"]["peak_memory_bytes"])
    traffic = record["traffic"]
    assert decode_array(traffic["rank_bytes"]).shape == (2, 2) and traffic["inter_node_bytes"] > 0
