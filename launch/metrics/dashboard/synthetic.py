"""Synthetic schema-2 metrics of a DeepSeek-V3-shaped run, for the dashboard's scale check.

`python -m launch.metrics.dashboard.synthetic RUN_DIR [--steps 20000] [--every 1]` writes RUN_DIR/metrics.jsonl
(~250 kB a step at 58 MoE layers x 256 experts, EP64, 2048 ranks: a 20,000-step run is ~5 GB).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from launch.metrics.records import (JsonlWriter, moe_layer_metrics, rank_metrics, step_record, straggler_metrics,
                                    traffic_metrics)


@dataclass
class SyntheticShape:
    """The run's shape (defaults: DeepSeek-V3: 61 layers, 3 dense, 256 experts top-8, EP64 on 8-GPU nodes)."""

    steps: int = 20_000
    num_layers: int = 61
    first_k_dense: int = 3
    num_experts: int = 256
    top_k: int = 8
    tokens_per_step: int = 15_728_640
    ep: int = 64
    gpus_per_node: int = 8
    world: int = 2048
    bias_rate: float = 0.001


def synthetic_records(shape: SyntheticShape, seed: int = 0, every: int = 1) -> Iterator[dict]:
    """Records of every `every`-th step; per-expert loads start skewed (a few dead experts) and balance
    through the bias updates."""
    rng = np.random.default_rng(seed)
    layers = shape.num_layers - shape.first_k_dense
    skew = rng.normal(0.0, 1.0, (layers, shape.num_experts))
    skew[rng.random(skew.shape) < 0.01] = -40.0  # experts the router starts by ignoring: dead at first
    bias = np.zeros((layers, shape.num_experts))
    slots = shape.tokens_per_step * shape.top_k
    traffic_base = rng.random((shape.ep, shape.ep)) * 4e9
    memory = 60e9 + rng.random(shape.world) * 10e9
    for step in range(0, shape.steps, every):
        logits = skew * math.exp(-step / (0.2 * shape.steps)) + bias * 30 + rng.normal(0, 0.05, skew.shape)
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))
        share = weights / weights.sum(axis=1, keepdims=True)
        loads = np.floor(share * slots).astype(np.int64)
        push = np.sign(loads - loads.mean(axis=1, keepdims=True))
        bias -= shape.bias_rate * min(every, 10) * (push - push.mean(axis=1, keepdims=True))  # zero-mean updates
        progress = step / max(shape.steps - 1, 1)
        rows = loads.reshape(layers, shape.ep, -1).sum(axis=2)  # rows each EP rank's contiguous expert block gets
        losses = [{"seq_balance": float(1.0 + (share[i] ** 2).sum() * 0.1)} for i in range(layers)]
        yield step_record(
            step,
            {"loss": 2.0 + 9.0 * math.exp(-6 * progress), "lm_loss": 2.0 + 9.0 * math.exp(-6 * progress),
             "lr": 2.2e-4 * min(1.0, step / 2000) * (0.5 + 0.5 * math.cos(math.pi * progress)),
             "grad_norm": 0.3 + 2.0 * math.exp(-10 * progress) + 0.05 * rng.random(),
             "tokens_per_s": 3.5e6 * (1 + 0.02 * rng.normal()), "mfu": 0.39 * (1 + 0.02 * rng.normal())},
            moe_layer_metrics(loads, bias, [0] * layers, losses),
            traffic_metrics((traffic_base * (1 + 0.1 * rng.random())).astype(np.int64), shape.gpus_per_node),
            straggler_metrics(rows, rows.max(axis=1) / rows.mean(axis=1) * 1.1, 18.0 * 7168 * 2048,  # 18 h F a row
                              shape.tokens_per_step * 6 * 37e9 / shape.world),  # 6 FLOPs per active parameter
            rank_metrics(memory.astype(np.int64), rng.random(shape.world) * 0.1))


def main(argv: list[str] | None = None) -> int:
    """Write a synthetic run directory."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=SyntheticShape.steps)
    parser.add_argument("--every", type=int, default=1, help="write every N-th step only (default 1)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        parser.error(f"--steps = {args.steps} and --every = {args.every} must be >= 1")
    writer = JsonlWriter(f"{args.run_dir}/metrics.jsonl")
    for record in synthetic_records(SyntheticShape(steps=args.steps), every=args.every):
        writer.write(record)
    writer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
