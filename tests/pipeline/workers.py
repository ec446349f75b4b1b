"""Functions run on spawned ranks by the pipeline tests (module level so they pickle)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from pipeline import DualPipe, DualPipeV
from tests.pipeline.models import criterion, make_data, make_stages

HIDDEN, BATCH = 16, 32


def placement(kind: str, rank: int, world: int) -> tuple[int, int]:
    """Stage indices (m0, m1) held by rank for DualPipe ('dualpipe') or DualPipeV."""
    stages = world if kind == "dualpipe" else 2 * world
    return rank, stages - 1 - rank


def rank_inputs(kind: str, rank: int, world: int, data: tuple) -> tuple[tuple, tuple]:
    """(inputs, labels) this rank passes to step(), in DualPipe's convention."""
    x, skip, label = data
    if kind == "dualpipev":
        return ((x, skip), (label,)) if rank == 0 else ((), ())
    halves = [t.chunk(2) for t in data]
    if rank == 0:
        return (halves[0][0], halves[1][0]), (halves[2][1],)
    if rank == world - 1:
        return (halves[0][1], halves[1][1]), (halves[2][0],)
    return (), ()


def equivalence(rank: int, world: int, kind: str, stage_kind: str, num_chunks: int, split_bw: bool) -> dict:
    """fp32 losses, float64 grads per held stage and forward-only outputs of one pipeline step."""
    cls = DualPipe if kind == "dualpipe" else DualPipeV
    held = placement(kind, rank, world)
    num_stages = world if kind == "dualpipe" else 2 * world
    result = {"held": held}
    for dtype in (torch.float32, torch.float64):
        stages = make_stages(stage_kind, num_stages, HIDDEN, dtype)
        pipe = cls((copy.deepcopy(stages[held[0]]), copy.deepcopy(stages[held[1]])), split_bw=split_bw)
        inputs, labels = rank_inputs(kind, rank, world, make_data(BATCH, HIDDEN, dtype))
        loss, outputs = pipe.step(*inputs, num_chunks=num_chunks, criterion=criterion, labels=labels,
                                  return_outputs=True)
        result[dtype] = {"loss": loss, "outputs": outputs,
                         "grads": [[p.grad for p in m.parameters()] for m in pipe.module]}
        with torch.no_grad():
            result[dtype]["fwd_loss"], result[dtype]["fwd_outputs"] = pipe.step(
                *inputs, num_chunks=num_chunks, criterion=criterion, labels=labels, return_outputs=True)
        dist.barrier()
    return result
