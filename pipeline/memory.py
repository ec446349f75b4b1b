"""The project's one activation meter: peak bytes held for backward, through saved-tensor hooks (CPU has no
allocator stats). Used by the pipeline, TP and CP benchmarks and by `moe-plan --measure`."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def _storage(t: Tensor) -> torch.UntypedStorage:
    """The storage a (possibly distributed) tensor's bytes live in on this rank."""
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


class SavedTensorMeter:
    """Peak bytes of distinct storages autograd keeps saved at once, plus extra bytes reported by `extra()`.

    Activations only: storages of `params` (and any nn.Parameter) are left out; a DTensor counts its local shard;
    a storage saved by several ops counts once. Inside `region(modules)` the bytes newly saved also add to
    `region_bytes` (what a set of modules saves, e.g. the sequence-parallel norms)."""

    def __init__(self, extra: Callable[[], int] = lambda: 0, params: Iterable[Tensor] = ()) -> None:
        self.extra = extra
        self.params = {_storage(p).data_ptr() for p in params}
        self.refs: dict[int, list[int]] = {}  # storage ptr -> [saved tensors holding it, nbytes]
        self.live = self.peak = self.region_bytes = 0
        self._depth = 0

    def _pack(self, t: Tensor) -> Any:
        storage = _storage(t)
        ptr = storage.data_ptr()
        if isinstance(t, nn.Parameter) or ptr in self.params or not storage.nbytes():
            return t
        ref = self.refs.setdefault(ptr, [0, storage.nbytes()])
        if ref[0] == 0:
            self.live += ref[1]
            self.region_bytes += ref[1] if self._depth else 0
        ref[0] += 1
        self.peak = max(self.peak, self.live + self.extra())
        # a detached alias: saving an op's own output with its grad_fn would make a reference cycle that outlives
        # a branch whose backward never runs (a router loss with a zero coefficient)
        return _Held(t.detach(), ptr, self)

    def release(self, ptr: int) -> None:
        """A saved tensor was dropped by its graph."""
        ref = self.refs[ptr]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[ptr]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Context that routes saved tensors through this meter."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    @contextmanager
    def region(self, modules: Iterable[nn.Module]) -> Iterator[SavedTensorMeter]:
        """While active, bytes saved inside any of `modules`' forwards also count in region_bytes."""
        with ExitStack() as stack:
            for m in modules:
                stack.callback(m.register_forward_pre_hook(self._enter).remove)
                stack.callback(m.register_forward_hook(self._leave).remove)
            yield self

    def _enter(self, *_: Any) -> None:
        self._depth += 1

    def _leave(self, *_: Any) -> None:
        self._depth -= 1


def _unpack(held: Any) -> Tensor:
    return held.tensor if isinstance(held, _Held) else held


class _Held:
    __slots__ = ("tensor", "ptr", "meter")

    def __init__(self, tensor: Tensor, ptr: int, meter: SavedTensorMeter) -> None:
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter.release(self.ptr)
