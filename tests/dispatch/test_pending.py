"""A Pending holds its buffers until wait() (not a caller's variable), and Channel's exchanges hand theirs to it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dispatch.channel import Channel
from dispatch.pending import Pending, wait_all
from dispatch.topology import Topology
from dispatch.traffic import TrafficMeter
from tests.inflight import WeakWork, fake_world, record_works


def test_a_pending_holds_its_buffers_until_waited() -> None:
    sent, received = torch.ones(4), torch.empty(4)
    works = [WeakWork([sent]), WeakWork([received])]
    pending = Pending(works, lambda: "arrived", keep=(sent, received))
    del sent, received
    assert all(w.alive() for w in works) and not pending.is_completed()
    assert pending.wait() == "arrived" and pending.is_completed()
    assert not any(w.alive() for w in works)  # wait() let go of them
    assert pending.wait() == "arrived" and Pending(None).wait() is None
    one = Pending(WeakWork([]))
    wait_all([one])
    assert one.works == []


def test_an_exchange_holds_the_rows_it_sends_until_waited(monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-contiguous rows are sent as a contiguous copy, which only the Pending holds."""
    works = record_works(monkeypatch, dist, "all_to_all_single")
    with fake_world(2):
        channel = Channel(dist.group.WORLD, Topology(2, 1), meter := TrafficMeter())
        meter.start("dispatch")
        pending = channel.start_exchange(torch.arange(12.0).view(3, 4).t(), [2, 2], [1, 3], "dispatch")
        (work,) = works
        assert work.alive()  # the output and the copy sent
        out = pending.wait()
        assert work.refs[0]() is out and work.refs[1]() is None  # the copy sent is let go of once waited for
