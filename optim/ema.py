"""An exponential moving average of the master weights, kept in host memory and updated off the training thread."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

EMA_KEY = "ema"  # a Piece's state entry holding its run of the EMA (checkpointed beside the master)


class HostEMA:
    """ema = decay x ema + (1 - decay) x master after every optimizer step, for each of a list of master tensors.

    The averages live on host (host memory, pinned when the masters are on a GPU; a rehearsal on meta passes meta)
    and start as copies of the masters. update() starts one step's update and returns: masters on a GPU are copied
    into host staging buffers, non-blocking on the current stream, and a background thread waits for that copy and
    updates the averages; masters already in host memory (a CPU run, ZeRO-Offload) are read by the thread directly,
    so whoever next writes them calls wait() first. Nothing is added on the device. wait() returns once the update
    in flight is done; read the averages (a checkpoint) only after it.
    """

    def __init__(self, masters: Sequence[torch.Tensor], decay: float, host: torch.device) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay = {decay!r} must be in (0, 1)")
        self.decay = decay
        self.masters = list(masters)
        device = self.masters[0].device
        pinned = device.type == "cuda"
        self.values = [torch.empty(m.numel(), dtype=m.dtype, device=host, pin_memory=pinned) for m in self.masters]
        # masters elsewhere than host go through staging buffers, so the thread never reads device memory
        self._staging = (None if device == host else
                         [torch.empty_like(v, pin_memory=pinned) for v in self.values])
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-ema")
        self._pending: Future | None = None
        self.reset()

    def reset(self) -> None:
        """Restart the averages from the masters' current values (waits for an update in flight)."""
        self.wait()
        for value, master in zip(self.values, self.masters):
            value.copy_(master.detach().reshape(-1))

    def wait(self) -> None:
        """Return once the update in flight (if any) has finished; re-raises its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def update(self) -> None:
        """Start averaging in the masters' current values (after an optimizer step); returns without waiting."""
        self.wait()
        sources, copied = self.masters, None
        if self._staging is not None:
            for staging, master in zip(self._staging, self.masters):
                staging.copy_(master.detach().reshape(-1), non_blocking=True)
            sources = self._staging
            if self.masters[0].device.type == "cuda":
                copied = torch.cuda.Event()
                copied.record()
        self._pending = self._pool.submit(self._average, sources, copied)

    def _average(self, sources: Sequence[torch.Tensor], copied: torch.cuda.Event | None) -> None:
        """The background thread's work: wait for the copies, then ema = decay x ema + (1 - decay) x source."""
        if copied is not None:
            copied.synchronize()
        with torch.no_grad():
            for value, source in zip(self.values, sources):
                value.mul_(self.decay).add_(source.detach().reshape(-1), alpha=1.0 - self.decay)

    def nbytes(self) -> int:
        """Host bytes held: the averages and the staging buffers."""
        return sum(v.nbytes for v in self.values) + sum(s.nbytes for s in self._staging or ())
