"""Point-to-point transfer of a list of tensors whose shapes and dtypes are negotiated per message.

A message is a fixed-size int64 header (count, then per tensor: dtype code, requires_grad, ndim,
dims) and one uint8 payload holding every tensor's bytes, so any number of tensors of any shape
and dtype can cross; see P2PChannel for how they travel. A channel told its messages' fixed layout
(P2PChannel.fixed, as a trainer whose stage boundaries always carry one [micro-batch, seq, hidden]
activation does) sends payloads only, and a receive never copies a header to the host.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from dispatch.pending import Pending, wait_all

HEADER_LEN = 64
HEADER_BYTES = HEADER_LEN * 8
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)


def _header(tensors: list[Tensor]) -> Tensor:
    fields = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline boundary tensors of dtype {t.dtype} are not supported")
        fields += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    if len(fields) > HEADER_LEN:
        raise ValueError(f"{len(tensors)} boundary tensors with these ranks do not fit a {HEADER_LEN}-entry header")
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


@dataclass
class TensorMeta:
    """Shape, dtype and grad flag of one tensor of a message."""

    dtype: torch.dtype
    requires_grad: bool
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Payload bytes of this tensor."""
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def _parse(header: Tensor) -> list[TensorMeta]:
    fields = header.tolist()
    metas, i = [], 1
    for _ in range(fields[0]):
        code, grad, ndim = fields[i:i + 3]
        metas.append(TensorMeta(_DTYPES[code], bool(grad), tuple(fields[i + 3:i + 3 + ndim])))
        i += 3 + ndim
    return metas


def _nbytes(tensors: list[Tensor]) -> int:
    return sum(t.nbytes for t in tensors)


def _fill(buf: Tensor, tensors: list[Tensor]) -> None:
    """Copy every tensor's bytes into the uint8 buffer buf, back to back, in one copy each."""
    offset = 0
    for t in tensors:
        size = t.nbytes
        if offset % t.element_size():  # a view as t.dtype needs an aligned start: copy bytes
            buf[offset:offset + size].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        else:
            buf[offset:offset + size].view(t.dtype).view(t.shape).copy_(t.detach())
        offset += size


