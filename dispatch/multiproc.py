"""Run a function on several local processes joined by one torch.distributed process group."""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A worker process raised, timed out or died; the message carries its traceback."""


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        out = fn(rank, world_size, *args)
        # plain pickle copies tensors by value: shared-memory handles would die with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - the parent re-raises with this traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs: list, results: Any, outputs: dict[int, Any], wait_s: float) -> str | None:
    """Fill outputs with each rank's result; return the first failure (raised, died, or too slow)."""
    end = time.monotonic() + wait_s
    suspects: set[int] = set()
    while len(outputs) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=1.0)
        except queue.Empty:
            dead = {r for r, p in enumerate(procs) if r not in outputs and p.exitcode is not None}
            if dead & suspects:  # gone with no result over two polls: it will never report
                rank = min(dead & suspects)
                return f"rank {rank} died with exit code {procs[rank].exitcode} before reporting a result"
            suspects = dead
            if time.monotonic() > end:
                return f"no result within {wait_s:.0f}s from ranks {sorted(set(range(len(procs))) - set(outputs))}"
            continue
        if not ok:
            return f"rank {rank} failed:\n{payload}"
        outputs[rank] = pickle.loads(payload)
    return None


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size fresh processes; return each rank's result.

    The parent hosts the rendezvous store on a port the OS picks, so concurrent runs never
    collide. If any rank raises, dies or exceeds timeout_s, every rank is killed and a
    WorkerError carrying the first failure's traceback is raised; a rank that dies without
    reporting is noticed within seconds. fn and its results must be picklable (define fn at
    module level); tensors in results come back by value.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(r, world_size, store.port, backend, threads, timeout_s, fn, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failure: str | None = None
    try:
        failure = _collect(procs, results, outputs, timeout_s + 60.0)  # interpreter start-up counts too
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        del store
    if failure is not None:
        raise WorkerError(failure)
    return [outputs[r] for r in range(world_size)]
