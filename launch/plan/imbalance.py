"""Routing imbalance for moe-plan: per routed MoE layer, the rows the busiest EP rank's experts receive in one
exchange over the balanced share (1: the forced balance every published run was measured under, the planner's
default). Each all-to-all, and the grouped GEMMs after it, wait on their busiest rank, so the planner prices each MoE
layer there (launch.plan.compute.moe_block_seconds, launch.plan.planner._stage_cost).

Two sources: a run's measurement (`--loads RUN_DIR`: the mean over its metrics.jsonl records of the 'stragglers'
section's busiest_over_mean, launch.metrics.records.straggler_metrics, taken as measured, the run's own redundant
experts included) and a synthetic skew (`--imbalance zipf:S`: expert i of the E routed experts, i = 1..E, drawn with
probability proportional to i^-S, each token's top_k experts without replacement, one exchange's tokens, a fixed
seed; rows per EP rank under the default placement, expert e owned by rank e // (E / ep), and with
parallel.redundant_experts the spare slots placed for those loads as the trainer places them, moe.replicas.place).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from dispatch.synthetic import synthetic_routing
from launch.config.run import RunConfig
from moe.replicas import check_slots, place, rank_loads

MAX_TOKENS = 1 << 16  # a zipf exchange's tokens beyond this add no skew the planner could see, only cost
SEED = 0


def parse_zipf(spec: str) -> float:
    """S of `--imbalance zipf:S` (a finite S >= 0; 0: uniform popularity), or ValueError naming the flag."""
    kind, _, value = spec.partition(":")
    try:
        skew = float(value)
    except ValueError:
        skew = math.nan
    if kind != "zipf" or not math.isfinite(skew) or skew < 0:
        raise ValueError(f"--imbalance {spec!r} is not allowed: give zipf:S with a finite exponent S >= 0 "
                         f"(expert i drawn with probability ~ i^-S; e.g. zipf:1.2)")
    return skew


def zipf_loads(num_experts: int, top_k: int, skew: float, tokens: int) -> np.ndarray:
    """[E] rows each expert receives from `tokens` tokens whose top_k experts are drawn without replacement with
    probability ~ i^-skew (i = 1..E), from a fixed seed (the same figures on every call)."""
    indices, _ = synthetic_routing(tokens, num_experts, top_k, "skewed", skew=skew,
                                   generator=torch.Generator().manual_seed(SEED))
    return np.bincount(indices.reshape(-1).numpy(), minlength=num_experts).astype(np.float64)


def busiest_over_mean(loads: np.ndarray, ep: int, spares: int = 0, node_size: int = 0) -> float:
    """The busiest EP rank's rows over the mean for expert loads [E] under the default placement, with `spares`
    redundant slots per rank placed for those loads (moe.replicas.place; node_size: replicas kept on their
    owner's node)."""
    layout = check_slots(len(loads), ep, spares)
    rows = rank_loads(layout, place(layout, loads, node_size), loads)
    return float(rows.max() / rows.mean())


def zipf_imbalance(config: RunConfig, skew: float, tokens_per_rank: int) -> tuple[float, ...]:
    """The busiest-over-mean of every routed MoE layer (the same skew in each) for one exchange of tokens_per_rank
    tokens on each of the config's EP ranks, with its redundant experts placed as the trainer would (replicas on
    their owner's node under node-limited routing over nodes, as launch.train.build.replica_set keeps them)."""
    cfg, par = config.model, config.parallel
    layout = config.layout
    limited = cfg.topk_groups < cfg.num_groups and layout.ep_nodes() > 1
    tokens = min(tokens_per_rank * par.ep, MAX_TOKENS)
    ratio = busiest_over_mean(zipf_loads(cfg.num_experts, cfg.top_k, skew, tokens), par.ep,
                              par.redundant_experts, layout.ep_gpus_per_node() if limited else 0)
    return (ratio,) * cfg.num_routed_layers


def measured_imbalance(run_dir: str | Path, config: RunConfig) -> tuple[float, ...]:
    """Per routed MoE layer, the mean over run_dir's metrics.jsonl records of their 'stragglers' busiest_over_mean;
    ValueError naming --loads when the run has no such records or another EP size or MoE layer count than config."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"--loads {run_dir}: no metrics.jsonl there (give the run_dir of a moe-train run)")
    found = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash (JsonlWriter's readers skip it too)
        section = record.get("stragglers") if isinstance(record, dict) else None
        if section and section.get("busiest_over_mean"):
            found.append(section)
    if not found:
        raise ValueError(f"--loads {run_dir}: {path} holds no 'stragglers' records (written by moe-train runs with "
                         f"MoE layers since the straggler metrics; run the config to measure its loads)")
    ep, layers = found[0]["ep"], len(found[0]["busiest_over_mean"])
    if ep != config.parallel.ep or layers != config.model.num_routed_layers:
        raise ValueError(f"--loads {run_dir}: measured on EP{ep} over {layers} MoE layers, the config plans EP"
                         f"{config.parallel.ep} over {config.model.num_routed_layers}: measure the same EP size "
                         f"and model")
    return tuple(float(v) for v in np.mean([s["busiest_over_mean"] for s in found if s["ep"] == ep
                                            and len(s["busiest_over_mean"]) == layers], axis=0))
