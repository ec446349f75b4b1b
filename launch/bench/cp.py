"""`moe-bench cp`: context-parallel causal attention, ring vs all-gather-KV vs no CP, per sequence length.

Every contender runs the forward and backward of one causal GQA attention over the same sequence (the same
q, k, v and output grad, float32) in the same gloo processes, round-robin step by step so a shared machine's
load hits all alike (launch.bench.harness: rounds A B C, rotated):
- "no CP": the whole sequence on rank 0 alone through torch's scaled_dot_product_attention (the model's
  attention today); the other ranks wait;
- "ring" and "all-gather KV": moe.cp over all ranks, each holding its zig-zag shard (2 of 2 x cp chunks).
Per contender: step_ms, the median over rounds of the slowest rank, and its spread; sent_mib, bytes one rank sends
per step
(moe.cp's count: ring transfers as sent, the all-gather and its backward's reduce-scatter by the ring model);
act_mib, the peak bytes saved for backward on the busiest rank (pipeline.memory.SavedTensorMeter: inputs
and everything the backward keeps). moe.cp attends blocks in plain torch (scores materialised per block);
torch's SDPA is a fused kernel, so times compare our schedule plus unfused math against a fused whole.
Outputs are checked against the no-CP run (exit 1 if they differ).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from launch.bench.harness import Timing, fields, ratio_fields, require_positive, round_options, rounds, slowest
from launch.bench.progress import BenchProgress, run_ranks, worker_progress
from launch.bench.report import LOWER, emit, header
from moe.cp import cp_attention, zigzag_shard
from pipeline.memory import SavedTensorMeter

NO_CP, RING, ALLGATHER = "no CP", "ring", "all-gather KV"
CONTENDERS = (NO_CP, RING, ALLGATHER)


def _inputs(seq: int, opts: dict[str, Any]) -> list[Tensor]:
    g = torch.Generator().manual_seed(seq)
    b, hq, hkv, d = opts["batch"], opts["heads"], opts["kv_heads"], opts["head_dim"]
    return [torch.randn(shape, generator=g) for shape in ((b, hq, seq, d), (b, hkv, seq, d), (b, hkv, seq, d),
                                                          (b, hq, seq, d))]


def _sdpa(q: Tensor, k: Tensor, v: Tensor, traffic: dict[str, int]) -> Tensor:
    repeat = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                          is_causal=True)


def _step_fn(name: str, rank: int, world: int, tensors: list[Tensor]) -> Callable[[dict], Tensor | None]:
    """One forward and backward of contender name on this rank (None where the rank has no part)."""
    if name == NO_CP:
        if rank:
            return lambda traffic: None
        q, k, v, dout = tensors
        attend = _sdpa
    else:
        q, k, v, dout = (zigzag_shard(t, world, rank, dim=2) for t in tensors)
        method = "ring" if name == RING else "allgather"

        def attend(q: Tensor, k: Tensor, v: Tensor, traffic: dict[str, int]) -> Tensor:
            return cp_attention(method, q, k, v, dist.group.WORLD, traffic=traffic)

    def step(traffic: dict[str, int]) -> Tensor:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, traffic)
        out.backward(dout)
        return out.detach()

    return step


def worker(rank: int, world: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Measure every contender at every sequence length on this rank."""
    progress = worker_progress("cp", rank, opts)
    rows = []
    for seq in opts["seqs"]:
        tensors = _inputs(seq, opts)
        steps = {name: _step_fn(name, rank, world, tensors) for name in CONTENDERS}
        reference = _sdpa(*tensors[:3], {})  # every rank checks its own output against it
        figures: dict[str, dict[str, Any]] = {}
        for name, step in steps.items():
            meter, traffic = SavedTensorMeter(), {}
            with meter.hooks():
                out = step(traffic)
            diff = None
            if out is not None:
                mine = reference if name == NO_CP else zigzag_shard(reference, world, rank, dim=2)
                diff = (out - mine).abs().max().item()
            figures[name] = {"act_bytes": meter.peak, "sent_bytes": traffic.get("sent_bytes", 0), "diff": diff}
        timings = rounds({name: lambda step=step: _synced(step) for name, step in steps.items()}, opts["warmup"],
                         opts["steps"], opts["call_budget"], opts, f"step at seq {seq}", rotate=True,
                         progress=lambda line: progress(f"seq {seq}: {line}"))
        rows += [{"seq": seq, "contender": name, **f, "times": timings[name]["time"].samples}
                 for name, f in figures.items()]
    return rows


