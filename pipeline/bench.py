"""`moe-bench pipeline`: our DualPipeV/DualPipe against torch.distributed.pipelining, side by side.

Every schedule runs the same model weights and micro-batches in the same spawned processes (gloo,
one thread each), round-robin step by step so load changes on a shared machine hit all alike.
Per schedule it reports the median step time, each rank's measured idle fraction ((step time -
time inside compute actions) / step time), for our schedules also the waiting fraction (step time
not spent computing nor issuing sends/receives) next to the simulator's idle fraction fed with the
measured mean occupied time of F, B, W, F&B actions and the p2p latency ("sim wait") or replaying
each step with every action's measured occupied time ("replay"), and peak memory, measured in one extra
untimed step as the peak bytes of distinct storages saved for backward (saved-tensor hooks) plus,
for our runtime, the bytes that queued weight-grad closures keep alive until their W action.
`--ep-overlap` instead measures the EP overlap switch (see _ep_overlap_worker).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from dispatch.multiproc import run_processes
from pipeline import schedules
from pipeline.bench_models import build_layers
from pipeline.bench_runners import (OURS, TORCH, Runner, occupied_costs, occupied_durations, our_runner,
                                    single_process, torch_runner, waiting_fraction)
from pipeline.memory import SavedTensorMeter
from pipeline.p2p import Channel
from pipeline.simulator import Costs, simulate

COST_KEYS = ("F", "B", "Bs", "W", "FB")


def p2p_latency(rank: int, shape: tuple[int, ...], rounds: int = 40) -> float:
    """Median one-way seconds of one boundary message between ranks 0 and 1 (receive posted
    ahead, as in the runtime), shared with every rank."""
    ch = Channel(dist.group.WORLD, torch.device("cpu"))
    msg = [torch.randn(shape)]
    rtts = []
    if rank < 2:
        peer = 1 - rank
        for _ in range(rounds):
            ticket = ch.post_recv(peer, 0)
            t0 = time.perf_counter()
            if rank == 0:
                ch.send(msg, peer, 0)
                ch.finish_recv(ticket, peer, 0)
            else:
                ch.finish_recv(ticket, peer, 0)
                ch.send(msg, peer, 0)
            rtts.append(time.perf_counter() - t0)
            ch.wait_sends()
    latency = torch.tensor([statistics.median(rtts) / 2 if rank == 0 else 0.0], dtype=torch.float64)
    dist.all_reduce(latency)
    return float(latency)


def _data(opts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(opts["batch"], opts["hidden"], generator=g),
            torch.randn(opts["batch"], opts["hidden"], generator=g))


def _time_round_robin(runners: dict[str, Runner], opts: dict) -> dict[str, dict]:
    """Step every runner in turn, warmup + steps times, then once more under the memory meter."""
    x, target = _data(opts)
    stats = {name: {"step_s": [], "idle": [], "wait": [], "replay": [], "peak": 0,
                    "costs": torch.zeros(2 * len(COST_KEYS), dtype=torch.float64)} for name in runners}
    for i in range(opts["warmup"] + opts["steps"] + 1):
        for name, run in runners.items():
            for m in run.modules:
                m.zero_grad(set_to_none=True)
            st = stats[name]
            if i == opts["warmup"] + opts["steps"]:
                meter = SavedTensorMeter(run.extra_bytes)
                with meter.hooks():
                    run.step(x, target)
                st["peak"] = meter.peak
                continue
            compute0 = run.compute_seconds() if run.pipe is None else 0.0
            dist.barrier()
            t0 = time.perf_counter()
            run.step(x, target)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= opts["warmup"]:
                st["step_s"].append(float(elapsed))
                st["idle"].append(1 - (run.compute_seconds() - compute0) / float(elapsed))
                if run.pipe is not None:
                    st["costs"] += torch.tensor(occupied_costs(run.pipe), dtype=torch.float64)
                    st["wait"].append(waiting_fraction(run.pipe, float(elapsed)))
                    st["replay"].append(replayed_idle(run.pipe, opts["chunks"]))
    return stats


def _bench_worker(rank: int, world: int, opts: dict) -> list[dict]:
    layers = build_layers(opts["model"], opts["layers"], opts["hidden"])
    latency = p2p_latency(rank, (opts["batch"] // opts["chunks"], opts["hidden"]))
    runners = {}
    for name in opts["schedules"]:
        if name == "1 process":
            runners[name] = single_process(rank, layers, opts["chunks"])
        elif name in OURS:
            runners[name] = our_runner(name, rank, world, layers, opts["chunks"], opts)
        else:
            runners[name] = torch_runner(name, rank, world, layers, opts["chunks"])
    rows = []
    for name, st in _time_round_robin(runners, opts).items():
        row = {"schedule": name, "rank": rank, "step_s": st["step_s"], "idle": statistics.median(st["idle"]),
               "peak": st["peak"], "p2p_s": latency}
        pipe = runners[name].pipe
        if pipe is not None:
            dist.all_reduce(st["costs"])
            row["wait"] = statistics.median(st["wait"])
            row["replay_wait"] = statistics.median(st["replay"])
            row["sim_wait"] = simulated_idle(pipe, opts["chunks"], st["costs"].tolist(), rank, latency)
        rows.append(row)
    return rows


def replayed_idle(pipe, chunks: int) -> float:
    """Idle fraction of this rank when the simulator replays the step just run with every rank's
    measured occupied time per action (no p2p cost)."""
    durations = [None] * pipe.num_ranks
    dist.all_gather_object(durations, occupied_durations(pipe), group=pipe.group)
    table = {(r, act): seconds for r, per_rank in enumerate(durations) for act, seconds in per_rank}
    sched = schedules.build(pipe.schedule_name, pipe.num_ranks, chunks, split_bw=pipe.split_bw)
    result = simulate(sched, Costs(0.0, 0.0), table)
    return 1 - result.busy[pipe.rank] / result.makespan


def simulated_idle(pipe, chunks: int, sums: list[float], rank: int, p2p: float) -> float:
    """Idle fraction the simulator predicts for this rank from the measured mean occupied time of
    each action kind and the measured p2p latency."""
    mean = {k: (sums[2 * i] / sums[2 * i + 1] if sums[2 * i + 1] else 0.0) for i, k in enumerate(COST_KEYS)}
    w = mean["W"] if mean["Bs"] else 0.0
    full_b = mean["B"] if mean["B"] else mean["Bs"] + w
    sched = schedules.build(pipe.schedule_name, pipe.num_ranks, chunks, split_bw=pipe.split_bw)
    return simulate(sched, Costs(mean["F"], full_b, w, mean["FB"] or None, p2p)).idle_fractions[rank]


def summarise(results: list[list[dict]], opts: dict) -> list[dict]:
    """One row per schedule: median step ms, per-rank idle, simulator idle, peak memory."""
    rows = []
    for per_rank in zip(*results):
        row = {"schedule": per_rank[0]["schedule"], "world_size": opts["world"], "num_chunks": opts["chunks"],
               "step_ms": 1e3 * statistics.median(per_rank[0]["step_s"]),
               "idle_fraction": [round(r["idle"], 4) for r in per_rank],
               "peak_mem_bytes": max(r["peak"] for r in per_rank)}
        if "sim_wait" in per_rank[0]:
            row["wait_fraction"] = [round(r["wait"], 4) for r in per_rank]
            row["sim_wait_fraction"] = [round(r["sim_wait"], 4) for r in per_rank]
            row["replay_wait_fraction"] = [round(r["replay_wait"], 4) for r in per_rank]
        rows.append(row)
    ref = next((r["step_ms"] for r in rows if r["schedule"] == "torch DualPipeV"), None)
    for r in rows:
        r["vs_torch_dualpipev"] = round(r["step_ms"] / ref, 3) if ref else None
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width table."""
    def per_rank(row: dict, key: str) -> str:
        return " ".join(f"{x:.2f}" for x in row.get(key, [])) or "-"

    lines = [f"{'schedule':32} {'step ms':>8} {'x torch DPV':>11} {'idle/rank':>20} {'wait/rank':>10} "
             f"{'sim wait':>10} {'replay':>10} {'peak MiB':>9}"]
    for r in rows:
        ratio = f"{r['vs_torch_dualpipev']:.2f}" if r.get("vs_torch_dualpipev") else "-"
        lines.append(f"{r['schedule']:32} {r['step_ms']:8.1f} {ratio:>11} {per_rank(r, 'idle_fraction'):>20} "
                     f"{per_rank(r, 'wait_fraction'):>10} {per_rank(r, 'sim_wait_fraction'):>10} "
                     f"{per_rank(r, 'replay_wait_fraction'):>10} "
                     f"{r['peak_mem_bytes'] / 2**20:9.2f}")
    return "\n".join(lines)


