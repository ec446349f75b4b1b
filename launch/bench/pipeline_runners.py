"""One training step per schedule for the benchmark: ours, torch.distributed.pipelining's, 1 process."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from launch.bench.pipeline_models import MoEBlock, mse, partition
from pipeline.overlap import OverlapSequential
from pipeline.runtime import AFAB, DualPipe, DualPipeV, OneFOneB, PipelineRuntime
from pipeline.schedules import COMPUTE_OPS

PER_CHUNK_W = "ours DualPipeV, W per chunk"  # merge_w=1 whatever the bench's --merge-w
OURS = ("ours DualPipeV", PER_CHUNK_W, "ours DualPipe", "ours 1F1B", "ours AFAB")
TORCH = ("torch DualPipeV", "torch ZBVZeroBubble", "torch 1F1B", "torch GPipe", "torch Interleaved1F1B")
LINEAR = {"ours 1F1B": OneFOneB, "ours AFAB": AFAB}  # one stage per rank


@dataclass
class Runner:
    """A schedule ready to step: step(x, target), its stage modules, and how to read its compute time."""

    step: Callable[[torch.Tensor, torch.Tensor], None]
    modules: list[nn.Module]
    pipe: PipelineRuntime | None = None  # ours: compute time from its timeline
    timed: float = 0.0  # others: seconds accumulated inside wrapped compute methods
    extra_bytes: Callable[[], int] = field(default=lambda: 0)

    def compute_seconds(self) -> float:
        """Seconds spent in compute so far (ours: in the last step)."""
        if self.pipe is not None:
            return sum(busy for act, *_, busy in self.pipe.timeline if act.op in COMPUTE_OPS)
        return self.timed

    def timer(self, fn: Callable) -> Callable:
        """fn, with its run time added to self.timed."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.timed += time.perf_counter() - t0
        return timed


def torch_runner(name: str, rank: int, world: int, layers: list[nn.Module], chunks: int) -> Runner:
    """One of torch.distributed.pipelining's schedules over the same layers."""
    from torch.distributed import pipelining as pp
    if name in ("torch 1F1B", "torch GPipe"):
        stage_ids, num_stages = [rank], world
    elif name == "torch Interleaved1F1B":
        stage_ids, num_stages = [rank, rank + world], 2 * world
    else:  # V-shaped placement
        stage_ids, num_stages = [rank, 2 * world - 1 - rank], 2 * world
    mods = partition(layers, num_stages)
    runner = Runner(step=lambda x, t: None, modules=[mods[s] for s in stage_ids])
    stages = []
    for sid in stage_ids:
        st = pp.PipelineStage(mods[sid], sid, num_stages, torch.device("cpu"))
        for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(st, meth, runner.timer(getattr(st, meth)))
        stages.append(st)
    cls = {"torch DualPipeV": pp.ScheduleDualPipeV, "torch ZBVZeroBubble": pp.ScheduleZBVZeroBubble,
           "torch 1F1B": pp.Schedule1F1B, "torch GPipe": pp.ScheduleGPipe,
           "torch Interleaved1F1B": pp.ScheduleInterleaved1F1B}[name]
    sched = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=chunks, loss_fn=mse)
    first, last = 0 in stage_ids, num_stages - 1 in stage_ids

    def step(x: torch.Tensor, target: torch.Tensor) -> None:
        sched.step(*((x,) if first else ()), **({"target": target, "losses": []} if last else {}))

    runner.step = step
    return runner


def our_runner(name: str, rank: int, world: int, layers: list[nn.Module], chunks: int, opts: dict,
               group: Any = None, ep_group: Any = None) -> Runner:
    """One of our schedules (OURS) over the same layers (group: the pipeline's ranks, default all; ep_group:
    spread the MoE blocks' experts over it)."""
    v, linear = name.startswith("ours DualPipeV"), LINEAR.get(name)
    num_stages = 2 * world if v else world
    mods = partition(layers, num_stages, OverlapSequential)
    if ep_group is not None:
        for block in (b for m in mods for b in m if isinstance(b, MoEBlock)):
            block.expert_parallel(ep_group)
    if linear is not None:
        pipe = linear((mods[rank],), group, split_bw=False)  # whole backwards, as torch's 1F1B and GPipe
    else:
        pipe = (DualPipeV if v else DualPipe)((mods[rank], mods[num_stages - 1 - rank]), group,
                                              split_bw=opts["split_bw"], overlap=opts["overlap"],
                                              merge_w=1 if name == PER_CHUNK_W else opts["merge_w"])

    def step(x: torch.Tensor, target: torch.Tensor) -> None:
        if linear is not None:
            inputs = (x,) if rank == 0 else ()
            labels = (target,) if rank == world - 1 else ()
        elif v:
            inputs, labels = ((x,), (target,)) if rank == 0 else ((), ())
        else:
            xs, ts = x.chunk(2), target.chunk(2)
            inputs, labels = {0: ((xs[0],), (ts[1],)), world - 1: ((xs[1],), (ts[0],))}.get(rank, ((), ()))
        pipe.timeline = []
        pipe.step(*inputs, num_chunks=chunks, criterion=mse, labels=labels)

    return Runner(step, list(pipe.module), pipe, extra_bytes=lambda: pipe.store.held_bytes)


def single_process(rank: int, layers: list[nn.Module], chunks: int) -> Runner:
    """The whole model on rank 0 alone, chunk by chunk (the 1-process reference); others idle."""
    model = nn.Sequential(*copy.deepcopy(layers))
    runner = Runner(step=lambda x, t: None, modules=[model])

    def step(x: torch.Tensor, target: torch.Tensor) -> None:
        if rank == 0:
            for xc, tc in zip(x.chunk(chunks), target.chunk(chunks)):
                mse(model(xc), tc).backward()

    runner.step = runner.timer(step)
    return runner
