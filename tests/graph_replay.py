"""A CPU stand-in for CUDA graphs, for the tests of train.cuda_graphs (launch.train.graphs): ReplayGraphs is a graph
backend (launch.train.graphs.GraphBackend) whose capture records every aten operator its work issues and whose replay
re-executes those operators, in order, on the same tensor objects, never the Python that issued them.

What a CUDA graph does with fixed addresses, done with tensor objects:
- capture runs the work under a dispatch mode (_Recorder) that notes each operator with its arguments (tensors by
  object) and its outputs; a tensor the work mutates that existed before the capture is given its values back
  afterwards (a CUDA capture runs nothing: only the replays change memory outside the graph's pool);
- replay runs each noted operator again on the noted arguments: an in-place operator mutates its noted arguments
  again, an operator making fresh outputs has them copied into the noted output tensors (so every later operator
  that read them reads the new values), and a view operator is skipped (its noted output already aliases the
  storage of its input); the writes go through Tensor.data aliases, so they bump no autograd version counter (a
  CUDA replay writes memory behind autograd's back too: the backward graph captured over a forward graph's saved
  tensors, launch's pipeline graphs, accepts them after that forward's replays);
- a collective (an operator of c10d, e.g. the EP exchange's all_to_all_single) is re-issued at its place, and
  waited for before the next operator that is not a collective (consecutive ones in flight together, as the eager
  code issues them; what a captured NCCL collective does on its stream);
- capture refuses every host read (tests/syncs.py's SyncDetector, strict), as a CUDA capture refuses a
  synchronisation.

So Python-side state the work keeps (a counter, a list, an attribute rebound to a new tensor) is seen once, at the
capture, and never again: a replayed run differs from an eager one exactly where a CUDA-graphed run would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from tests.syncs import SyncDetector


def _storage(t: Tensor) -> int:
    """Identity of t's storage (held alive by the recording, so never reused)."""
    return t.untyped_storage()._cdata


@dataclass
class _Op:
    """One recorded operator call: what to run again and where its fresh outputs go."""

    func: Any
    args: tuple
    kwargs: dict
    fresh: list[tuple[int, Tensor]]  # (position among the flattened results, the recorded output tensor)
    runs: bool                       # False for a pure view: nothing to compute again
    collective: bool                 # a c10d operator: its works are waited for before the next other operator

    def replay(self, in_flight: list) -> None:
        """Run the operator again (in_flight: the works of the collectives issued since the last other operator)."""
        if not self.runs:
            return
        if not self.collective:
            _wait(in_flight)
        with torch.no_grad():  # on .data aliases: a replay bumps no autograd version counter, as on a GPU
            args, kwargs = tree_map_only(Tensor, _untracked, (self.args, self.kwargs))
            results, _ = tree_flatten(self.func(*args, **kwargs))
            for position, recorded in self.fresh:
                recorded.data.copy_(results[position])
        if self.collective:
            in_flight.extend(r for r in results if not isinstance(r, Tensor) and hasattr(r, "wait"))


def _untracked(t: Tensor) -> Tensor:
    """t's memory under a version counter of its own (Tensor.data): writes through it leave t's untouched."""
    return t.data


def _wait(works: list) -> None:
    for work in works:
        work.wait()
    works.clear()


class _Recorder(TorchDispatchMode):
    """Records every operator (see the module doc) and the pre-capture tensors it mutates, with their values."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.born: set[int] = set()  # storages of tensors the capture made
        self.saved: list[tuple[Tensor, Tensor]] = []  # (a pre-capture tensor mutated, its values before)
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        written = [value for arg, value in zip(schema.arguments, _bound(schema, args, kwargs))
                   if arg.alias_info is not None and arg.alias_info.is_write]
        for tensor in (t for value in written for t in tree_flatten(value)[0] if isinstance(t, Tensor)):
            if _storage(tensor) not in self.born and id(tensor) not in self._seen:
                self._seen.add(id(tensor))
                self.saved.append((tensor, tensor.detach().clone()))
        out = func(*args, **kwargs)
        fresh = []
        for position, (result, alias) in enumerate(_results(schema, out)):
            if isinstance(result, Tensor) and not alias:
                self.born.add(_storage(result))
                fresh.append((position, result))
        collective = func.namespace == "c10d"  # its schemas do not mark the buffers it writes
        self.ops.append(_Op(func, args, kwargs, fresh, bool(written or fresh) or collective, collective))
        return out

    def restore(self) -> None:
        """Give the pre-capture tensors the capture mutated their values back (latest first)."""
        with torch.no_grad():
            for tensor, before in reversed(self.saved):
                tensor.copy_(before)
        self.saved.clear()


def _results(schema, out: Any) -> list[tuple[Any, bool]]:
    """The call's flattened results, each with whether the schema says it aliases an argument (a view, or an
    in-place operator's self): one return (a tensor or a list of them) or a tuple of returns."""
    if not schema.returns:  # an operator returning nothing (it writes into its arguments)
        return []
    if len(schema.returns) == 1:
        alias = schema.returns[0].alias_info is not None
        return [(r, alias) for r in tree_flatten(out)[0]]
    return [(r, ret.alias_info is not None) for r, ret in zip(out, schema.returns)]


def _bound(schema, args: tuple, kwargs: dict) -> list[Any]:
    """The value of each schema argument in this call (positional, then by name, None when left out)."""
    return [args[i] if i < len(args) else kwargs.get(arg.name) for i, arg in enumerate(schema.arguments)]


class ReplayGraph:
    """A captured region: replay() runs its recorded operators again (see the module doc)."""

    def __init__(self, ops: list[_Op]) -> None:
        self.ops = ops

    def replay(self) -> None:
        in_flight: list = []
        for op in self.ops:
            op.replay(in_flight)
        _wait(in_flight)


class ReplayGraphs:
    """The graph backend of the tests: launch.train.graphs.GraphBackend, on any device, by recording and replaying
    operators. captures counts the regions captured, replays the replays run."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def warmup(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def capture(self, work: Callable[[], Any]) -> tuple[ReplayGraph, Any]:
        recorder = _Recorder()
        with SyncDetector(strict=True, capture=True), recorder:
            out = work()
        recorder.restore()
        self.captures += 1
        graph = ReplayGraph(recorder.ops)
        return _Counted(graph, self), out

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        yield


class _Counted:
    """A ReplayGraph whose replays its backend counts."""

    def __init__(self, graph: ReplayGraph, backend: ReplayGraphs) -> None:
        self.graph, self.backend = graph, backend

    def replay(self) -> None:
        self.backend.replays += 1
        self.graph.replay()
