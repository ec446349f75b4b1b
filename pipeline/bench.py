"""`moe-bench pipeline`: our DualPipeV/DualPipe against torch.distributed.pipelining, side by side.

Every schedule runs the same model weights and micro-batches in the same spawned processes (gloo,
one thread each), round-robin step by step. Per schedule it reports the median step time, each rank's measured idle
fraction ((step time - time inside compute actions) / step time), the simulator's idle fraction
for our schedules (fed with the measured F, B, W, F&B costs), and peak memory, measured in one
extra untimed step as the peak bytes of distinct storages saved for backward (saved-tensor hooks)
plus, for our runtime, the bytes that queued weight-grad closures keep alive until their W action.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dispatch.multiproc import run_processes
from pipeline.runtime import DualPipe, DualPipeV
from pipeline.simulate import Costs, simulate

OURS = ("ours DualPipeV", "ours DualPipe")
TORCH = ("torch DualPipeV", "torch ZBVZeroBubble", "torch 1F1B", "torch Interleaved1F1B")


class MLPBlock(nn.Module):
    """Linear(h, 4h) -> GELU -> Linear(4h, h)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Pre-norm residual MoE layer (dropless); imported lazily so pipeline stays MoE-agnostic."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        from moe.config import ModelConfig
        from moe.layer import MoELayer
        self.norm = nn.LayerNorm(hidden)
        self.moe = MoELayer(ModelConfig(hidden_size=hidden, num_heads=4, num_kv_heads=4, num_experts=8,
                                        top_k=2, expert_ffn_size=hidden, num_shared_experts=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))[0]


def build_layers(model: str, layers: int, hidden: int, seed: int = 0) -> list[nn.Module]:
    """The benchmark model as a list of blocks, identical in every process."""
    torch.manual_seed(seed)
    block = MLPBlock if model == "mlp" else MoEBlock
    return [block(hidden) for _ in range(layers)]


def partition(layers: list[nn.Module], num_stages: int) -> list[nn.Sequential]:
    """Contiguous, equal groups of fresh copies of the layers."""
    if len(layers) % num_stages:
        raise ValueError(f"--layers {len(layers)} must be divisible by the {num_stages} stages of a schedule")
    per = len(layers) // num_stages
    return [nn.Sequential(*copy.deepcopy(layers[i * per:(i + 1) * per])) for i in range(num_stages)]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Loss of one micro-batch."""
    return nn.functional.mse_loss(out, target)


class SavedTensorMeter:
    """Peak bytes of distinct storages held for backward, plus extra bytes reported by `extra()`."""

    def __init__(self, extra: Callable[[], int] = lambda: 0) -> None:
        self.extra = extra
        self.refs: dict[int, list[int]] = {}  # storage ptr -> [count, nbytes]
        self.live = self.peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ref = self.refs.setdefault(storage.data_ptr(), [0, storage.nbytes()])
        if ref[0] == 0:
            self.live += ref[1]
        ref[0] += 1
        self.peak = max(self.peak, self.live + self.extra())
        return _Held(t, storage.data_ptr(), self)

    def release(self, ptr: int) -> None:
        """A saved tensor was dropped by its graph."""
        ref = self.refs[ptr]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[ptr]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Context that routes saved tensors through this meter."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)


class _Held:
    __slots__ = ("tensor", "ptr", "meter")

    def __init__(self, tensor: torch.Tensor, ptr: int, meter: SavedTensorMeter) -> None:
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter.release(self.ptr)


class _Timer:
    """Accumulates seconds spent inside wrapped methods."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0
        return timed


def _torch_runner(name: str, rank: int, world: int, layers: list[nn.Module], chunks: int):
    """(step(x, target), modules, timer) for one torch.distributed.pipelining schedule."""
    from torch.distributed import pipelining as pp
    if name == "torch 1F1B":
        stage_ids, num_stages = [rank], world
    elif name == "torch Interleaved1F1B":
        stage_ids, num_stages = [rank, rank + world], 2 * world
    else:  # V-shaped placement
        stage_ids, num_stages = [rank, 2 * world - 1 - rank], 2 * world
    mods = partition(layers, num_stages)
    timer = _Timer()
    stages = []
    for sid in stage_ids:
        st = pp.PipelineStage(mods[sid], sid, num_stages, torch.device("cpu"))
        for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(st, meth, timer.wrap(getattr(st, meth)))
        stages.append(st)
    cls = {"torch DualPipeV": pp.ScheduleDualPipeV, "torch ZBVZeroBubble": pp.ScheduleZBVZeroBubble,
           "torch 1F1B": pp.Schedule1F1B, "torch Interleaved1F1B": pp.ScheduleInterleaved1F1B}[name]
    sched = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=chunks, loss_fn=mse)
    first = any(s == 0 for s in stage_ids)
    last = any(s == num_stages - 1 for s in stage_ids)

    def step(x: torch.Tensor, target: torch.Tensor) -> None:
        args = (x,) if first else ()
        kwargs = {"target": target, "losses": []} if last else {}
        sched.step(*args, **kwargs)

    return step, [mods[s] for s in stage_ids], timer, (lambda: 0), None


