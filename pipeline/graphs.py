"""CUDA graphs of a pipeline rank's actions (train.cuda_graphs with parallel.pp > 1, issue 48): each compute action
of the runtime (pipeline.runtime: a forward F, an input-grad backward B, a weight-grad pass W, a full backward, a
DualPipe F&B pair) on each (stage, chunk) is captured once and replayed at every later step of the same shapes.

The unit is a whole pipeline step (PipelineRuntime.step): ActionGraphs.step decides for all its actions at once,
warm-up (eager), capture or replay, so that a step's graphs are captured in the schedule's order and replayed in that
same order every later step. Capture and replay of an action are back to back (the capture runs nothing on a GPU,
the replay right after computes the capture step's values); the p2p sends and receives stay outside the graphs,
eager between replays: a received tensor is copied into its action's static input before the replay, and what an
action hands over (its static outputs, its static input grads) is sent after it.

Why several micro-batches in flight are safe: every (op, stage, chunk) has a graph of its own with its own static
inputs and outputs, so the saved activations of chunk c's forward live in memory that only chunk c's forward graph
writes; they are read by chunk c's backward graph (cross-graph autograd: B's graph was captured by running autograd
over the graph F's capture built, so it reads the tensors F's graph saved, and its input grads land in the .grad of
F's static input leaves, which B's replay rewrites). On a GPU every graph of the rank shares one memory pool: what a
capture frees (a backward releasing its forward's saved tensors) a later capture may reuse, which is safe because
the replays run in the capture's order, so no replay writes memory that a later replay still reads.

The B/W split: a captured B queues its deferred weight-grad closures (kernels.wgrad_defer) into the runtime's store
in Python, once, at the capture; the W action that runs them is captured as its own graph, which records each
closure's GEMMs once. A replayed B queues nothing (the store stays empty, its end-of-step check holds) and the
replayed W redoes exactly the recorded work: each deferred grad once per step, as eager.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dispatch.traffic import deferred, redo

WARMUP_STEPS = 1  # eager pipeline steps of a shape before its capture: each stage runs every chunk of it (>= 2)


class GraphStateError(RuntimeError):
    """A capture changed Python-side state that a replay would not change again (a parameter's .grad rebound)."""


def capture_keeping_grads(backend: Any, work: Callable[[], Any], params: dict[str, Tensor]) -> tuple[Any, Any, list]:
    """backend.capture(work) (a launch.train.graphs.GraphBackend) with the EP traffic counting deferred: (graph,
    work's static outputs, the counting to redo at each replay); GraphStateError when the captured work rebound the
    .grad of one of params (a replay accumulates into the tensors bound at the capture)."""
    before = {name: p.grad for name, p in params.items()}
    with deferred() as counting:
        graph, out = backend.capture(work)
    rebound = [name for name, p in params.items() if p.grad is not before[name]]
    if rebound:
        raise GraphStateError(f"the captured backward rebound the .grad of {', '.join(rebound[:3])}: a replay "
                              f"accumulates into the tensors bound at the capture, so every grad must exist "
                              f"(zero_grad(set_to_none=False)) and be accumulated in place")
    return graph, out, counting


@dataclass
class _Action:
    """One action's graph: its static inputs (copied into before each replay), its static outputs."""

    graph: Any
    inputs: list[Tensor]
    outputs: Any
    counting: list


@dataclass
class _StepSet:
    """The graphs of one pipeline-step shape, by action, and the loss scale they hold."""

    scale: float
    actions: dict[Hashable, _Action]


def _static(t: Tensor) -> Tensor:
    """A static input buffer like t (a leaf requiring grad where t does: a received activation)."""
    return t.detach().clone().requires_grad_(t.requires_grad)


class ActionGraphs:
    """The graphs of a pipeline rank's actions (the module doc), over a launch.train.graphs.GraphBackend; params: the
    rank's parameters by name, whose .grad a capture must leave bound."""

    def __init__(self, backend: Any, params: dict[str, Tensor], warmup: int = WARMUP_STEPS) -> None:
        self.backend, self.params, self.warmup = backend, params, warmup
        self.sets: dict[Hashable, _StepSet] = {}
        self.eager: Counter = Counter()  # warm-up steps run, by shape
        self._mode: str | None = None  # inside step(): "eager", "capture" or "replay"
        self._set: _StepSet | None = None

    @contextlib.contextmanager
    def step(self, key: Hashable, scale: float) -> Iterator[None]:
        """Around one PipelineRuntime.step whose inputs have shapes key and whose losses are scaled by scale: its
        actions (run) warm up, are captured or replayed, all alike. A step whose scale is not the captured one (a fault
        drill's) runs eagerly."""
        found = self.sets.get(key)
        warm = found is None and self.eager[key] < self.warmup
        if warm:
            self.eager[key] += 1
        elif found is None:
            found = self.sets[key] = _StepSet(scale, {})
        self._mode = "eager" if warm or found.scale != scale else "capture" if not found.actions else "replay"
        self._set = found
        try:
            with self.backend.warmup() if warm else contextlib.nullcontext():
                yield
        finally:
            self._mode, self._set = None, None

    @property
    def active(self) -> bool:
        """Whether the current step's actions go through graphs (captured or replayed)."""
        return self._mode in ("capture", "replay")

    def run(self, action: Hashable, work: Callable[..., Any], inputs: Sequence[Tensor]) -> Any:
        """work(*inputs)'s outputs (a pytree of tensors): run eagerly, or the action's graph captured (work run on
        static copies of inputs, in the step of the capture) and replayed with inputs copied into its static ones.
        work must do the same device work at every call; its Python runs at the capture only."""
        if not self.active:
            return work(*inputs)
        if self._mode == "capture":
            if action in self._set.actions:
                raise RuntimeError(f"action {action} captured twice in one pipeline step")
            statics = [_static(t) for t in inputs]
            graph, out, counting = capture_keeping_grads(self.backend, lambda: work(*statics), self.params)
            self._set.actions[action] = _Action(graph, statics, out, counting)
        captured = self._set.actions[action]
        with self.backend.replaying():
            with torch.no_grad():  # through .data: the backward graph captured over the static inputs (saved by the
                # forward: labels, a first layer's input) checks their autograd versions, which copies leave alone
                for static, t in zip(captured.inputs, inputs):
                    static.data.copy_(t)
            captured.graph.replay()
            redo(captured.counting)
        return captured.outputs

    def drop(self) -> None:
        """Forget every graph and warm-up count."""
        self.sets.clear()
        self.eager.clear()
