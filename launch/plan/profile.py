"""Measured seconds of one chunk through each pipeline stage of a config on this machine, for the planner to
simulate the pipeline with instead of its FLOPs model.

Every rank of the config's layout builds its stages as the trainer does (TP, EP dispatch over the layout's
groups, weight grads deferred as the runtime's B/W split does) and times one chunk's forward, input-grad
backward (B) and weight grads (W) through each. The pipeline ranks take turns: one pipeline rank's DP/TP/EP
replicas run in lockstep (their exchanges wait on each other as in the run) while the other ranks wait, so a
stage's figure does not depend on what the stages timed beside it cost. Where ranks outnumber cores, the
simulator then shares the cores among the pipeline ranks busy at each moment (Profile.speed). Each figure is
the median over repeats on each rank, then the mean over the ranks that hold the stage. Where the runtime
overlaps an F&B pair (the backward on a helper thread), the pair's time over its halves' is measured too."""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from launch.parallel.spawn import run_processes
from launch.config.run import RunConfig
from launch.parallel.mesh import Mesh
from launch.plan.timing import StageCost
from launch.parallel.stages import Stage, lm_loss
from launch.parallel.device import rank_device
from launch.train.build import boundary_meta, build_model, stage_ids
from pipeline.wgrad import WeightGradStore

PAIRED = ("dualpipe", "dualpipev")  # schedules whose runtime runs F&B pairs


@dataclass(frozen=True)
class StageSeconds:
    """One chunk through one stage: forward, the input-grad part of backward, the weight grads."""

    f: float
    b: float
    w: float


@dataclass(frozen=True)
class Profile:
    """Seconds per stage (by position along the pipeline) measured on `cores` cores, a layout of `ranks` ranks
    taking turns by pipeline rank."""

    stages: list[StageSeconds]
    ranks: int
    cores: int
    pair_factor: float = 1.0  # an F&B pair's time over its halves' (the runtime's backward-on-a-thread pair)

    def stage_cost(self, stage: int) -> StageCost:
        """One chunk through a stage (its EP exchanges are inside the measured seconds)."""
        p = self.stages[stage]
        return StageCost(p.f, p.b + p.w, p.w, 0.0, 0.0)

    def speed(self, pp: int) -> Callable[[int], float] | None:
        """How fast actions run while n of the pp pipeline ranks run one, relative to the profile (where one
        pipeline rank's DP/TP replicas ran at a time): the ranks share the cores. None when every rank has a
        core of its own."""
        if self.cores >= self.ranks:
            return None
        replicas = self.ranks // pp
        profiled = min(1.0, self.cores / replicas)
        return lambda n: min(1.0, self.cores / (n * replicas)) / profiled

    def describe(self) -> str:
        """The figures in one line, milliseconds."""
        stages = ", ".join(f"stage {i} F/B/W {p.f * 1e3:.2f}/{p.b * 1e3:.2f}/{p.w * 1e3:.2f} ms"
                           for i, p in enumerate(self.stages))
        return f"{stages}; F&B pair {self.pair_factor:.2f}x its halves"


def _timed(fn: Callable[[], Any], mine: bool = True) -> tuple[float, Any]:
    """Seconds fn takes, every rank whose turn it is starting it together (the others only meet the barrier),
    and what it returns ((0, (None, None)) when not this rank's turn)."""
    dist.barrier()
    if not mine:
        return 0.0, (None, None)
    began = time.perf_counter()
    out = fn()
    return time.perf_counter() - began, out