def _our_runner(name: str, rank: int, world: int, layers: list[nn.Module], chunks: int, opts: dict):
    """(step(x, target), modules, timer-like, extra-bytes, runtime) for our DualPipeV / DualPipe."""
    v = name == "ours DualPipeV"
    num_stages = 2 * world if v else world
    mods = partition(layers, num_stages)
    pair = (mods[rank], mods[num_stages - 1 - rank])
    pipe = (DualPipeV if v else DualPipe)(pair, split_bw=opts["split_bw"], overlap=opts["overlap"])

    def step(x: torch.Tensor, target: torch.Tensor) -> None:
        if v:
            inputs, labels = ((x,), (target,)) if rank == 0 else ((), ())
        else:
            xs, ts = x.chunk(2), target.chunk(2)
            inputs, labels = {0: ((xs[0],), (ts[1],)), world - 1: ((xs[1],), (ts[0],))}.get(rank, ((), ()))
        pipe.timeline = []
        pipe.step(*inputs, num_chunks=chunks, criterion=mse, labels=labels)

    return step, list(pipe.module), pipe, (lambda: pipe.store.held_bytes), pipe


def _single_process(rank: int, layers: list[nn.Module], chunks: int):
    """The whole model on rank 0 alone, chunk by chunk (the 1-process reference); others idle."""
    model = nn.Sequential(*copy.deepcopy(layers))
    timer = _Timer()

    def step(x: torch.Tensor, target: torch.Tensor) -> None:
        if rank != 0:
            return
        t0 = time.perf_counter()
        for xc, tc in zip(x.chunk(chunks), target.chunk(chunks)):
            mse(model(xc), tc).backward()
        timer.total += time.perf_counter() - t0

    return step, [model], timer, (lambda: 0), None


def _compute_seconds(timer: Any) -> float:
    if isinstance(timer, _Timer):
        return timer.total
    return sum(busy for *_, busy in timer.timeline)


def _mean_costs(pipe: Any) -> list[float]:
    """Measured mean seconds of F, full B, split B, W and F&B actions on this rank ([sum, count] pairs)."""
    sums = {k: [0.0, 0] for k in ("F", "B", "Bs", "W", "FB")}
    for act, _, _, busy in pipe.timeline:
        key = "Bs" if act.op.value == "B" and act.split else act.op.value
        sums[key][0] += busy
        sums[key][1] += 1
    return [v for pair in sums.values() for v in pair]


