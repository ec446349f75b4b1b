"""Every layout of a config on N GPUs: those that fit ranked by predicted step time, the rest with the reason."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

from launch.config.run import RunConfig
from launch.config.sections import ALL_MICRO_BATCHES
from launch.plan.memory import RECOMPUTE
from launch.plan.planner import Machine, Options, Plan, make_plan
from pipeline.schedules import SCHEDULES, min_chunks

PIPELINE_SCHEDULES = SCHEDULES


@dataclass
class SearchResult:
    """Layouts that fit (fastest first) and (layout, reason) for the ones cut."""

    ranked: list[Plan]
    cut: list[tuple[str, str]]


def describe(par: dict, chunks: int, recompute: str = "") -> str:
    """A layout in one short line."""
    cp = f" cp={par['cp']}" if par.get("cp", 1) > 1 else ""
    text = (f"pp={par['pp']} dp={par['dp']}{cp} tp={par['tp']} ep={par['ep']} {par['schedule']} "
            f"chunks={chunks or 'all'}")
    return f"{text} recompute={recompute}" if recompute else text


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(config: RunConfig, gpus: int, gpus_per_node: int) -> Iterator[dict]:
    """[parallel] settings of every (pp, dp, cp, tp, ep, schedule, num_chunks) on gpus GPUs (cp cutting each
    sequence into 2 x cp whole chunks; EP groups, folded over dp x cp x tp, that fill whole nodes or sit in one;
    two chunk counts under a pipeline schedule: the fewest it allows and all micro-batches; without a pipeline,
    where the count changes neither time nor memory, all of them)."""
    for tp, pp, cp in itertools.product(_divisors(min(gpus, gpus_per_node)), _divisors(gpus), _divisors(gpus)):
        if gpus % (tp * pp * cp) or config.train.seq_len % (2 * cp) and cp > 1:
            continue
        dp = gpus // (tp * pp * cp)
        for ep in _divisors(dp * cp * tp):
            if ep % gpus_per_node and gpus_per_node % ep:
                continue
            for schedule in PIPELINE_SCHEDULES if pp > 1 else ("none",):
                micro = config.train.grad_accum_steps // dp if config.train.grad_accum_steps % dp == 0 else 0
                minimum = 1 if schedule == "none" else min_chunks(schedule, pp)
                valid = [c for c in _divisors(micro) if c >= minimum and not (schedule == "dualpipe" and c % 2)]
                counts = sorted({valid[0], valid[-1]}) if valid and schedule != "none" else [micro or 1]
                for chunks in counts:
                    yield dict(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, schedule=schedule,
                               num_chunks=ALL_MICRO_BATCHES if chunks == micro else chunks,
                               sequence_parallel=tp > 1, gpus_per_node=gpus_per_node)


def search(config: RunConfig, gpus: int, machine: Machine, options: Options = Options()) -> SearchResult:
    """Plan every candidate layout; keep the ones that fit (the cheapest recompute that does), fastest first, then
    the least memory."""
    if gpus % machine.gpus_per_node:
        raise ValueError(f"--gpus {gpus} must be a multiple of --gpus-per-node {machine.gpus_per_node}")
    ranked, cut = [], []
    for par in candidates(config, gpus, machine.gpus_per_node):
        try:
            trial = replace(config, parallel=replace(config.parallel, **par))
        except ValueError as error:
            cut.append((describe(par, par["num_chunks"]), str(error)))
            continue
        plan, peak = None, None
        for mode in RECOMPUTE:
            memory = make_plan(trial, machine, replace(options, recompute=mode), timed=False)
            if memory.fits:
                plan = make_plan(trial, machine, replace(options, recompute=mode))
                break
            peak = memory.peak_memory
        if plan is None:
            cut.append((describe(par, trial.chunks_per_step),
                        f"does not fit: {peak / 1e9:.1f} GB > {machine.gpu.memory_gb:g} GB even with full recompute"))
        else:
            ranked.append(plan)
    ranked.sort(key=lambda p: (p.step_seconds, p.peak_memory))  # equal times: the lighter layout first (1F1B, AFAB)
    return SearchResult(ranked, cut)
