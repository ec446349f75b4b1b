"""A detector of host reads of tensor values, for the sync-free step's tests (issue 48).

Two kinds of read stop a GPU's host behind its stream, and both are seen here:
- Python-level ones: Tensor.item / tolist / numpy and the conversions bool(), int(), float(), operator.index()
  of a tensor. On a CPU tensor .tolist() and .numpy() read memory without issuing an operator, so no dispatch mode
  sees them: the detector wraps those methods while it is active.
- dispatch-level ones: operators whose result the host must wait for: a scalar read (aten._local_scalar_dense),
  an output sized by the data (nonzero, masked_select, unique, bincount, repeat_interleave without output_size,
  boolean-mask indexing), and copies from a non-CPU device to the CPU; and host data made into a tensor
  (torch.tensor / torch.as_tensor of Python numbers or lists: aten.lift_fresh), which on a GPU is an upload that
  synchronises (torch.tensor(data, device="cuda") copies from pageable memory and waits) and inside a CUDA graph
  would capture a host buffer the replays no longer have: a step's constants live on the device, made once.
Collectives taking their split sizes as Python lists (torch.distributed.all_to_all_single) count as a read too:
on a GPU those sizes came from the device. Meta tensors hold no values and are never counted.

On CUDA, SyncDetector also sets torch.cuda.set_sync_debug_mode("error") while active when strict, so that a
synchronising CUDA call the wrappers cannot see raises as well.

`with SyncDetector() as reads: ...` records every read (kind and the first project frame that made it) in
reads.reads; SyncDetector(strict=True) raises HostRead at the first one, with the stack of the read;
SyncDetector(capture=True) (a CUDA graph's capture, tests/graph_replay.py) also counts every upload EXEMPT_UPLOADS
otherwise lets pass.
step_reads() watches a training run (launch.train.loop.train) step by step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

PYTHON_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique2",
            "aten.unique_consecutive", "aten.unique_dim", "aten.bincount",
            "aten.lift_fresh"}  # torch.tensor / as_tensor of host data: an upload (see the module doc)
MASK_OPS = {"aten.index", "aten.index_put", "aten.index_put_"}  # with a boolean mask: a nonzero inside
# host data made a tensor that is no wait on a GPU (outside a CUDA graph's capture, where every upload is refused):
# a constant made once per value and device and cached (dispatch.layout.device_index: the first use uploads, no step
# after), and values queued from pinned memory (dispatch.upload.upload)
EXEMPT_UPLOADS = {("dispatch/layout.py", "device_index"), ("dispatch/upload.py", "upload")}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HERE = os.path.abspath(__file__)


class HostRead(RuntimeError):
    """A strict SyncDetector saw the host read a tensor's values."""


@dataclass(frozen=True)
class Read:
    """One host read: its kind (a Tensor method, an aten operator, or a collective's list splits) and where."""

    kind: str
    where: str  # "path:line in function" of the innermost project frame outside this file


def _frame() -> tuple[str, int, str] | None:
    """(path relative to the project, line, function) of the innermost frame of the project (outside this file and
    outside torch) on the current stack (walked without reading source lines: a watched step reads hundreds of times
    on the exact exchange)."""
    for frame, lineno in traceback.walk_stack(sys._getframe(1)):
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(ROOT) and path != _HERE:
            return os.path.relpath(path, ROOT), lineno, frame.f_code.co_name
    return None


def _where() -> str:
    """_frame() as "path:line in function"."""
    found = _frame()
    return "?" if found is None else f"{found[0]}:{found[1]} in {found[2]}"


