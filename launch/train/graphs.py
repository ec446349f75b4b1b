"""CUDA graphs of the training step (train.cuda_graphs, issue 48): with pp = 1, each micro-batch's forward, loss and
backward is captured once per input shape and replayed for every later micro-batch of that shape; with a pipeline,
each compute action of the runtime on each stage and chunk (pipeline.graphs.ActionGraphs, StepGraphs.pipeline, under
the same backend and the same rules below).

StepGraphs is the capture logic, the same under every graph backend (GraphBackend): CudaGraphs on a GPU
(torch.cuda.CUDAGraph, one private memory pool for every graph of the rank, the warm-up on a side stream), and in the
tests a CPU simulator that records and replays aten operators on the same tensor objects (tests/graph_replay.py).

For each micro-batch shape (tokens and labels): the first WARMUP_MICRO_BATCHES micro-batches run eagerly inside the
backend's warm-up (on CUDA a side stream: Triton autotuning, cuBLAS workspaces and other lazy buffers are made
there, not in the capture); the next one is captured into static buffers (its tokens and labels, read by the
captured work, which makes the document ids and the masked labels from them on the device) and replayed; every
later one is copied into those buffers and replayed, and its LM loss read from the static output. The captured
region holds no host read (the step is sync-free: tests/syncs.py); over EP ranks it holds the padded exchange's
all-to-alls, and the EP byte counters (host numbers the Python of the exchange adds up) are logged at the capture
and added at each replay (dispatch.traffic.deferred and redo).

What a replay redoes is device work only, on the same memory: everything the forward and backward change across
micro-batches must be a tensor updated in place. The grads accumulate into the .grad tensors that exist (the
trainer zeroes them with set_to_none=False: ZeRO's flat buffers), and a capture that rebinds a parameter's .grad
is refused (GraphStateError); the routing tallies are zeroed in place (launch.parallel.stages.Stage.reset_tallies),
the expert bias is updated in place (moe.router.TopKRouter.update_bias), the padded exchange's overflow flag is set in
place (dispatch.EPDispatcher.take_overflow reads it with the step's statistics), and the FP8 weight blocks are quantised
inside each FP8 linear's forward and backward (kernels.linear: no cache across micro-batches), so a replay
quantises the current weights. ZeRO's reduction does not overlap a captured backward: it runs after the
micro-batches (ZeroOptimizer.clip_grad_norm_), and parallel.overlap_grad_reduce is not used by a graphed step.

A micro-batch whose loss scale is not the captured one (a fault drill's step, launch.faults.guard) runs eagerly; so
do the held-out evaluation and the exact rerun of a step whose padded exchange overflowed, after which drop() forgets
every graph (the grown bounds change the exchange's shapes: the next micro-batches warm up and capture again); a
rollback's checkpoint load drops them too. check_graphable refuses, before any process starts
(launch.train.preflight), the layouts whose step is not captured yet: TP and CP regions, redundant
experts, ZeRO-2 and -3 (the exact EP exchange is refused by launch.config.checks: it reads its sizes).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from dispatch.traffic import redo
from launch.config.run import RunConfig
from launch.parallel.stages import Stage
from pipeline.graphs import ActionGraphs, GraphStateError, capture_keeping_grads

__all__ = ["CudaGraphs", "GraphBackend", "GraphStateError", "StepGraphs", "check_graphable", "step_graphs"]

WARMUP_MICRO_BATCHES = 2  # eager micro-batches of a shape before its capture


class Graph(Protocol):
    """A captured region."""

    def replay(self) -> None:
        """Run the captured work again on the same memory."""


class GraphBackend(Protocol):
    """How regions are captured and replayed on a device."""

    def warmup(self) -> contextlib.AbstractContextManager:
        """Around the eager micro-batches before a capture."""

    def capture(self, work: Callable[[], Any]) -> tuple[Graph, Any]:
        """Capture work() (its device work recorded, none of it run: only a replay changes memory outside the
        graph's own); return the graph and work's outputs (static tensors that every replay rewrites)."""

    def replaying(self) -> contextlib.AbstractContextManager:
        """Around each graphed micro-batch (its copies in, its replay, its loss read)."""


class CudaGraphs:
    """GraphBackend on a CUDA device: torch.cuda.CUDAGraph captures sharing one private memory pool (safe: graphs are
    replayed one at a time and each one's static output is read before the next replay; a pipeline's graphs, whose
    outputs live on, are replayed in their capture's order: pipeline.graphs), the warm-up on a side
    stream; sync_check: every graphed micro-batch runs under torch.cuda.set_sync_debug_mode("error"), so a
    synchronising call there raises (kernels.gpu_check's graphed step asks for it)."""

    def __init__(self, device: torch.device, sync_check: bool = False) -> None:
        if device.type != "cuda":
            raise ValueError(f"train.cuda_graphs = true captures CUDA graphs, but this rank computes on {device}")
        self.device, self.sync_check = device, sync_check
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            yield
        current.wait_stream(self.side)

    def capture(self, work: Callable[[], Any]) -> tuple[Graph, Any]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the capturing thread may make no unsafe CUDA call, while the data feed's prefetch thread
        # (launch.data.feed: it pins host memory) goes on; a sync on the captured stream fails in any mode
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = work()
        return graph, out

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        if not self.sync_check:
            yield
            return
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)


@dataclass
class _Captured:
    """One micro-batch shape's graph: its static inputs, its static LM-loss output, the loss scale it holds."""

    graph: Graph
    inputs: Tensor
    labels: Tensor
    lm: Tensor
    scale: float
    counting: list  # the EP traffic counting of the captured work, redone at each replay (dispatch.traffic.deferred)


Work = Callable[[Tensor, Tensor], Tensor]  # (tokens, labels) -> the micro-batch's LM loss, after its backward


class StepGraphs:
    """Micro-batches of the step run through graphs of a backend (the module doc); params: the rank's parameters by
    name, whose .grad a capture must leave bound where it found them."""

    def __init__(self, backend: GraphBackend, params: dict[str, nn.Parameter],
                 warmup: int = WARMUP_MICRO_BATCHES) -> None:
        self.backend, self.params, self.warmup = backend, params, warmup
        self.graphs: dict[tuple, _Captured] = {}
        self.eager: Counter = Counter()  # warm-up micro-batches run, by shape
        self.pipeline = ActionGraphs(backend, params)  # with pp > 1: the runtime's actions (pipeline.graphs)

    def micro_batch(self, work: Work, inputs: Tensor, labels: Tensor, scale: float) -> Tensor:
        """work(inputs, labels) (forward, loss scaled by scale, backward; its LM loss returned): eagerly while the
        shape warms up, else replayed (captured first). work must do the same device work at every call: its
        Python runs at the capture only."""
        key = (tuple(inputs.shape), inputs.dtype, tuple(labels.shape), labels.dtype)
        captured = self.graphs.get(key)
        if captured is None and self.eager[key] < self.warmup:
            self.eager[key] += 1
            with self.backend.warmup():
                return work(inputs, labels)
        if captured is None:
            captured = self.graphs[key] = self._capture(work, inputs, labels, scale)
        if captured.scale != scale:
            return work(inputs, labels)
        with self.backend.replaying():
            captured.inputs.copy_(inputs)
            captured.labels.copy_(labels)
            captured.graph.replay()
            redo(captured.counting)
            return captured.lm

    def _capture(self, work: Work, inputs: Tensor, labels: Tensor, scale: float) -> _Captured:
        static_inputs, static_labels = inputs.clone(), labels.clone()
        graph, lm, counting = capture_keeping_grads(self.backend, lambda: work(static_inputs, static_labels),
                                                    self.params)
        return _Captured(graph, static_inputs, static_labels, lm, scale, counting)

    def drop(self) -> None:
        """Forget every graph and warm-up count (the exchange's shapes changed: shapes warm up and capture again),
        the pipeline's too."""
        self.graphs.clear()
        self.eager.clear()
        self.pipeline.drop()


def check_graphable(cfg: RunConfig) -> None:
    """Raise ValueError naming the keys when train.cuda_graphs is on for a layout whose step cannot be captured yet
    (before any process starts: launch.train.preflight; and again when the trainer builds its graphs)."""
    if not cfg.train.cuda_graphs:
        return
    par, optim = cfg.parallel, cfg.optim
    regions = [f"parallel.{key} = {getattr(par, key)}" for key in ("tp", "cp") if getattr(par, key) > 1]
    refusals = [
        (bool(regions), f"{', '.join(regions)}: the TP and CP regions' collectives are not captured yet",
         "parallel.tp = parallel.cp = 1"),
        (par.redundant_experts > 0, f"parallel.redundant_experts = {par.redundant_experts}: each placement of the "
                                    f"spare slots binds new slot tables", "parallel.redundant_experts = 0"),
        (optim.zero_stage >= 2, f"optim.zero_stage = {optim.zero_stage}: ZeRO-2 frees and re-allocates grad buffers "
                                f"inside the backward and ZeRO-3 gathers parameters inside the forward",
         "optim.zero_stage = 1"),
    ]
    for refused, why, allowed in refusals:
        if refused:
            raise ValueError(f"train.cuda_graphs = true cannot capture this step yet: {why}; allowed: {allowed}, or "
                             f"train.cuda_graphs = false")


def step_graphs(cfg: RunConfig, stages: list[Stage], device: torch.device,
                backend: GraphBackend | None = None) -> StepGraphs | None:
    """The graphs of this rank's step when train.cuda_graphs is on (check_graphable first), over backend (default:
    CudaGraphs on device); None when it is off, and in a rehearsal on the meta device (no memory to capture: its
    steps run eagerly)."""
    if not cfg.train.cuda_graphs or device.type == "meta":
        return None
    check_graphable(cfg)
    params = {f"stage {s}: {name}": p for s, stage in enumerate(stages) for name, p in stage.named_parameters()}
    return StepGraphs(backend or CudaGraphs(device), params)
