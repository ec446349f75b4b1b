"""`moe-bench optim`: ZeroOptimizer at stages 1-3 against ZeroRedundancyOptimizer(AdamW), torch FSDP2 and DDP + AdamW.

Every optimizer trains its own copy of the same MLP in the same gloo processes, in fp32, with
the same AdamW implementation (--adamw, fused by default) and the same bucket cap; iterations
of all run in rounds (launch.bench.harness), in an order that rotates every round, so machine noise
and position effects hit them alike. step_ms is the median of a whole training iteration (opt_ms:
the part inside optimizer.step()), each with its spread; state bytes/rank is what a rank holds after an
iteration for params, grads and optimizer state (local shards); each contender runs in its best
configuration on gloo:
- zero1: forward; backward inside reduce_during_backward() (a bucket's reduce-scatter starts
  as soon as it is full); step: the rest of the reduce-scatter, AdamW on the local shard, the
  all-gather of the updated params into the model.
- zero2: the same, the full grad buckets freed once reduce-scattered (optim.zero_stage 2).
- zero3: also each Linear's params sharded, all-gathered before its forward (the next one prefetched) and
  backward, freed after; step gathers nothing (optim.zero3).
- fsdp2: torch's fully_shard on each Linear and the root (reshard after forward), AdamW on its DTensor shards.
- zero_redundancy: DDP forward and backward (all-reduce overlapped with backward,
  gradient_as_bucket_view); step: AdamW on its partition, then every owner broadcasts its
  params (parameters_as_bucket_view). Its overlap_with_ddp mode refuses gloo.
- ddp_adamw: the same DDP forward and backward, then AdamW on every param.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from launch.bench.harness import fields, ratio_fields, rounds, slowest
from launch.bench.progress import BenchProgress, BudgetExceeded, run_ranks, worker_progress
from launch.bench.report import LOWER, header, header_line, table, write_json
from optim.memory import local, model_state_bytes, optimizer_state_bytes
from optim.zero import COLLECTIVES, ZeroOptimizer

PEER = "zero_redundancy"
SHAPE = ("layers", "hidden", "batch")  # with world_size and the optimizer, what identifies a row


def _mlp(layers: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])


def _setups(layers: int, hidden: int, bucket_cap_mb: float, collectives: str,
            adamw: str) -> dict[str, tuple[nn.Module, Any]]:
    """Each contender: (module to call, optimizer), built on the same initial weights.

    All run the same AdamW implementation (adamw: "fused", "foreach" or "for-loop").
    """
    hyper = {"lr": 1e-4, "fused": adamw == "fused", "foreach": adamw == "foreach"}
    ours = {stage: _mlp(layers, hidden) for stage in (1, 2, 3)}
    zro, ddp = (DistributedDataParallel(_mlp(layers, hidden), bucket_cap_mb=bucket_cap_mb,
                                        gradient_as_bucket_view=True) for _ in range(2))
    fsdp = _mlp(layers, hidden)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for module in [*fsdp, fsdp]:
        fully_shard(module, mesh=mesh)
    groups = {1: ours[1].parameters(), 2: ours[2].parameters(),
              3: [{"params": list(linear.parameters()), "module": linear} for linear in ours[3]]}
    return {
        **{f"zero{stage}": (ours[stage], ZeroOptimizer(groups[stage], torch.optim.AdamW, bucket_cap_mb=bucket_cap_mb,
                                               collectives=collectives, stage=stage, **hyper)) for stage in ours},
        PEER: (zro, ZeroRedundancyOptimizer(zro.parameters(), torch.optim.AdamW,
                                            parameters_as_bucket_view=True, **hyper)),
        "fsdp2": (fsdp, torch.optim.AdamW(fsdp.parameters(), **hyper)),
        "ddp_adamw": (ddp, torch.optim.AdamW(ddp.parameters(), **hyper)),
    }


def state_bytes(model: nn.Module, opt: Any) -> int:
    """Bytes this rank holds for the model states: params, grads and optimizer state (local shards; ZeroOptimizer:
    optim.memory.model_state_bytes)."""
    params = list(model.parameters())
    if isinstance(opt, ZeroOptimizer):
        return sum(model_state_bytes(opt, params).values())
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    grads = [p.grad for p in params if p.grad is not None]
    return sum(local(t).nbytes for t in params + grads + state)


def _iteration(model: nn.Module, opt: Any, x: torch.Tensor) -> dict[str, float]:
    """One training iteration: seconds of the whole ("step") and of optimizer.step ("opt").

    ZeroOptimizer overlaps its gradient reduction with backward, as DDP does for the two peers.
    """
    start = time.perf_counter()
    opt.zero_grad()
    overlap = opt.reduce_during_backward() if isinstance(opt, ZeroOptimizer) else nullcontext()
    with overlap:
        model(x).square().mean().backward()
    mid = time.perf_counter()
    opt.step()
    end = time.perf_counter()
    return {"step": end - start, "opt": end - mid}


def _worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    setups = _setups(args["layers"], args["hidden"], args["bucket_cap_mb"], args["collectives"],
                     args["adamw"])
    x = torch.randn(args["batch"], args["hidden"], generator=torch.Generator().manual_seed(rank))
    timed = rounds({name: (lambda s=setup: _iteration(*s, x)) for name, setup in setups.items()}, args["warmup"],
                   args["steps"], args["call_budget"], args, "training iteration", rotate=True,
                   progress=worker_progress("optim", rank, args))
    return {name: {**times, "optimizer_state_bytes": optimizer_state_bytes(setups[name][1]),
                   "state_bytes": state_bytes(*setups[name])} for name, times in timed.items()}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Spawn the gloo processes, return one row per optimizer (max over ranks of the medians)."""
    per_rank = run_ranks(_worker, args.world_size, vars(args), "run a smaller model (--layers, --hidden) or raise "
                         "--call-budget", threads=args.threads, progress=BenchProgress("optim", not args.quiet))
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    rows = []
    for name in per_rank[0]:
        step, opt = (slowest([r[name][q] for r in per_rank]) for q in ("step", "opt"))
        rows.append({"optimizer": name, "world_size": args.world_size, **fields("step_ms", step),
                     **fields("opt_ms", opt),
                     "optimizer_state_bytes": max(r[name]["optimizer_state_bytes"] for r in per_rank),
                     "state_bytes": max(r[name]["state_bytes"] for r in per_rank),
                     "params": params, **{name: getattr(args, name) for name in SHAPE}, "_step": step})
        rows[-1]["bytes_per_param"] = rows[-1]["optimizer_state_bytes"] / params
    peer = next(r["_step"] for r in rows if r["optimizer"] == PEER)
    for row in rows:
        row.update(ratio_fields("vs_zero_redundancy", row.pop("_step") / peer))
    return rows


