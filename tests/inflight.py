"""Helpers for the tests that every async collective's buffers stay alive until its work is waited for (issue 51).

A real backend keeps its own references to the tensors of a work in flight (gloo's work objects, NCCL's stashed
tensors), which hides a caller that drops them early. `record_works` replaces torch.distributed's async calls by
recorders whose works hold only weak references, so that the code under test is the only owner of its buffers:
a buffer it lets go of before wait() dies at once, and the test sees it. `fake_world` is a process group of any
size in one process (torch's fake backend: no collective moves anything).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch import Tensor
from torch.testing._internal.distributed.fake_pg import FakeStore


class WeakWork:
    """A work handle holding weak references to its tensors only; complete once waited for."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.refs = [weakref.ref(t) for t in tensors]
        self.waited = False

    def is_completed(self) -> bool:  # noqa: D102
        return self.waited

    def wait(self) -> bool:  # noqa: D102
        self.waited = True
        return True

    def alive(self) -> bool:
        """Whether every tensor the work was started on is still alive (after a garbage collection)."""
        gc.collect()
        return all(ref() is not None for ref in self.refs)


def record_works(monkeypatch: pytest.MonkeyPatch, owner: object, *names: str) -> list[WeakWork]:
    """Replace owner.NAME (for each name: an async collective or p2p call) by a recorder returning a WeakWork on
    the tensors it is given; returns the list the works are appended to, in call order."""
    works: list[WeakWork] = []

    def start(*args, **kwargs) -> WeakWork:
        works.append(WeakWork([a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]))
        return works[-1]
    for name in names:
        monkeypatch.setattr(owner, name, start)
    return works


@contextlib.contextmanager
def fake_world(size: int) -> Iterator[None]:
    """A default process group of size ranks (this process rank 0) on torch's fake backend."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()
