"""`moe-bench pipeline`: our DualPipeV/DualPipe against torch.distributed.pipelining, side by side.

Every schedule runs the same model weights and micro-batches in the same spawned processes (gloo,
one thread each), in rounds of one step each (launch.bench.harness) so load changes on a shared machine hit
all alike. Per schedule it reports the median step time and its spread (the ratio to torch's DualPipeV
taken round by round), each rank's measured idle fraction ((step time -
time inside compute actions) / step time) and peak memory, measured in one extra untimed step as
the peak bytes of distinct storages saved for backward (saved-tensor hooks) plus, for our runtime,
the bytes that queued weight-grad closures keep alive until their W action. Ours merge the weight
grads of up to --merge-w chunks per W action (default all of a stage's; `ours DualPipeV, W per
chunk` keeps DeepSeek's one W per chunk, the runtime's default). For our schedules it
also sets the measured wait fraction next to the simulator's prediction fed with the costs
measured chunk by chunk (WAIT_CAPTION says how both are taken; see pipeline.costs), their
relative difference, and two predictions from coarser costs: drawn from each stage's samples
("sampled") and each stage's median ("median"); what these leave out is the jitter of single
chunks (a slow chunk on one rank makes the other wait) and how it is correlated across ranks.
`--ep-overlap` instead measures the EP overlap switch (see _ep_overlap_worker).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

from launch.bench.pipeline_models import build_layers
from launch.bench.pipeline_runners import OURS, PER_CHUNK_W, TORCH, Runner, our_runner, single_process, torch_runner
from launch.bench.harness import fields, ratio_fields, rounds
from launch.bench.progress import BenchProgress, BudgetExceeded, call_budget, run_ranks, worker_progress
from launch.bench.report import LOWER, header, header_line, table, write_json
from pipeline import schedules
from pipeline.costs import (CostSamples, action_window, hop_latencies, measured_wait, median_wait, occupied_durations,
                            replayed_wait, sampled_wait)
from pipeline.memory import SavedTensorMeter
from pipeline.p2p import P2PChannel


WAIT_CAPTION = ("wait: time a rank was blocked on a receive or outside its actions, within each step's window "
                "from the first action of any rank to the last action end of any rank (the step's head and tail "
                "are left out of measured and simulated time alike); sim wait: the simulator fed with every "
                "chunk's measured F/B/W/F&B cost (time occupied less time blocked, see pipeline.costs; an F&B "
                "pair as its forward, then its backward, split as measured), each rank starting at its measured "
                "offset in the window, and per direction the mean p2p latency of the run (from the later of send "
                "issued and receive waited for, to receive completed, over receives that blocked); sampled: costs "
                "drawn at random from their stage's samples of the same step; median: each stage's median cost")


def p2p_latency(rank: int, shape: tuple[int, ...], rounds: int = 40) -> float:
    """Median one-way seconds of one boundary message between ranks 0 and 1 (receive posted
    ahead, as in the runtime), shared with every rank."""
    ch = P2PChannel(dist.group.WORLD, torch.device("cpu"))
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


def _time_rounds(runners: dict[str, Runner], opts: dict) -> dict[str, dict]:
    """Step the runners in rounds (launch.bench.harness: each runner once per round, warmup + steps rounds,
    every step under the per-call budget), then each once more under the memory meter; rank 0 prints progress."""
    x, target = _data(opts)
    stats = {name: {"idle": [], "durations": [], "shares": [], "bounds": [], "transfers": [], "peak": 0}
             for name in runners}

    def step(name: str) -> float:
        run, st = runners[name], stats[name]
        for m in run.modules:
            m.zero_grad(set_to_none=True)
        compute0 = run.compute_seconds() if run.pipe is None else 0.0
        dist.barrier()
        t0 = time.perf_counter()
        run.step(x, target)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
        st["idle"].append(1 - (run.compute_seconds() - compute0) / float(elapsed))
        if run.pipe is not None:
            timeline = run.pipe.timeline
            st["durations"].append(occupied_durations(timeline))
            st["shares"].append(dict(run.pipe.forward_shares))
            st["bounds"].append((timeline[0][1], timeline[-1][2]))
            st["transfers"].append(run.pipe.transfers)
        return float(elapsed)

    timed = rounds({name: partial(step, name) for name in runners}, opts["warmup"], opts["steps"],
                   opts["call_budget"], opts, "step", progress=worker_progress("pipeline", dist.get_rank(), opts))
    for name, run in runners.items():
        st = stats[name]
        for key in ("idle", "durations", "shares", "bounds", "transfers"):  # the timed rounds' only
            st[key] = st[key][opts["warmup"]:]
        for m in run.modules:
            m.zero_grad(set_to_none=True)
        meter = SavedTensorMeter(run.extra_bytes)
        with meter.hooks(), call_budget(opts["call_budget"], f"contender {name!r} step", opts):
            run.step(x, target)
        st["peak"] = meter.peak
        st["step_s"] = timed[name]["time"]
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
    for name, st in _time_rounds(runners, opts).items():
        row = {"schedule": name, "rank": rank, "step_s": st["step_s"], "idle": statistics.median(st["idle"]),
               "peak": st["peak"], "p2p_s": latency}
        if runners[name].pipe is not None:
            row.update({k: st[k] for k in ("durations", "shares", "bounds", "transfers")},
                       pipe_schedule=runners[name].pipe.schedule(opts["chunks"]))
        rows.append(row)
    return rows


def wait_model(schedule: schedules.Schedule, per_rank: list[dict], p2p: float) -> dict:
    """Each rank's measured wait fraction within the steps' action windows next to the simulator's
    predictions from the costs measured: per-chunk costs, each rank's start in the window and the
    p2p latency per direction measured in the run (p2p, the idle ping-pong's, where none was)."""
    steps = [list(step) for step in zip(*(r["durations"] for r in per_rank))]
    shares = [list(step) for step in zip(*(r["shares"] for r in per_rank))]
    windows = [action_window(bounds) for bounds in zip(*(r["bounds"] for r in per_rank))]
    starts = [start for _, start in windows]
    samples = [CostSamples.of_step(*args) for args in zip(steps, starts, shares)]
    latencies = hop_latencies(list(zip(*(r["transfers"] for r in per_rank))))
    ranks = range(len(per_rank))
    hops = {(s, d): statistics.mean(latencies[(s, d)]) if latencies.get((s, d)) else p2p
            for s in ranks for d in ranks if s != d}
    measured = [measured_wait([w for w, _ in windows], r["durations"]) for r in per_rank]
    predicted = replayed_wait(schedule, steps, hops, starts, shares)
    return {"wait_fraction": measured, "sim_wait_fraction": predicted,
            "sim_rel_diff": [(p - m) / m if m else None for p, m in zip(predicted, measured)],
            "sampled_wait_fraction": sampled_wait(schedule, samples, hops),
            "median_wait_fraction": median_wait(schedule, CostSamples.pooled(samples), hops),
            "head_ms": [1e3 * statistics.mean(s) for s in zip(*starts)],
            "hop_ms": {f"{s}->{d}": round(1e3 * t, 3) for (s, d), t in hops.items()}}


def summarise(results: list[list[dict]], opts: dict) -> list[dict]:
    """One row per schedule: median step ms and its spread, per-rank idle, peak memory; for ours the wait model
    (wait_model)."""
    rows, steps = [], []
    for per_rank in zip(*results):
        steps.append(per_rank[0]["step_s"])
        row = {"schedule": per_rank[0]["schedule"], "world_size": opts["world"], "num_chunks": opts["chunks"],
               **fields("step_ms", per_rank[0]["step_s"]),
               "idle_fraction": [round(r["idle"], 4) for r in per_rank],
               "peak_mem_bytes": max(r["peak"] for r in per_rank)}
        if "durations" in per_rank[0]:
            model = wait_model(per_rank[0]["pipe_schedule"], list(per_rank), per_rank[0]["p2p_s"])
            hop_ms = model.pop("hop_ms")
            row.update({k: [None if x is None else round(x, 4) for x in v] for k, v in model.items()}, hop_ms=hop_ms)
        rows.append(row)
    ref = next((s for s, r in zip(steps, rows) if r["schedule"] == "torch DualPipeV"), None)
    for step, r in zip(steps, rows):  # round by round: both steps of one round
        r.update(ratio_fields("vs_torch_dualpipev", step / ref) if ref else
                 {"vs_torch_dualpipev": None, "vs_torch_dualpipev_spread": None})
    return rows


def _per_rank(values: list | None, fmt: str = "{:.3f}") -> str:
    return " ".join("-" if x is None else fmt.format(x) for x in values) if values else "-"


COLUMNS = [("schedule", "schedule", ""), ("step ms", "step_ms", ".1f"), ("spread", "step_ms_spread", ".0%"),
           ("x torch DPV", "vs_torch_dualpipev", ".2f"), ("spread", "vs_torch_dualpipev_spread", ".0%"),
           *((title, f"{key}_text", "") for title, key in (
               ("idle/rank", "idle_fraction"), ("wait/rank", "wait_fraction"), ("sim wait", "sim_wait_fraction"),
               ("sim vs wait", "sim_rel_diff"), ("sampled", "sampled_wait_fraction"),
               ("median", "median_wait_fraction"))),
           ("peak MiB", "peak_mib", ".2f")]


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width table (per-rank lists as space-separated values)."""
    shown = [{**r, "peak_mib": r["peak_mem_bytes"] / 2**20,
              **{f"{key}_text": _per_rank(r.get(key), "{:+.0%}" if key == "sim_rel_diff" else "{:.3f}")
                 for key in ("idle_fraction", "wait_fraction", "sim_wait_fraction", "sim_rel_diff",
                             "sampled_wait_fraction", "median_wait_fraction")}} for r in rows]
    return table(shown, COLUMNS, left=1)


def format_wait_summary(rows: list[dict]) -> str:
    """For each of our schedules: the wait of all ranks together, measured vs predicted."""
    lines = []
    for r in rows:
        if "wait_fraction" in r:
            m, p = (statistics.mean(r[k]) for k in ("wait_fraction", "sim_wait_fraction"))
            lines.append(f"{r['schedule']}: wait of all ranks {m:.3f} measured, {p:.3f} predicted from the measured "
                         f"per-chunk costs ({(p - m) / m:+.0%}, {p - m:+.3f}); "
                         f"{statistics.mean(r['sampled_wait_fraction']):.3f} sampled, "
                         f"{statistics.mean(r['median_wait_fraction']):.3f} from median costs; in-run p2p ms "
                         + ", ".join(f"{k} {v:.2f}" for k, v in r["hop_ms"].items())
                         + "; ranks start " + " ".join(f"{h:.2f}" for h in r["head_ms"]) + " ms into the window")
    return "\n".join(lines)


def _ep_overlap_worker(rank: int, world: int, opts: dict) -> list[dict]:
    """Each rank runs its own 1-rank DualPipeV of the product's MoE blocks, whose experts are spread over
    all ranks (one EP group, the product's EPDispatcher); time overlap on vs off, in rounds."""
    groups = [dist.new_group([r]) for r in range(world)]
    layers = build_layers("moe", opts["layers"], opts["hidden"])
    runners = {f"ours DualPipeV, EP overlap {'on' if on else 'off'}":
               our_runner("ours DualPipeV", 0, 1, layers, opts["chunks"], {**opts, "overlap": on}, groups[rank],
                          dist.group.WORLD)
               for on in (True, False)}
    return [{"schedule": name, "rank": rank, "step_s": st["step_s"], "idle": statistics.median(st["idle"]),
             "peak": st["peak"]} for name, st in _time_rounds(runners, opts).items()]


def main(argv: list[str] | None = None) -> int:
    """Parse options, run every schedule side by side, print the table, write --json."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="moe-bench pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes (2 or 4)")
    p.add_argument("--model", choices=("mlp", "moe"), default="mlp")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-split", dest="split_bw", action="store_false", help="our runtime without B/W split")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help="our runtime without EP overlap")
    p.add_argument("--merge-w", type=int, help="chunks per W action of ours (default: --chunks, one W per stage; "
                   f"'{PER_CHUNK_W}' also runs with 1)")
    p.add_argument("--ep-overlap", action="store_true",
                   help="measure the EP overlap switch: --world ranks, each a 1-rank DualPipeV of MoE blocks, one EP group")
    p.add_argument("--only", nargs="*", help="run only these schedules (names as printed)")
    p.add_argument("--call-budget", type=float, default=60.0,
                   help="seconds one pipeline step may take before the run stops naming its schedule (0: no limit)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.batch % args.chunks:
        p.error(f"--batch {args.batch} must be divisible by --chunks {args.chunks}")
    if args.merge_w is None:
        args.merge_w = args.chunks if args.split_bw else 1
    if args.merge_w < 1 or (args.merge_w > 1 and not args.split_bw):
        p.error(f"--merge-w {args.merge_w} must be >= 1 (and 1 with --no-split)")
    names = ["1 process", *OURS, *TORCH]
    if args.world % 2:
        names.remove("ours DualPipe")
    if args.merge_w == 1:
        names.remove(PER_CHUNK_W)
    names = [n for n in names if not args.only or n in args.only]
    opts = {**vars(args), "schedules": names}
    worker = _ep_overlap_worker if args.ep_overlap else _bench_worker
    head = header("pipeline", argv)
    print(header_line(head))
    try:
        results = run_ranks(worker, args.world, opts, "run a smaller model (--layers, --hidden, --batch) or raise "
                            "--call-budget", threads=args.threads, progress=BenchProgress("pipeline", not args.quiet))
    except BudgetExceeded as err:
        print(f"moe-bench pipeline: stopped: {err}", file=sys.stderr)
        return 3
    rows = summarise(results, opts)
    model = "expert-parallel MoE blocks" if args.ep_overlap else args.model
    latency = "" if args.ep_overlap else f"; idle ping-pong p2p latency {1e3 * results[0][0]['p2p_s']:.2f} ms"
    print(f"pipeline benchmark: {model}, {args.layers} layers, hidden {args.hidden}, batch {args.batch}, "
          f"{args.chunks} micro-batches, {args.world} processes x {args.threads} thread, gloo, "
          f"median of {args.steps} rounds of one step each (spread = IQR / median){latency}; ours: "
          + ("no B/W split" if not args.split_bw else f"B/W split, each W action over up to {args.merge_w} chunks"))
    print(format_table(rows))
    if not args.ep_overlap:
        print(format_wait_summary(rows))
        print(WAIT_CAPTION)
    if args.json:
        shape = {name: getattr(args, name) for name in ("model", "layers", "hidden", "batch", "ep_overlap")}
        write_json(args.json, head, [{**row, **shape} for row in rows], ["schedule", "world_size", "num_chunks", *shape],
                   {"step_ms": LOWER})
    return 0
