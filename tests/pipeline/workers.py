"""Functions run on spawned ranks by the pipeline tests (module level so they pickle)."""

from __future__ import annotations

import copy
import os
from typing import Callable
from unittest import mock

import torch
import torch.distributed as dist

from pipeline import DualPipe, DualPipeV
from tests.pipeline.models import ContextStage, criterion, make_data, make_stages

HIDDEN, BATCH = 16, 32


def in_turn(rank: int, world: int, calls: list[tuple[Callable, tuple, dict[str, str]]]) -> list:
    """fn(rank, world, *args) of each (fn, args, environment variables it runs with) in turn: several tests' runs in
    one spawn."""
    out = []
    for fn, args, env in calls:
        with mock.patch.dict(os.environ, env):
            out.append(fn(rank, world, *args))
    return out


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


def equivalence(rank: int, world: int, kind: str, stage_kinds: tuple[str, ...], num_chunks: int,
                merge_w: int = 1) -> dict:
    """equivalence_one for each stage kind (one process spawn for all of them)."""
    return {sk: equivalence_one(rank, world, kind, sk, num_chunks, merge_w) for sk in stage_kinds}


def equivalence_one(rank: int, world: int, kind: str, stage_kind: str, num_chunks: int, merge_w: int = 1) -> dict:
    """fp32 losses, float64 grads per held stage and forward-only outputs of one pipeline step."""
    cls = DualPipe if kind == "dualpipe" else DualPipeV
    held = placement(kind, rank, world)
    num_stages = world if kind == "dualpipe" else 2 * world
    result = {"held": held}
    for dtype in (torch.float32, torch.float64):
        stages = make_stages(stage_kind, num_stages, HIDDEN, dtype)
        pipe = cls((copy.deepcopy(stages[held[0]]), copy.deepcopy(stages[held[1]])), merge_w=merge_w)
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


def _watched(pipe: torch.nn.Module, stage_kind: str) -> list[torch.nn.Parameter]:
    """Weights whose accumulation bw_split records: the Linear weights of MLP stages, the grouped
    expert weights (w_gate_up, w_down) of MoE stages."""
    if stage_kind == "mlp":
        return [m.weight for m in pipe.modules() if isinstance(m, torch.nn.Linear)]
    from moe.experts import GroupedExperts
    return [w for m in pipe.modules() if isinstance(m, GroupedExperts) for w in (m.w_gate_up, m.w_down)]


def bw_split(rank: int, world: int, num_chunks: int, stage_kind: str = "mlp", merge_w: int = 1) -> dict:
    """Which action kinds accumulate the watched weight grads (see _watched), with the B/W split on
    (W actions over merge_w chunks) and off; and all grads. float64, float32 for FP8 experts (they
    take float32 at most)."""
    dtype = torch.float32 if stage_kind == "moe-fp8" else torch.float64
    out = {}
    for split_bw in (True, False):
        stages = make_stages(stage_kind, 2 * world, HIDDEN, dtype)
        held = placement("dualpipev", rank, world)
        pipe = DualPipeV((copy.deepcopy(stages[held[0]]), copy.deepcopy(stages[held[1]])), split_bw=split_bw,
                         merge_w=merge_w if split_bw else 1)
        seen: list[tuple[str, bool]] = []
        last: dict[int, torch.Tensor] = {}

        def record(p: torch.Tensor) -> None:  # the hook also fires with no grad to add: skip those
            if p.grad is not None and not torch.equal(p.grad, last.get(id(p), torch.zeros_like(p))):
                seen.append((pipe.current_action.op.value, pipe.current_action.split))
                last[id(p)] = p.grad.clone()

        for weight in _watched(pipe, stage_kind):
            weight.register_post_accumulate_grad_hook(record)
        inputs, labels = rank_inputs("dualpipev", rank, world, make_data(BATCH, HIDDEN, dtype))
        loss, _ = pipe.step(*inputs, num_chunks=num_chunks, criterion=criterion, labels=labels)
        w_actions = sum(a.op.value == "W" for a in pipe.schedule(num_chunks).actions[rank])
        out[split_bw] = {"seen": seen, "loss": loss, "w_actions": w_actions,
                         "grads": [p.grad for p in pipe.parameters()]}
    return out