def _has_values(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_meta


_UNSEEN = object()
_SUSPECTS: dict[Any, str | None] = {}  # operator overload -> its name if it can read the host (_suspect), else None


def _suspect(func) -> str | None:
    """The name _is_read classifies an operator overload by, or None for the operators that never read the host (most
    of them: the watched steps skip those at the cost of a dict lookup)."""
    name = str(func.overloadpacket)
    if name == "aten.repeat_interleave":
        return str(func)
    return name if name in SYNC_OPS or name in MASK_OPS or name in ("aten._to_copy", "aten.copy_") else None


class SyncDetector(TorchDispatchMode):
    """Records (or, strict, refuses) every host read of tensor values while active; see the module docstring."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: no torch.compile runs under the detector, so __torch_dispatch__ goes without the wrapper that keeps
        Dynamo out of it (a third of a watched step's time otherwise)."""
        return False

    def __init__(self, strict: bool = False, capture: bool = False) -> None:
        super().__init__()
        self.strict, self.capture = strict, capture
        self.reads: list[Read] = []
        self._inside = 0  # > 0 inside a wrapped Python-level read: its operators are that read, not another one
        self._saved: dict[str, Callable] = {}
        self._cuda_mode: int | None = None

    def record(self, kind: str) -> None:
        """Count a read of kind here (strict: raise HostRead)."""
        read = Read(kind, _where())
        if self.strict:
            raise HostRead(f"host read {kind} at {read.where}")
        self.reads.append(read)

    def kinds(self) -> list[tuple[str, str]]:
        """The reads as (kind, where) pairs, in order."""
        return [(r.kind, r.where) for r in self.reads]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _SUSPECTS.get(func, _UNSEEN)
        if name is _UNSEEN:  # first sight of this overload: is it ever a read?
            name = _SUSPECTS[func] = _suspect(func)
        if name is not None and not self._inside and self._is_read(name, args, kwargs, self.capture):
            self.record(str(func.overloadpacket))
        return func(*args, **kwargs)

    @staticmethod
    def _is_read(name: str, args: tuple, kwargs: dict, capture: bool) -> bool:
        if not any(_has_values(a) for a in args):
            return False
        if name == "aten.lift_fresh":  # host data made a tensor: an upload, unless one of EXEMPT_UPLOADS
            found = _frame()
            return capture or found is None or (found[0], found[2]) not in EXEMPT_UPLOADS
        if name in SYNC_OPS:
            return True
        if name.startswith("aten.repeat_interleave"):  # tensor repeats without output_size: sized by the data
            tensor_repeats = name.endswith((".Tensor", ".self_Tensor"))
            return tensor_repeats and kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
        if name in MASK_OPS:
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if name in ("aten._to_copy", "aten.copy_"):
            source = args[1] if name == "aten.copy_" else args[0]
            target = args[0].device.type if name == "aten.copy_" else str(kwargs.get("device", source.device))
            return source.device.type not in ("cpu", "meta") and target.startswith("cpu")
        return False

    def _wrapped(self, name: str, method: Callable) -> Callable:
        def read(tensor, *args, **kwargs):
            if _has_values(tensor) and not self._inside:
                self.record(f"Tensor.{name}")
            self._inside += 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._inside -= 1
        return read

    def _all_to_all_single(self, original: Callable) -> Callable:
        def exchange(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
            if (output_split_sizes is not None or input_split_sizes is not None) and _has_values(input):
                self.record("all_to_all_single(list splits)")
            return original(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)
        return exchange

    def __enter__(self):
        self._saved = {name: torch.Tensor.__dict__.get(name) for name in PYTHON_READS}  # None: inherited
        for name in PYTHON_READS:
            setattr(torch.Tensor, name, self._wrapped(name, getattr(torch.Tensor, name)))
        self._collective = dist.all_to_all_single
        dist.all_to_all_single = self._all_to_all_single(self._collective)
        if self.strict and torch.cuda.is_available() and torch.cuda.is_initialized():
            self._cuda_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
        dist.all_to_all_single = self._collective
        if self._cuda_mode is not None:
            torch.cuda.set_sync_debug_mode(self._cuda_mode)
            self._cuda_mode = None
        return super().__exit__(*exc)


@dataclass
class StepReads:
    """One forward + backward of a training step (a step, or each attempt of a step rerun after an overflow)."""

    reads: list[Read] | None = field(default_factory=list)  # host reads in the forward and backward (None: unwatched)
    copies: int = 0  # device-to-host copies of the step's statistics (launch.parallel.device.to_host calls)


@contextlib.contextmanager
def step_reads(detect: bool = True) -> Iterator[list[StepReads]]:
    """While active, each forward and backward of the trainer's steps (launch.train.loop's forward_backward) runs
    under a SyncDetector, and each launch.train.step.to_host call after it (the step's statistics) counts as a copy
    of that attempt, but for the per-rank metrics' gather (gather_rank_rows: every train.rank_metrics_every steps,
    excepted) and the held-out evaluation; yields the list of StepReads, one appended per forward and backward.
    detect=False counts the attempts and their copies only (no SyncDetector, whose dispatch mode doubles a small
    step's time): each StepReads' reads is then None."""
    from launch.train import loop, step  # the trainer, imported only where a test watches it

    attempts: list[StepReads] = []
    excepted = [0]
    to_host, forward_backward = step.to_host, loop.forward_backward

    def watched(*args, **kwargs):
        with SyncDetector() if detect else contextlib.nullcontext() as detector:
            out = forward_backward(*args, **kwargs)
        attempts.append(StepReads(detector.reads if detect else None))
        return out

    def copy(tensor):
        if not excepted[0] and attempts:
            attempts[-1].copies += 1
        return to_host(tensor)

    def excepting(original: Callable) -> Callable:
        def run(*args, **kwargs):
            excepted[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                excepted[0] -= 1
        return run

    with mock.patch.object(loop, "forward_backward", watched), mock.patch.object(step, "to_host", copy), \
            mock.patch.object(step, "gather_rank_rows", excepting(step.gather_rank_rows)), \
            mock.patch.object(loop, "evaluate", excepting(loop.evaluate)):
        yield attempts