def _synced(step: Callable[[dict], Tensor | None]) -> None:
    """One step on every rank, from a barrier to a barrier: it ends when its slowest rank does."""
    dist.barrier()
    step({})
    dist.barrier()


def rows_from(results: list[list[dict[str, Any]]], world: int) -> list[dict[str, Any]]:
    """One row per (sequence length, contender): median step of the slowest rank and its spread, the busiest rank's
    bytes, ratios to no CP (time: round by round)."""
    rows, times = [], {}
    for per_rank in zip(*results):
        first = per_rank[0]
        diffs = [r["diff"] for r in per_rank if r["diff"] is not None]
        times[first["seq"], first["contender"]] = slowest([Timing(r["times"]) for r in per_rank])
        rows.append({"seq": first["seq"], "contender": first["contender"], "ranks": 1 if first["contender"] == NO_CP
                     else world, **fields("step_ms", times[first["seq"], first["contender"]]),
                     "sent_mib": max(r["sent_bytes"] for r in per_rank) / 2**20,
                     "act_mib": max(r["act_bytes"] for r in per_rank) / 2**20,
                     "max_diff": max(diffs) if diffs else None})
    for row in rows:
        base = next(r for r in rows if r["seq"] == row["seq"] and r["contender"] == NO_CP)
        row.update(ratio_fields("vs_no_cp_time", times[row["seq"], row["contender"]] / times[row["seq"], NO_CP]))
        row["vs_no_cp_act"] = row["act_mib"] / base["act_mib"]
    return rows


COLUMNS = [("seq", "seq", "d"), ("contender", "contender", ""), ("ranks", "ranks", "d"), ("step ms", "step_ms", ".1f"),
           ("spread", "step_ms_spread", ".2f"), ("x no CP", "vs_no_cp_time", ".2f"), ("sent MiB/rank", "sent_mib", ".2f"),
           ("act MiB/rank", "act_mib", ".1f"),
           ("x no CP", "vs_no_cp_act", ".2f"), ("max |diff|", "max_diff", ".1e")]


def main(argv: list[str] | None = None) -> int:
    """Parse options, run the benchmark, print the table, optionally write JSON."""
    p = argparse.ArgumentParser(prog="moe-bench cp", description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2, help="CP ranks (gloo processes)")
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192], help="sequence lengths (tokens)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="K/V heads (dividing --heads)")
    p.add_argument("--head-dim", type=int, default=64, help="head size")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |output - no CP| allowed (float32)")
    round_options(p, steps=3, warmup=1, budget_s=300.0, unit="step")
    args = p.parse_args(argv)
    require_positive(p, args, ("cp", "batch", "heads", "kv_heads", "head_dim", "steps"))
    if args.cp < 2:
        p.error(f"--cp {args.cp}: context parallelism needs >= 2 ranks")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    bad = [s for s in args.seq if s < 1 or s % (2 * args.cp)]
    if bad:
        p.error(f"--seq {bad}: each length must be a positive multiple of 2 x --cp = {2 * args.cp} (zig-zag chunks)")
    opts = {"seqs": args.seq, "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "steps": args.steps, "warmup": args.warmup, "call_budget": args.call_budget,
            "quiet": args.quiet}
    progress = BenchProgress("cp", enabled=not args.quiet)
    results = run_ranks(worker, args.cp, opts, "try shorter --seq or fewer --steps", progress=progress)
    rows = rows_from(results, args.cp)
    emit(header("cp", list(argv or []), notes=[__doc__]), rows, COLUMNS, args.json, key=["seq", "contender"],
         metrics={"step_ms": LOWER, "sent_mib": LOWER, "act_mib": LOWER}, left=2)
    wrong = [f"{r['contender']} at seq {r['seq']}" for r in rows if (r["max_diff"] or 0) > args.tolerance]
    if wrong:
        print(f"moe-bench cp: outputs differ from no CP: {', '.join(wrong)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
