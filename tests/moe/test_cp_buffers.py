"""The CP ring's transfers hold what they send and receive until waited for (moe.cp._Ring; issue 51)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dispatch.pending import wait_all
from moe.cp import _Ring
from tests.inflight import fake_world, record_works


def test_ring_transfers_hold_their_buffers_until_waited(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-contiguous block is sent as a contiguous copy and received into a new buffer: only the Pendings
    hold them (the copy is nobody else's; the caller here drops the receive buffers)."""
    works = record_works(monkeypatch, dist, "isend", "irecv")
    with fake_world(2):
        ring = _Ring(dist.group.WORLD, None)
        sends = ring.send([torch.randn(3, 4, dtype=torch.float64).t()])
        recvs = ring.recv([torch.randn(4, 3, dtype=torch.float64)])[1]
        assert len(works) == 2 and all(w.alive() for w in works)
        wait_all((sends, recvs))
        assert not any(w.alive() for w in works)