def _error(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def bad_inputs(rank: int, world: int) -> dict[str, str]:
    """Messages of the errors raised for bad constructor/step arguments on one rank."""
    stages = make_stages("mlp", 2, HIDDEN, torch.float32)
    x, skip, label = make_data(BATCH, HIDDEN, torch.float32)
    pipe = DualPipeV(tuple(stages))
    step = lambda chunks, t=x: pipe.step(t, skip, num_chunks=chunks, criterion=criterion, labels=(label,))
    return {
        "odd_ranks": _error(lambda: DualPipe(tuple(stages))),
        "modules": _error(lambda: DualPipeV((stages[0],))),
        "few_chunks": _error(lambda: step(1)),
        "indivisible": _error(lambda: step(3, x)),
        "missing_inputs": _error(lambda: pipe.step(num_chunks=4, criterion=criterion, labels=(label,))),
        "merge_w": _error(lambda: DualPipeV(tuple(stages), merge_w=0)),
        "merge_w_unsplit": _error(lambda: DualPipeV(tuple(stages), split_bw=False, merge_w=2)),
    }


def ep_overlap(rank: int, world: int, num_chunks: int) -> dict:
    """Each rank runs its own 1-rank DualPipeV; the ranks form the EP group of the toy blocks.
    Returns, with overlap on and off: losses, grads and the order of comm vs backward events."""
    from tests.pipeline.models import AllToAllBlock
    from pipeline.overlap import OverlapSequential
    groups = [dist.new_group([r]) for r in range(world)]
    own = groups[rank]
    out = {}
    for overlap in (True, False):
        log: list[str] = []
        torch.manual_seed(0)
        stages = [OverlapSequential(AllToAllBlock(HIDDEN, dist.group.WORLD, log), torch.nn.Tanh()).double()
                  for _ in range(2)]
        pipe = DualPipeV(tuple(stages), process_group=own, overlap=overlap)
        for m in pipe.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.register_hook(lambda g: log.append("backward") or g)
        g = torch.Generator().manual_seed(10 + rank)
        x = torch.randn(BATCH, HIDDEN, generator=g, dtype=torch.float64)
        label = torch.randn(BATCH, HIDDEN, generator=g, dtype=torch.float64)
        pipe.timeline = []
        loss, _ = pipe.step(x, num_chunks=num_chunks, criterion=lambda o, l: ((o - l) ** 2).mean(), labels=(label,))
        out[overlap] = {"loss": loss, "grads": [p.grad for p in pipe.parameters()], "log": log,
                        "pairs": sum(a.op.value == "FB" for a, *_ in pipe.timeline), "shares": pipe.forward_shares}
    return out


def p2p_messages(rank: int, world: int) -> list:
    """Rank 0 sends tensor lists whose shapes, dtypes and counts change; rank 1 returns what it got
    (receives are posted several messages ahead, as the runtime does)."""
    from pipeline.p2p import P2PChannel
    ch = P2PChannel(dist.group.WORLD, torch.device("cpu"))
    messages = sent_messages()
    if rank == 0:
        for msg in messages:
            ch.send(msg, 1, stream=3)
        ch.wait_sends()
        return []
    tickets = [ch.post_recv(0, stream=3) for _ in messages]
    return [[(t.clone(), flag) for t, flag in ch.finish_recv(tk, 0, stream=3)] for tk in tickets]


def sent_messages() -> list[list[torch.Tensor]]:
    """The messages p2p_messages sends: same size twice, then new shapes, dtypes, counts, views."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 6, generator=g)
    return [[a], [a * 2], [a.t(), torch.arange(5)], [a[:, :3].to(torch.float64), torch.ones(2, dtype=torch.bool)],
            [], [a.to(torch.bfloat16).requires_grad_()], [a[1:3]]]


def p2p_both_ways(rank: int, world: int, count: int = 40) -> list:
    """Both ranks post every receive first, then send `count` messages of changing shapes, dtypes and
    counts on two streams at once; each returns what it got per stream."""
    from pipeline.p2p import P2PChannel
    ch = P2PChannel(dist.group.WORLD, torch.device("cpu"))
    peer = 1 - rank
    tickets = [(i % 2, ch.post_recv(peer, stream=i % 2)) for i in range(count)]
    for i, msg in enumerate(mixed_messages(rank, count)):
        ch.send(msg, peer, stream=i % 2)
    got = [[(t.clone(), flag) for t, flag in ch.finish_recv(tk, peer, stream)] for stream, tk in tickets]
    ch.wait_sends()
    return got


def mixed_messages(rank: int, count: int) -> list[list[torch.Tensor]]:
    """Messages of rank: sizes repeat or change, dtypes mixed, odd-sized tensors before wide ones
    (unaligned starts), non-contiguous and 0-dim tensors."""
    g = torch.Generator().manual_seed(10 + rank)
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.int8)
    out = []
    for i in range(count):
        rows = 1 + (i // 3) % 4  # every size a few times in a row
        msg = [torch.randn(rows, 5, generator=g).t(), torch.randint(0, 2, (3,), generator=g, dtype=torch.int8)]
        msg += [torch.randn(rows, 3, generator=g).to(dtypes[(i + k) % len(dtypes)]) for k in range(i % 3)]
        msg.append(torch.tensor(float(i), dtype=torch.float64))
        out.append(msg)
    return out


def p2p_fixed(rank: int, world: int, count: int = 12) -> dict:
    """Both ranks use a channel told its messages' layout (an fp32 [2, 3, 4] and an int8 [5]): each posts
    its receives, sends `count` messages both ways, and returns what arrived, the posted buffers' sizes and
    the error a message of another shape raises."""
    from pipeline.p2p import P2PChannel, TensorMeta
    ch = P2PChannel(dist.group.WORLD, torch.device("cpu"))
    ch.fixed = [TensorMeta(torch.float32, True, (2, 3, 4)), TensorMeta(torch.int8, True, (5,))]
    peer, g = 1 - rank, torch.Generator().manual_seed(rank)
    tickets = [ch.post_recv(peer, stream=0) for _ in range(count)]
    sizes = [tickets[0].pending.buffers[0].numel()]  # the posted receive buffer
    for _ in range(count):
        ch.send([torch.randn(2, 3, 4, generator=g), torch.randint(-9, 9, (5,), generator=g, dtype=torch.int8)], peer, 0)
    got = [[(t.clone(), flag) for t, flag in ch.finish_recv(tk, peer, 0)] for tk in tickets]
    ch.wait_sends()
    try:
        ch.send([torch.zeros(2, 3, 5), torch.zeros(5, dtype=torch.int8)], peer, 0)
        error = ""
    except ValueError as e:
        error = str(e)
    return {"got": got, "sizes": sizes, "error": error}


def context_stages(num_stages: int) -> list[ContextStage]:
    """float64 ContextStages of one seed."""
    torch.manual_seed(0)
    return [ContextStage(HIDDEN).double() for _ in range(num_stages)]


def with_context(rank: int, world: int, num_chunks: int) -> dict:
    """DualPipeV over context_stages, every stage given each chunk's rows of a context tensor (step(context=)):
    losses (rank 0) and the grads of the held stages."""
    held = placement("dualpipev", rank, world)
    stages = context_stages(2 * world)
    pipe = DualPipeV((stages[held[0]], stages[held[1]]))
    data = make_data(BATCH, HIDDEN, torch.float64)
    scale = torch.arange(1, BATCH + 1, dtype=torch.float64).unsqueeze(1) / BATCH
    inputs, labels = rank_inputs("dualpipev", rank, world, data)
    loss, _ = pipe.step(*inputs, num_chunks=num_chunks, criterion=criterion, labels=labels, context=(scale,))
    return {"held": held, "loss": loss, "grads": [[p.grad for p in m.parameters()] for m in pipe.module]}
