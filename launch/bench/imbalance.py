"""`moe-bench imbalance`: one skewed routing on EP gloo ranks with 0, 1 and 2 redundant experts per rank, side by side.

Every rank routes its own tokens to the experts (default 32, top-2), each token's experts drawn without replacement
with probability ~ i^-S (i = 1..E; --skew, default 1.2; dispatch.synthetic's "skewed" routing, seeded by rank), so
the popular experts sit where the default placement puts them (expert e on rank e // (E / ep)) and the first rank
is the straggler. Each contender is our MoELayer over EP (dispatch.EPDispatcher) with R spare slots per rank
(moe.replicas) placed for the loads of the whole routing, as the trainer's re-placement does after a window of such
steps; the router's choice is replaced by that fixed routing (its forced-routing branch), so the contenders differ
by their placement only and compute the same outputs. A contender's step: forward, backward of a fixed output
grad, and with spares the replicas' grads folded into their owners and the owners' weights refreshed into the
replicas (the exchanges a training step adds for them). Contenders run in rounds (launch.bench.harness, rotated, a
barrier before each call); a round's time is its slowest rank's. Columns: the busiest rank's rows over the mean as
the dispatch delivered them (measured) and as launch.plan.imbalance predicts them for this routing (moe-plan
--imbalance prices it so), the median step with its spread, and the speedup over R = 0 taken round by round.
"""

from __future__ import annotations

import argparse
import copy
import sys
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dispatch import EPDispatcher
from dispatch.synthetic import synthetic_routing
from launch.bench.dispatch_worker import timed
from launch.bench.harness import (
    fields,
    ratio_fields,
    require_positive,
    round_options,
    rounds,
    slowest,
)
from launch.bench.layer import model_config
from launch.bench.peers.fwdbwd import inputs
from launch.bench.progress import BenchProgress, run_ranks, worker_progress
from launch.bench.report import LOWER, emit, header
from launch.plan.imbalance import busiest_over_mean
from moe.layer import MoELayer
from moe.replicas import ExpertReplicas, check_slots

COLUMNS = [("R", "spares", "d"), ("busiest/mean", "busiest_over_mean", ".3f"),
           ("planned", "planned_busiest_over_mean", ".3f"), ("busiest rows", "busiest_rows", "d"),
           ("step ms", "step_ms", ".1f"), ("spread", "step_ms_spread", ".0%"), ("x R=0", "speedup", ".2f"),
           ("spread", "speedup_spread", ".0%"), ("max |out - R=0|", "max_out_diff", ".1e")]


def rank_indices(opts: dict[str, Any], rank: int) -> torch.Tensor:
    """Rank's [tokens, top_k] skewed routing, seeded by opts["seed"] + rank (any process can rebuild it)."""
    return synthetic_routing(opts["batch"] * opts["seq"], opts["experts"], opts["top_k"], "skewed", skew=opts["skew"],
                             generator=torch.Generator().manual_seed(opts["seed"] + rank))[0]


def expert_loads(opts: dict[str, Any], world: int) -> np.ndarray:
    """[E] rows each expert receives from every rank's routing."""
    ids = torch.cat([rank_indices(opts, r).reshape(-1) for r in range(world)])
    return np.bincount(ids.numpy(), minlength=opts["experts"]).astype(np.float64)


def contender(base: MoELayer, spares: int, rank: int, world: int, routing: torch.Tensor,
              loads: np.ndarray) -> MoELayer:
    """A copy of base over EP with `spares` redundant slots per rank placed for loads, routing this rank's tokens
    as `routing` says (the router's forced branch, moe.router.TopKRouter._balanced, returns it)."""
    layer = copy.deepcopy(base)
    layout = check_slots(base.router.num_experts, world, spares)
    replicas = ExpertReplicas(layout, rank, dist.group.WORLD) if spares else None
    layer.to_expert_parallel(EPDispatcher(layout.num_slots), replicas)
    if replicas is not None:
        layer.attach_replicas()
        layer.replace_replicas(loads)
    layer.router.force_balance = True
    layer.router._balanced = lambda tokens, device: routing.to(device)
    return layer