class _Ticket:
    """A receive asked for; posted once the previous message on its stream has been read (then `pending` holds the
    receive and its buffer, and gives the buffer once waited for)."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: Pending | None = None


@dataclass
class TransferLog:
    """perf_counter times of a channel's messages per (peer, stream), in order: when each send was
    issued, and when each receive was waited for and when it completed."""

    sent: dict[tuple[int, int], list[float]] = field(default_factory=lambda: defaultdict(list))
    received: dict[tuple[int, int], list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))


class P2PChannel:
    """Sends and receives tensor lists to/from group ranks, one tag per stream.

    Both ends remember the payload size of the last message on each (peer, stream). A message is
    one buffer [header | payload] when the payload keeps that size, so the receiver can post it
    ahead of time and it crosses in one transfer; when the size changes, the first buffer carries
    the new header (and filler of the old size) and the payload follows as a second message.
    Sends and receives are issued on the calling thread straight to the process group (both are
    non-blocking); a helper thread would cost a GIL hand-over per message. Each stream has its own
    process group (same ranks): NCCL ignores tags and matches a pair's messages in issue order, so
    only the order within a stream may matter; gloo multiplexes a pair's messages over one socket,
    whose lock a send shares with the receipt of every other stream's messages, so a group per
    stream issues sends sooner there too (timings: docs/parallelism.md, Pipelines).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_streams: int = 4) -> None:
        ranks = dist.get_process_group_ranks(group)
        self._groups = [dist.new_group(ranks, use_local_synchronization=True) for _ in range(num_streams)]
        self.device = device
        self.fake = dist.get_backend(group) == "fake"  # a rehearsal's group: sends never report completion
        self.log: TransferLog | None = None  # set to record the times of messages
        self.fixed: list[TensorMeta] | None = None  # every message's tensors, when fixed: no header crosses
        self.blocked_s = 0.0  # seconds spent blocked on messages not yet arrived, all told
        self._sends: list[Pending] = []  # sends in flight, each holding its buffer
        self._sent: dict[tuple[int, int], int] = {}  # (peer, stream) -> payload bytes of the last message out
        self._expect: dict[tuple[int, int], int] = {}  # (peer, stream) -> payload bytes of the last message in
        self._queued: dict[tuple[int, int], deque[_Ticket]] = defaultdict(deque)

    def _isend(self, buf: Tensor, peer: int, stream: int) -> None:
        # finished sends let go of their buffers now rather than at wait_sends (is_completed does not block)
        in_flight = []
        for sent in self._sends:
            if sent.is_completed():
                sent.wait()
            else:
                in_flight.append(sent)
        self._sends = in_flight
        work = self._groups[stream].send([buf], peer, stream)
        # a rehearsal's fake send is done once issued (its work never says so): it keeps no buffer
        self._sends.append(Pending(work, keep=() if self.fake or buf.is_meta else (buf,)))

    def _irecv(self, buf: Tensor, peer: int, stream: int) -> Pending:
        """Post a receive into buf; the Pending holds buf and gives it once waited for."""
        return Pending(self._groups[stream].recv([buf], peer, stream), lambda: buf, keep=(buf,))

    def send(self, tensors: list[Tensor], peer: int, stream: int) -> None:
        """Start sending tensors to group rank peer (non-blocking; finished by wait_sends)."""
        key = (peer, stream)
        nbytes = _nbytes(tensors)
        if self.fixed is not None:
            self._check_fixed(tensors)
            payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            _fill(payload, tensors)
            if self.log is not None:
                self.log.sent[key].append(time.perf_counter())
            self._isend(payload, peer, stream)
            return
        same = self._sent.get(key) == nbytes
        first = torch.empty(HEADER_BYTES + (nbytes if same else self._sent.get(key, 0)), dtype=torch.uint8,
                            device=self.device)
        first[:HEADER_BYTES].view(torch.int64).copy_(_header(tensors))
        payload = first[HEADER_BYTES:] if same else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        _fill(payload, tensors)
        if self.log is not None:
            self.log.sent[key].append(time.perf_counter())
        self._isend(first, peer, stream)
        if not same:
            self._isend(payload, peer, stream)
        self._sent[key] = nbytes

    def post_recv(self, peer: int, stream: int) -> _Ticket:
        """Ask for the next message from peer on stream (posted now if the stream is free)."""
        ticket = _Ticket()
        queue = self._queued[(peer, stream)]
        queue.append(ticket)
        if len(queue) == 1:
            self._post(ticket, peer, stream)
        return ticket

    def _check_fixed(self, tensors: list[Tensor]) -> None:
        """ValueError unless tensors have the fixed messages' dtypes and shapes."""
        got = [(t.dtype, tuple(t.shape)) for t in tensors]
        if got != [(m.dtype, m.shape) for m in self.fixed]:
            raise ValueError(f"pipeline boundary tensors {got} differ from the fixed message "
                             f"{[(m.dtype, m.shape) for m in self.fixed]} this channel was given")

    def _post(self, ticket: _Ticket, peer: int, stream: int) -> None:
        size = sum(m.nbytes for m in self.fixed) if self.fixed is not None else (
            HEADER_BYTES + self._expect.get((peer, stream), 0))
        ticket.pending = self._irecv(torch.empty(size, dtype=torch.uint8, device=self.device), peer, stream)

    def finish_recv(self, ticket: _Ticket, peer: int, stream: int) -> list[tuple[Tensor, bool]]:
        """Wait for a message asked for with post_recv; return its tensors and requires_grad flags."""
        key = (peer, stream)
        queue = self._queued[key]
        if not queue or queue[0] is not ticket:
            raise RuntimeError(f"messages on stream {stream} from rank {peer} must be read in order")
        t0 = time.perf_counter()
        if self.fixed is not None:  # no header: the wait orders the device's stream, the host does not block
            metas, payload = self.fixed, self._await(ticket.pending, lambda buf: buf)
        else:
            # on a GPU the header's copy to the host is what blocks until the message is there
            buf, header = self._await(ticket.pending, lambda buf: (buf, buf[:HEADER_BYTES].view(torch.int64).cpu()))
            metas = _parse(header)
            nbytes = sum(m.nbytes for m in metas)
            if self._expect.get(key) == nbytes:
                payload = buf[HEADER_BYTES:]
            else:
                payload = self._await(self._irecv(torch.empty(nbytes, dtype=torch.uint8, device=self.device), peer,
                                                  stream), lambda buf: buf)
            self._expect[key] = nbytes
        if self.log is not None:
            self.log.received[key].append((t0, time.perf_counter()))
        queue.popleft()
        if queue:
            self._post(queue[0], peer, stream)
        out, offset = [], 0
        for m in metas:
            raw = payload[offset:offset + m.nbytes]
            if offset % m.dtype.itemsize:
                raw = raw.clone()  # a view as m.dtype needs an aligned start
            out.append((raw.view(m.dtype).view(m.shape), m.requires_grad))
            offset += m.nbytes
        return out

    def _await(self, pending: Pending, then: Callable[[Tensor], Any]) -> Any:
        """Wait for a receive, then return then(its buffer); the time this takes for a message not yet
        arrived adds to blocked_s."""
        t0, arrived = time.perf_counter(), pending.is_completed()
        out = then(pending.wait())
        if not arrived:
            self.blocked_s += time.perf_counter() - t0
        return out

    def wait_sends(self) -> None:
        """Complete every send started so far."""
        wait_all(self._sends)
        self._sends.clear()
