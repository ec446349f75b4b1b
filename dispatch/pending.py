"""Communication in flight held together with the buffers it reads and writes (every async collective and p2p).

A backend (gloo's I/O threads, NCCL's stream) reads a send buffer and writes a receive buffer after the call that
started it returns, until the work completes. A buffer freed before then (a Python temporary whose last reference
dies, a storage resized to 0, a staging buffer reused) is memory the backend still reads or writes: heap
corruption that glibc reports at some later, unrelated allocation ("malloc(): unaligned tcache chunk detected",
"corrupted double-linked list"). So whoever starts such work keeps it in a Pending with its buffers, and only
Pending.wait() lets go of them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch.distributed as dist
from torch import Tensor


class Pending:
    """Work in flight and every tensor it reads or writes, held together until wait().

    work: an async collective's or p2p request's handle, a list of them, or None (nothing in flight); keep: the
    buffers they read (sends) and write (receives); result: what wait() returns once they are done (default None).
    """

    def __init__(self, work: dist.Work | Sequence[dist.Work] | None, result: Callable[[], Any] | None = None,
                 keep: Sequence[Tensor] = ()) -> None:
        self.works = [] if work is None else list(work) if isinstance(work, (list, tuple)) else [work]
        self.buffers = tuple(keep)  # alive until the works are done
        self._result = result

    def is_completed(self) -> bool:
        """Whether every work is complete (does not block; a completed Pending still needs wait() to let go)."""
        return all(work.is_completed() for work in self.works)

    def wait(self) -> Any:
        """Block until every work is complete, release the works and buffers, and return the result."""
        for work in self.works:
            work.wait()
        self.works, self.buffers = [], ()
        return None if self._result is None else self._result()


def wait_all(pendings: Iterable[Pending]) -> None:
    """Wait for every Pending in pendings (in order)."""
    for pending in pendings:
        pending.wait()
