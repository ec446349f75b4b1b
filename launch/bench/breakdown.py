"""Where a training step's time goes: one step under torch.profiler, its device time summed by kind of work.

The same categories for every contender (ours and a peer's model in `moe-bench gpu`), from the names of what ran:
on CUDA each kernel's device time (its name: cuBLAS/CUTLASS/Triton/flash kernels), elsewhere each operator's
self CPU time (aten::mm, aten::_grouped_mm, ...). A name goes to the first category whose pattern it matches
(CATEGORIES, in order), else to "other"; the categories sum to the profiled total. ProfiledFeed profiles the last
step of a trainer run from outside the trainer: it starts the profiler when that step asks for its micro-batches;
profile_call profiles one call (a peer's step).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from launch.plan.compute import (ATTENTION, COMMUNICATION, ELEMENTWISE, EXPERT_GEMM, FP8_QUANTISE, GEMM, NORM,
                                 OPTIMIZER, ROUTING)

# category (moe-plan's kinds of work, launch.plan.compute.WORK_KINDS, named there once) -> pattern on a kernel's or
# operator's name, case-insensitive, in the order they are tried: first match wins
PATTERNS: dict[str, str] = {
    FP8_QUANTISE: r"quantiz|retile",  # our Triton quantisers (not the FP8 GEMMs, whose names hold e4m3)
    EXPERT_GEMM: r"grouped_mm|grouped_gemm|mgrouped|kgrouped|groupproblemshape|ptrarray",
    ATTENTION: r"flash|fmha|attention|attn|sdpa|_efficient_attention",
    GEMM: r"gemm|cutlass|xmma|nvjet|cublas|^aten::(mm|addmm|bmm|baddbmm|_addmm_activation)$",
    OPTIMIZER: r"adam|multi_tensor|_foreach_|lerp|sqrt|clip_grad",
    COMMUNICATION: r"nccl|all_to_all|alltoall|allreduce|all_reduce|all_gather|allgather|reduce_scatter|c10d",
    ROUTING: r"sort|scatter|gather|index|cumsum|bincount|histc|topk|nonzero|embedding|one_hot",
    NORM: r"norm|softmax|log_softmax|nll_loss|cross_entropy",
    ELEMENTWISE: r"elementwise|vectorized|copy|fill|mul|add|silu|sigmoid|cat|where|reduce|sum|mean|pow",
}
CATEGORIES: tuple[tuple[str, str], ...] = tuple(PATTERNS.items())
OTHER = "other"


def categorize(name: str) -> str:
    """The category of one kernel or operator name (CATEGORIES: the first whose pattern matches), else OTHER."""
    return next((category for category, pattern in CATEGORIES if re.search(pattern, name, re.IGNORECASE)), OTHER)


def summarize(prof: profile, on_cuda: bool) -> dict[str, Any]:
    """A finished profile's time by category (ms; on CUDA the kernels' device time, else the operators' self CPU
    time) and its top names, each with its category."""
    totals: dict[str, float] = {category: 0.0 for category, _ in CATEGORIES} | {OTHER: 0.0}
    names: list[tuple[float, str]] = []
    for event in prof.key_averages():
        if on_cuda:
            if event.device_type != DeviceType.CUDA:
                continue
            us = event.self_device_time_total
        else:
            if event.device_type != DeviceType.CPU:
                continue
            us = event.self_cpu_time_total
        if us <= 0:
            continue
        totals[categorize(event.key)] += us / 1e3
        names.append((us / 1e3, event.key))
    names.sort(reverse=True)
    return {"ms": {k: v for k, v in totals.items() if v > 0}, "total_ms": sum(totals.values()),
            "measured": "CUDA kernels' device time" if on_cuda else "operators' self CPU time",
            "top": [{"name": name[:120], "category": categorize(name), "ms": ms} for ms, name in names[:12]]}


class StepProfiler:
    """torch.profiler over what runs between start() and stop() on device (CUDA kernels too on a GPU; the device
    synchronised at both ends, so the work queued before start is left out and the work queued before stop is in)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(activities=activities)
        self.started = False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        """Begin profiling."""
        self._sync()
        self.prof.start()
        self.started = True

    def stop(self) -> dict[str, Any] | None:
        """summarize() of what ran since start() (None when it never started)."""
        if not self.started:
            return None
        self._sync()
        self.prof.stop()
        self.started = False
        return summarize(self.prof, self.device.type == "cuda")


def profile_call(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """summarize() of one call of fn on device."""
    profiler = StepProfiler(device)
    profiler.start()
    fn()
    return profiler.stop()


class ProfiledFeed:
    """A trainer feed (next_step() -> a step's micro-batches) that starts a StepProfiler when step `at` (0-based)
    asks for its micro-batches; stop() ends it after the run and returns summarize()'s breakdown of that step (and
    whatever followed it in the run: make it the last step)."""

    def __init__(self, feed: Any, at: int, device: torch.device) -> None:
        self.feed, self.at, self.calls = feed, at, 0
        self.profiler = StepProfiler(device)

    def next_step(self) -> Any:
        """The wrapped feed's micro-batches; the profiler starts at step `at`."""
        if self.calls == self.at:
            self.profiler.start()
        self.calls += 1
        return self.feed.next_step()

    def stop(self) -> dict[str, Any] | None:
        """The profiled step's breakdown (None when the step was never reached)."""
        return self.profiler.stop()