def step(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One step of a contender: forward, backward of dy, the replicas' grads folded and weights refreshed.
    Returns (output, rows this rank's experts received)."""
    layer.zero_grad(set_to_none=True)
    out, stats = layer(x.detach().requires_grad_())
    out.backward(dy)
    owned = [layer.experts.w_gate_up, layer.experts.w_down]
    if layer.replicas is not None:
        layer.replicas.fold_grads([w.grad for w in owned])
        layer.replicas.refresh(owned)
    return out.detach(), int(stats.recv_rows)


def bench_worker(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Per contender: this rank's step seconds per timed round, the rows its experts received, and the largest
    difference of its output from R = 0's."""
    torch.manual_seed(opts["seed"])
    base = MoELayer(model_config(opts))
    loads = expert_loads(opts, world)
    x, dy = inputs(opts, rank)
    layers = {r: contender(base, r, rank, world, rank_indices(opts, rank), loads) for r in opts["spares"]}
    last: dict[int, tuple[torch.Tensor, int]] = {}
    progress = worker_progress("imbalance", rank, opts)

    def call(spares: int) -> float:
        last[spares], seconds = timed(step, torch.device("cpu"), layers[spares], x, dy)
        return seconds

    seconds = rounds({f"R={r}": partial(call, r) for r in layers}, opts["warmup"], opts["steps"],
                     opts["call_budget"], opts, what="step", rotate=True, progress=progress)
    first = last[opts["spares"][0]][0]
    return {"seconds": {r: seconds[f"R={r}"]["time"] for r in layers}, "rows": {r: last[r][1] for r in layers},
            "diff": {r: (last[r][0] - first).abs().max().item() for r in layers}}


def summarise(results: list[dict[str, Any]], opts: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per R: measured and planned busiest/mean, the slowest rank's step, the speedup over the first R."""
    world, loads = len(results), expert_loads(opts, len(results))
    timings = {r: slowest([res["seconds"][r] for res in results]) for r in opts["spares"]}
    base = timings[opts["spares"][0]]
    rows = []
    for r in opts["spares"]:
        got = np.array([res["rows"][r] for res in results], dtype=np.float64)
        rows.append({"spares": r, "busiest_over_mean": got.max() / got.mean(), "busiest_rows": int(got.max()),
                     "planned_busiest_over_mean": busiest_over_mean(loads, world, r),
                     **fields("step_ms", timings[r]), **ratio_fields("speedup", base / timings[r]),
                     "max_out_diff": max(res["diff"][r] for res in results), "ranks": world,
                     **{k: opts[k] for k in ("experts", "top_k", "skew", "hidden", "ffn", "dtype")},
                     "tokens_per_rank": opts["batch"] * opts["seq"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the contenders in rounds on --ranks gloo processes; print the table (and write --json)."""
    p = argparse.ArgumentParser(prog="moe-bench imbalance", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="EP ranks (gloo processes, one thread each; default 4)")
    p.add_argument("--experts", type=int, default=32, help="routed experts (default 32)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--skew", type=float, default=1.2, help="Zipf exponent S: expert i drawn ~ i^-S (default 1.2)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank (default 2048)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--ffn", type=int, default=128, help="expert FFN size (default 128)")
    p.add_argument("--spares", type=int, nargs="+", default=[0, 1, 2],
                   help="redundant experts per rank, one contender each; the first is the speedups' base "
                        "(default 0 1 2)")
    p.add_argument("--seed", type=int, default=0)
    round_options(p, steps=5, warmup=2, budget_s=120.0, unit="step")
    args = p.parse_args(argv)
    require_positive(p, args, ("ranks", "experts", "top_k", "tokens", "hidden", "ffn", "steps"))
    if args.skew < 0 or args.warmup < 0:
        p.error(f"--skew = {args.skew} and --warmup = {args.warmup} must be >= 0")
    for spares in args.spares:
        try:
            check_slots(args.experts, args.ranks, spares)
        except ValueError as error:
            p.error(f"--spares {spares}: {error}")
    opts = {"experts": args.experts, "top_k": args.top_k, "skew": args.skew, "batch": 1, "seq": args.tokens,
            "hidden": args.hidden, "ffn": args.ffn, "dtype": "float32", "seed": args.seed, "spares": args.spares,
            "steps": args.steps, "warmup": args.warmup, "call_budget": args.call_budget, "quiet": args.quiet}
    progress = BenchProgress("imbalance", not args.quiet)
    results = run_ranks(bench_worker, args.ranks, opts, "lower --tokens or --hidden, or raise --call-budget",
                        progress=progress)
    rows = summarise(results, opts)
    head = header("imbalance", list(sys.argv[2:] if argv is None else argv),
                  [(f"{args.ranks} EP gloo ranks x {args.tokens} tokens, {args.experts} experts top-{args.top_k}, "
                    f"p_i ~ i^-{args.skew:g}; float32, one thread per rank; {args.steps} timed rounds after "
                    f"{args.warmup} (rotated), slowest rank per round, spread = IQR / median")])
    print(head["notes"][0])
    emit(head, rows, COLUMNS, args.json, key=["spares", "ranks", "experts", "top_k", "skew", "tokens_per_rank"],
         metrics={"step_ms": LOWER, "busiest_over_mean": LOWER})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