def _bench_worker(rank: int, world: int, opts: dict) -> list[dict]:
    """Build every schedule, then time them round-robin (step i of each in turn) so that load
    changes on a shared machine hit all of them alike."""
    layers = build_layers(opts["model"], opts["layers"], opts["hidden"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(opts["batch"], opts["hidden"], generator=g)
    target = torch.randn(opts["batch"], opts["hidden"], generator=g)
    runners = {}
    for name in opts["schedules"]:
        if name == "1 process":
            runners[name] = _single_process(rank, layers, opts["chunks"])
        elif name in OURS:
            runners[name] = _our_runner(name, rank, world, layers, opts["chunks"], opts)
        else:
            runners[name] = _torch_runner(name, rank, world, layers, opts["chunks"])
    stats = {name: {"step_s": [], "idle": [], "peak": 0, "costs": torch.zeros(10, dtype=torch.float64)}
             for name in runners}
    for i in range(opts["warmup"] + opts["steps"] + 1):
        for name, (step, mods, timer, extra, pipe) in runners.items():
            for m in mods:
                m.zero_grad(set_to_none=True)
            if i == opts["warmup"] + opts["steps"]:  # one last, untimed step measures memory
                meter = SavedTensorMeter(extra)
                with meter.hooks():
                    step(x, target)
                stats[name]["peak"] = meter.peak
                continue
            compute0 = _compute_seconds(timer) if isinstance(timer, _Timer) else 0.0
            dist.barrier()
            t0 = time.perf_counter()
            step(x, target)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i < opts["warmup"]:
                continue
            st = stats[name]
            st["step_s"].append(float(elapsed))
            st["idle"].append(1 - (_compute_seconds(timer) - compute0) / float(elapsed))
            if pipe is not None:
                st["costs"] += torch.tensor(_mean_costs(pipe), dtype=torch.float64)
    rows = []
    for name, st in stats.items():
        row = {"schedule": name, "rank": rank, "step_s": st["step_s"], "idle": statistics.median(st["idle"]),
               "peak": st["peak"]}
        pipe = runners[name][4]
        if pipe is not None:
            dist.all_reduce(st["costs"])
            row["sim_idle"] = _simulated_idle(pipe, opts["chunks"], st["costs"].tolist(), rank)
        rows.append(row)
    return rows


def _simulated_idle(pipe: Any, chunks: int, sums: list[float], rank: int) -> float:
    """Idle fraction the simulator predicts for this rank from the measured mean action costs."""
    mean = {k: (sums[2 * i] / sums[2 * i + 1] if sums[2 * i + 1] else 0.0)
            for i, k in enumerate(("F", "B", "Bs", "W", "FB"))}
    full_b = mean["B"] if mean["B"] else mean["Bs"] + mean["W"]
    w = mean["W"] if mean["Bs"] else 0.0
    costs = Costs(mean["F"], full_b, w, mean["FB"] or None)
    from pipeline import schedules
    sched = schedules.build(pipe.schedule_name, pipe.num_ranks, chunks, split_bw=pipe.split_bw)
    return simulate(sched, costs).idle_fractions[rank]


def summarise(results: list[list[dict]], opts: dict) -> list[dict]:
    """One row per schedule: median step ms, per-rank idle, simulator idle, peak memory."""
    rows = []
    for per_rank in zip(*results):
        name = per_rank[0]["schedule"]
        row = {"schedule": name, "world_size": opts["world"], "num_chunks": opts["chunks"],
               "step_ms": 1e3 * statistics.median(per_rank[0]["step_s"]),
               "idle_fraction": [round(r["idle"], 4) for r in per_rank],
               "peak_mem_bytes": max(r["peak"] for r in per_rank)}
        if "sim_idle" in per_rank[0]:
            row["sim_idle_fraction"] = [round(r["sim_idle"], 4) for r in per_rank]
        rows.append(row)
    ref = next((r["step_ms"] for r in rows if r["schedule"] == "torch DualPipeV"), None)
    for r in rows:
        r["vs_torch_dualpipev"] = round(r["step_ms"] / ref, 3) if ref else None
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width table."""
    lines = [f"{'schedule':24} {'step ms':>9} {'x torch DPV':>11} {'idle per rank':>22} "
             f"{'sim idle':>16} {'peak MiB':>9}"]
    for r in rows:
        idle = " ".join(f"{x:.2f}" for x in r["idle_fraction"])
        sim = " ".join(f"{x:.2f}" for x in r.get("sim_idle_fraction", [])) or "-"
        ratio = f"{r['vs_torch_dualpipev']:.2f}" if r["vs_torch_dualpipev"] else "-"
        lines.append(f"{r['schedule']:24} {r['step_ms']:9.1f} {ratio:>11} {idle:>22} {sim:>16} "
                     f"{r['peak_mem_bytes'] / 2**20:9.2f}")
    return "\n".join(lines)


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
    p.add_argument("--only", nargs="*", help="run only these schedules (names as printed)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    names = ["1 process", *OURS, *TORCH]
    if args.world % 2:
        names.remove("ours DualPipe")
    if args.only:
        names = [n for n in names if n in args.only]
    if args.batch % args.chunks:
        p.error(f"--batch {args.batch} must be divisible by --chunks {args.chunks}")
    opts = {**vars(args), "schedules": names}
    results = run_processes(_bench_worker, args.world, opts, threads=args.threads, timeout_s=900)
    rows = summarise(results, opts)
    print(f"pipeline benchmark: {args.model} {args.layers} layers hidden {args.hidden}, batch {args.batch}, "
          f"{args.chunks} micro-batches, {args.world} processes x {args.threads} thread, gloo, "
          f"median of {args.steps} steps")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0
