"""The timed part of `moe-bench dispatch`: each EP rank runs every contender round-robin, a barrier before each call."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from dispatch.dispatcher import PAYLOADS, EPDispatcher
from dispatch.routes import BACKENDS
from dispatch.routing import synthetic_routing
from dispatch.traffic import Traffic
from launch.bench.onehot import OneHotDispatcher

ONEHOT = "one-hot"
CONTENDERS = tuple((backend, payload) for backend in (ONEHOT, *BACKENDS) for payload in PAYLOADS)
KINDS = ("dispatch", "combine")


def rank_routing(opts: dict[str, Any], rank: int) -> tuple[Tensor, Tensor]:
    """Rank's (indices, weights): synthetic_routing seeded with opts["seed"] + rank, so anyone can rebuild it."""
    return synthetic_routing(opts["tokens"], opts["experts"], opts["top_k"], opts["routing"],
                             num_groups=opts["num_groups"], topk_groups=opts["topk_groups"], skew=opts["skew"],
                             generator=torch.Generator().manual_seed(opts["seed"] + rank))


def make_dispatcher(backend: str, payload: str, opts: dict[str, Any]) -> EPDispatcher | OneHotDispatcher:
    """The contender (backend, payload) over the whole world."""
    if backend == ONEHOT:
        return OneHotDispatcher(opts["experts"], gpus_per_node=opts["gpus_per_node"],
                                capacity_factor=opts["capacity_factor"], payload=payload)
    return EPDispatcher(opts["experts"], gpus_per_node=opts["gpus_per_node"], backend=backend, payload=payload)


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
    """Per contender: this rank's dispatch/combine seconds per timed repeat and the traffic of its last calls.

    Experts are the identity: combine gets the dispatched rows back unchanged. Both dispatchers
    return (rows, ..., what combine needs), so one loop drives them all.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if opts["comm"] == "nccl" else torch.device("cpu")
    indices, weights = (t.to(device) for t in rank_routing(opts, rank))
    gen = torch.Generator().manual_seed(10_000 + rank)
    x = torch.randn(opts["tokens"], opts["hidden"], generator=gen).to(device, torch.bfloat16)
    dispatchers = {key: make_dispatcher(*key, opts) for key in CONTENDERS}
    seconds: dict[tuple[str, str], dict[str, list[float]]] = {key: {k: [] for k in KINDS} for key in CONTENDERS}
    for rep in range(opts["warmup"] + opts["repeats"]):
        shift = rep % len(CONTENDERS)
        for key in CONTENDERS[shift:] + CONTENDERS[:shift]:
            dispatcher = dispatchers[key]
            sent, dispatch_s = timed(dispatcher.dispatch, device, x, indices, weights)
            _, combine_s = timed(dispatcher.combine, device, sent[0], sent[-1])
            if rep >= opts["warmup"]:
                seconds[key]["dispatch"].append(dispatch_s)
                seconds[key]["combine"].append(combine_s)
            del sent
    traffic: dict[tuple[str, str], dict[str, Traffic]] = {
        key: {kind: d.last_bytes[kind] for kind in KINDS} for key, d in dispatchers.items()}
    return {"seconds": seconds, "traffic": traffic}
