"""P2PChannel's sends and posted receives hold their buffers until waited for (pipeline.p2p; issue 51)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.p2p import P2PChannel, TensorMeta
from tests.inflight import WeakWork, fake_world


class _Group:
    """A stream's process group whose sends and receives record WeakWorks (they hold no buffer themselves)."""

    def __init__(self) -> None:
        self.works: list[WeakWork] = []

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> WeakWork:
        self.works.append(WeakWork(tensors))
        return self.works[-1]

    recv = send


def test_sends_and_receives_hold_their_buffers_until_waited() -> None:
    with fake_world(2):
        channel = P2PChannel(dist.group.WORLD, torch.device("cpu"), num_streams=1)
    group = channel._groups[0] = _Group()
    channel.fake = False  # the fake world only builds the channel: its sends stand for a real group's
    channel.fixed = [TensorMeta(torch.float64, False, (4, 3))]
    block = torch.randn(3, 4, dtype=torch.float64).t()
    channel.send([block], 1, 0)  # packed into a payload buffer only the channel holds
    ticket = channel.post_recv(1, 0)
    sent, received = group.works
    assert sent.alive() and received.alive()
    channel.wait_sends()
    assert not sent.alive()
    ((got, _),) = channel.finish_recv(ticket, 1, 0)
    assert received.refs[0]() is not None and got.shape == (4, 3)  # what arrived is a view of the receive buffer