COLUMNS = [("optimizer", "optimizer", ""), ("world", "world_size", "d"), ("step_ms", "step_ms", ".1f"),
           ("spread", "step_ms_spread", ".0%"), ("opt_ms", "opt_ms", ".1f"), ("vs ZeRO-R", "vs_zero_redundancy", ".2f"),
           ("spread", "vs_zero_redundancy_spread", ".0%"),
           ("opt bytes/rank", "optimizer_state_bytes", ",d"), ("bytes/param", "bytes_per_param", ".2f"),
           ("state bytes/rank", "state_bytes", ",d")]


def main(argv: list[str] | None = None) -> int:
    """Parse options, run the benchmark, print the table, optionally write JSON."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="moe-bench optim", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo processes (2 or 4)")
    p.add_argument("--layers", type=int, default=8, help="Linear layers in the MLP")
    p.add_argument("--hidden", type=int, default=1024, help="Linear width")
    p.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=30, help="timed iterations per optimizer")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per optimizer")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="bucket cap of ZeroOptimizer and of the peers' DDP")
    p.add_argument("--adamw", choices=("fused", "foreach", "for-loop"), default="fused",
                   help="AdamW implementation, the same for all")
    p.add_argument("--collectives", choices=COLLECTIVES, default="auto",
                   help="ZeroOptimizer collectives (auto: p2p on gloo)")
    p.add_argument("--call-budget", type=float, default=60.0,
                   help="seconds one training iteration may take before the run stops naming it (0: no limit)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = p.parse_args(argv)
    for name in ("world_size", "layers", "hidden", "batch", "steps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    head = header("optim", argv)
    print(header_line(head))
    try:
        rows = run(args)
    except BudgetExceeded as err:
        print(f"moe-bench optim: stopped: {err}", file=sys.stderr)
        return 3
    print(f"optim benchmark: {args.layers} x Linear({args.hidden}, {args.hidden}), {args.batch} rows per rank, "
          f"{args.world_size} gloo processes x {args.threads} thread, AdamW {args.adamw}; {args.steps} rounds of "
          "all in turn: median of each round's slowest rank, spread = IQR / median, vs ZeRO-R taken round by "
          "round")
    print(table(rows, COLUMNS, left=1))
    if args.json:
        write_json(args.json, head, rows, ["optimizer", "world_size", *SHAPE], {"step_ms": LOWER, "opt_ms": LOWER})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
