"""Peak bytes held for backward, measured through saved-tensor hooks (CPU has no allocator stats)."""

from __future__ import annotations

from typing import Any, Callable

import torch


class SavedTensorMeter:
    """Peak bytes of distinct storages saved for backward, plus extra bytes reported by `extra()`."""

    def __init__(self, extra: Callable[[], int] = lambda: 0) -> None:
        self.extra = extra
        self.refs: dict[int, list[int]] = {}  # storage ptr -> [count, nbytes]
        self.live = self.peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ref = self.refs.setdefault(storage.data_ptr(), [0, storage.nbytes()])
        if ref[0] == 0:
            self.live += ref[1]
        ref[0] += 1
        self.peak = max(self.peak, self.live + self.extra())
        return _Held(t, storage.data_ptr(), self)

    def release(self, ptr: int) -> None:
        """A saved tensor was dropped by its graph."""
        ref = self.refs[ptr]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[ptr]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Context that routes saved tensors through this meter."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)


class _Held:
    __slots__ = ("tensor", "ptr", "meter")

    def __init__(self, tensor: torch.Tensor, ptr: int, meter: SavedTensorMeter) -> None:
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter.release(self.ptr)
