"""The timed part of `moe-bench dispatch`: each EP rank runs every contender in rounds (launch.bench.harness), a barrier
before each call."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from dispatch.dispatcher import PAYLOADS, EPDispatcher
from dispatch.hopgroups import make_hop_groups
from dispatch.synthetic import synthetic_routing
from dispatch.topology import BACKENDS, make_topology
from dispatch.traffic import Traffic
from kernels.metrics import calc_diff
from launch.bench.alltoall import PerExpertDispatcher
from launch.bench.harness import rounds
from launch.bench.onehot import OneHotDispatcher
from launch.bench.progress import call_budget, worker_progress
from launch.bench.sweep import point_label

ONEHOT, PER_EXPERT = "one-hot", "per-expert"
PEERS = (ONEHOT, PER_EXPERT)
CONTENDERS = tuple((backend, payload) for backend in (*PEERS, *BACKENDS) for payload in PAYLOADS)
KINDS = ("dispatch", "combine")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX); without, torch emulates it slowly."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def peer_compute_dtype(comm: str) -> torch.dtype:
    """The dtype the peers' arithmetic runs in: bf16 on GPUs and bf16-capable CPUs, float32 otherwise."""
    return torch.bfloat16 if comm == "nccl" or cpu_has_native_bf16() else torch.float32


def rank_routing(opts: dict[str, Any], rank: int) -> tuple[Tensor, Tensor]:
    """Rank's (indices, weights): synthetic_routing seeded with opts["seed"] + rank, so anyone can rebuild it."""
    return synthetic_routing(opts["tokens"], opts["experts"], opts["top_k"], opts["routing"],
                             num_groups=opts["num_groups"], topk_groups=opts["topk_groups"], skew=opts["skew"],
                             generator=torch.Generator().manual_seed(opts["seed"] + rank))


def make_dispatcher(backend: str, payload: str, opts: dict[str, Any]) -> Any:
    """The contender (backend, payload) over the whole world."""
    dtype = peer_compute_dtype(opts["comm"])
    if backend == ONEHOT:
        return OneHotDispatcher(opts["experts"], gpus_per_node=opts["gpus_per_node"],
                                capacity_factor=opts["capacity_factor"], payload=payload, compute_dtype=dtype)
    if backend == PER_EXPERT:
        return PerExpertDispatcher(opts["experts"], gpus_per_node=opts["gpus_per_node"], payload=payload,
                                   compute_dtype=dtype)
    hops = None
    if backend == "hierarchical":  # each hop on its own group, as the trainer runs it (every rank makes them alike)
        topology = make_topology(dist.get_world_size(), opts["gpus_per_node"])
        hops = make_hop_groups(dist.group.WORLD, topology, grad=False)
    return EPDispatcher(opts["experts"], gpus_per_node=opts["gpus_per_node"], backend=backend, payload=payload,
                        hops=hops)


def kept_weight(backend: str, weights: Tensor, handle: Any) -> Tensor:
    """[T] sum of the routing weights a contender keeps: the one-hot peer drops slots past capacity."""
    return handle.sum((1, 2)) if backend == ONEHOT else weights.sum(1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call: Callable[..., Any], device: torch.device, *args: Any) -> tuple[Any, float]:
    """(call(*args), seconds this rank spent until its device finished), started right after a barrier."""
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    out = call(*args)
    _sync(device)
    return out, time.perf_counter() - start


def bench_worker(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Per contender: this rank's dispatch/combine seconds per timed round (launch.bench.harness: the contenders
    in turn), the traffic of its last calls and calc_diff of its last combine against x * kept weights (experts
    are the identity).

    Every call runs under the per-call budget (opts["call_budget"]); rank 0 prints a line per round.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if opts["comm"] == "nccl" else torch.device("cpu")
    indices, weights = (t.to(device) for t in rank_routing(opts, rank))
    gen = torch.Generator().manual_seed(10_000 + rank)
    x = torch.randn(opts["tokens"], opts["hidden"], generator=gen).to(device, torch.bfloat16)
    dispatchers = {key: make_dispatcher(*key, opts) for key in CONTENDERS}
    last: dict[tuple[str, str], tuple[Tensor, Any]] = {}
    progress = worker_progress(f"dispatch {point_label(opts['point'])}".strip(), rank, opts)
    progress(f"{world_size} ranks up; {len(CONTENDERS)} contenders x {opts['warmup'] + opts['repeats']} rounds")

    def call(key: tuple[str, str]) -> dict[str, float]:
        dispatcher, name = dispatchers[key], " ".join(key)
        with call_budget(opts["call_budget"], f"contender {name!r} dispatch", opts):
            sent, dispatch_s = timed(dispatcher.dispatch, device, x, indices, weights)
        with call_budget(opts["call_budget"], f"contender {name!r} combine", opts):
            out, combine_s = timed(dispatcher.combine, device, sent[0], sent[-1])
        last[key] = (out, sent[-1])
        return {"dispatch": dispatch_s, "combine": combine_s}

    # each call runs its dispatch and combine under their own budgets
    seconds = rounds({" ".join(key): partial(call, key) for key in CONTENDERS}, opts["warmup"], opts["repeats"],
                     rotate=True, progress=progress)
    diffs = {key: calc_diff(out, x.double() * kept_weight(key[0], weights, handle).double().unsqueeze(1))
             for key, (out, handle) in last.items()}
    traffic: dict[tuple[str, str], dict[str, Traffic]] = {
        key: {kind: d.last_bytes[kind] for kind in KINDS} for key, d in dispatchers.items()}
    return {"seconds": {key: seconds[" ".join(key)] for key in CONTENDERS}, "traffic": traffic, "calc_diff": diffs}


def points_worker(rank: int, world_size: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """bench_worker at every point of opts["points"] (each a full set of the suite's options), in one launch."""
    return [bench_worker(rank, world_size, {**opts, **point}) for point in opts["points"]]