class _Chunks:
    """One chunk's forward and backward through a stage of this rank, as the runtime runs them."""

    def __init__(self, config: RunConfig, store: WeightGradStore) -> None:
        train, cfg = config.train, config.model
        tokens = torch.randint(0, cfg.vocab_size, (train.micro_batch_size, train.seq_len + 1),
                               generator=torch.Generator().manual_seed(0))
        self.inputs, self.labels = tokens[:, :-1], tokens[:, 1:]
        self.hidden = boundary_meta(config)[0].shape  # this rank's share of the sequence (CP, and SP)
        self.dtype = getattr(torch, train.dtype)
        self.store = store

    def forward(self, stage: Stage) -> tuple[Tensor, Tensor | None]:
        """(the stage's output: hidden, or the scaled LM loss on the last stage; a grad for it)."""
        if stage.embed is not None:
            x = self.inputs
        else:
            x = torch.randn(self.hidden, dtype=self.dtype, generator=torch.Generator().manual_seed(1))
            x.requires_grad_()
        out = stage(x)
        if stage.lm_head is not None:
            return lm_loss(out, self.labels, stage.loss_scale, stage.tp, stage.cp), None
        return out, torch.ones_like(out)

    def backward(self, key: int, out: Tensor, grad: Tensor | None) -> None:
        """The input-grad backward, weight grads queued under key for a W."""
        with self.store.capture(key):
            torch.autograd.backward(out, grad)


def profile_rank(rank: int, world: int, config: RunConfig, repeats: int) -> tuple[dict[int, StageSeconds], float]:
    """This rank's median seconds per stage it holds over repeats (after one warm-up), and the median F&B pair
    factor (1 when the runtime runs no pair's halves at once). The pipeline ranks take turns, each with its
    DP/TP/EP replicas in lockstep while the others wait, so no figure depends on what another stage costs."""
    mesh = Mesh(config.layout)
    # the runtime installs the B/W split on the stages
    stages, runtime = build_model(config, mesh, rank_device(config.train.device))
    ids = stage_ids(config, mesh.pp_rank)
    chunks = _Chunks(config, WeightGradStore())
    samples: dict[int, list[tuple[float, float, float]]] = {i: [] for i in ids}
    threaded = (runtime is not None and config.parallel.overlap_fb_pairs and config.parallel.schedule in PAIRED
                and all(stage.concurrent_backward for stage in stages))
    factors = []
    with ThreadPoolExecutor(1) as pool:
        for _ in range(repeats + 1):
            for turn in range(config.parallel.pp):
                mine = turn == mesh.pp_rank
                for i, stage in zip(ids, stages):
                    f, (out, grad) = _timed(lambda: chunks.forward(stage), mine)
                    b, _ = _timed(lambda: chunks.backward(i, out, grad), mine)
                    w, _ = _timed(lambda: chunks.store.run(i), mine)
                    if mine:
                        samples[i].append((f, b, w))
                if threaded:  # the first phase's forward beside the last one's backward, as in DualPipe(V)
                    first, last = stages[0], stages[-1]
                    out, grad = chunks.forward(last) if mine else (None, None)

                    def forward_beside_backward() -> None:
                        backward = pool.submit(chunks.backward, ids[-1], out, grad)
                        chunks.forward(first)
                        backward.result()

                    pair, _ = _timed(forward_beside_backward, mine)
                    if mine:
                        chunks.store.run(ids[-1])
                        factors.append(pair / (samples[ids[0]][-1][0] + samples[ids[-1]][-1][1]))
    medians = {i: StageSeconds(*(statistics.median(run[k] for run in runs[1:]) for k in range(3)))
               for i, runs in samples.items()}
    return medians, statistics.median(factors[1:]) if factors else 1.0


def profile(config: RunConfig, repeats: int = 5, timeout_s: float = 300.0) -> Profile:
    """Seconds per stage of config's layout here (each the mean over the ranks holding it of their medians)."""
    world = config.parallel.world_size
    ranks = run_processes(profile_rank, world, config, repeats, timeout_s=timeout_s)
    held: dict[int, list[StageSeconds]] = {}
    for medians, _ in ranks:
        for i, seconds in medians.items():
            held.setdefault(i, []).append(seconds)
    stages = [StageSeconds(*(statistics.mean(getattr(s, x) for s in held[i]) for x in ("f", "b", "w")))
              for i in sorted(held)]
    return Profile(stages, world, os.cpu_count() or 1, statistics.mean(factor for _, factor in ranks))