def _ep_overlap_worker(rank: int, world: int, opts: dict) -> list[dict]:
    """Each rank runs its own 1-rank DualPipeV whose blocks exchange activations with the other
    ranks (the EP group) by async all_to_all; time overlap on vs off, round-robin."""
    groups = [dist.new_group([r]) for r in range(world)]
    layers = build_layers("a2a", opts["layers"], opts["hidden"])
    runners = {f"ours DualPipeV, EP overlap {'on' if on else 'off'}":
               our_runner("ours DualPipeV", 0, 1, layers, opts["chunks"], {**opts, "overlap": on}, groups[rank])
               for on in (True, False)}
    return [{"schedule": name, "rank": rank, "step_s": st["step_s"], "idle": statistics.median(st["idle"]),
             "peak": st["peak"]} for name, st in _time_round_robin(runners, opts).items()]


def main(argv: list[str]) -> int:
    """Parse options, run every schedule side by side, print the table, write --json."""
    p = argparse.ArgumentParser(prog="moe-bench pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes (2 or 4)")
    p.add_argument("--model", choices=("mlp", "moe"), default="mlp")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-split", dest="split_bw", action="store_false", help="our runtime without B/W split")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help="our runtime without EP overlap")
    p.add_argument("--ep-overlap", action="store_true",
                   help="measure the EP overlap switch: --world ranks, each a 1-rank DualPipeV, all_to_all blocks")
    p.add_argument("--only", nargs="*", help="run only these schedules (names as printed)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.batch % args.chunks:
        p.error(f"--batch {args.batch} must be divisible by --chunks {args.chunks}")
    names = ["1 process", *OURS, *TORCH]
    if args.world % 2:
        names.remove("ours DualPipe")
    names = [n for n in names if not args.only or n in args.only]
    opts = {**vars(args), "schedules": names}
    worker = _ep_overlap_worker if args.ep_overlap else _bench_worker
    results = run_processes(worker, args.world, opts, threads=args.threads, timeout_s=900)
    rows = summarise(results, opts)
    model = "all_to_all MLP blocks" if args.ep_overlap else args.model
    latency = "" if args.ep_overlap else f"; p2p latency {1e3 * results[0][0]['p2p_s']:.2f} ms"
    print(f"pipeline benchmark: {model}, {args.layers} layers, hidden {args.hidden}, batch {args.batch}, "
          f"{args.chunks} micro-batches, {args.world} processes x {args.threads} thread, gloo, "
          f"median of {args.steps} steps{latency}")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0
