"""The device-split exchange (EPDispatcher's exchange "device_split"): the padded exchange's layout, with only each
block's filled rows on the wire and the row counts on the device.

A padded hop (dispatch.transport.padded_dispatch_steps) sends every peer a block of `bound` rows, its filled rows
first, then padding. With a DeviceSplit transport the sender also gives `sent` (int64 [peers] on the device: the filled
rows of each block) and only those rows travel; the receiver still gets the padded layout: block p holds the first
received[p] rows peer p sent, then padding (zero rows, or a given padding row: the routing metadata's weight 0 and
expert ids -1). Nothing is read to the host. The gradient exchanges of dispatch and combine (scatter_steps,
gather_steps) reuse the counts the forward learnt (a return swaps sent and received).

One contract, two implementations (DeviceSplit.start_split picks one per call):
- NVSHMEM (CUDA tensors on an NCCL group, torch.distributed._symmetric_memory.is_nvshmem_available()):
  torch.ops.symm_mem.all_to_all_vdev on symmetric buffers allocated once per (shape, dtype) and reused (nvshmem_split:
  the send side packs each block's leading rows by a device index, the receive side puts the packed rows back into
  blocks from the op's out_splits_offsets). Written from the op's contract below; it has not run on a GPU yet
  (dispatch.device_split_check.gpu_check, for `moe-bench gpu`, runs it at world size 1).
- the reference (every other device and backend, gloo included; what the CPU suite runs): the padded all-to-all of
  whole blocks, a fixed-size all-to-all of the counts, then the rows past each block's count set to padding. The same
  observable result: only the wire differs.

The op's contract, from torch's source (torch/csrc/distributed/c10d/symm_mem/nvshmem_extension.cu, all_to_all_vdev,
and test/distributed/test_nvshmem.py): all_to_all_vdev(input, out, in_splits, out_splits_offsets, group_name), every
tensor on one CUDA device, allocated by symm_mem.empty and rendezvoused on the group (symm_mem.set_backend("NVSHMEM")
before the first allocation); input and out contiguous, one dtype, one stride(0); the unit of a split is a dim-0 row.
in_splits int64 [W]: the rows for each group rank, input packed by destination in rank order (rank p's rows start at
the exclusive prefix sum of in_splits). out_splits_offsets int64 [2, W], written by the op: row 0 the rows received
from each rank, row 1 their offsets in out (the exclusive prefix sum of row 0: out packed by source in rank order).
Everything stays on the device; the op is ordered on the current stream.
Hazards of some kernel versions, and what is done about them: peers read a rank's input (getmem) or write into its
out_splits_offsets for the next call before that rank's stream has consumed the last call's, so each (shape, dtype)
has two buffer sets used in turn (a set is reused only after another call of the op on the group, which every rank
entered after finishing the call before); a 1-rank group is refused by some versions (their team manager wants more
than one rank), so a hop of one peer never calls the op (nothing crosses a wire there); a version whose kernel asserts
that a peer's bytes divide evenly among its thread blocks needs TORCH_SYMMMEM_NBLOCKS set to the hop's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dispatch.channel import Channel
from dispatch.layout import device_index
from dispatch.pending import Pending

COUNT_BYTES = 8  # one int64 per peer: the counts a forward exchange trades


def block_counts(filled: Tensor, peers: int, bound: int) -> Tensor:
    """int64 [peers]: the filled rows of each block of a padded hop's sends (filled [peers * bound] bool)."""
    return filled.view(peers, bound).sum(1)


def pad_blocks(rows: Tensor, counts: Tensor, bound: int, padding: Tensor | None = None) -> Tensor:
    """rows [peers * bound, ...] in blocks of bound with the rows past counts[p] in block p replaced by padding (one
    row, broadcast; None: zeros)."""
    keep = (torch.arange(bound, device=rows.device) < counts.unsqueeze(1)).reshape(-1)
    keep = keep.view(-1, *[1] * (rows.dim() - 1))
    return torch.where(keep, rows, rows.new_zeros(()) if padding is None else padding)


@dataclass
class _SymmetricSet:
    """One set of all_to_all_vdev's symmetric buffers for blocks of one shape and dtype."""

    send: Tensor    # [peers * bound + 1, ...]: the packed rows, then one row the rows not sent are dropped into
    recv: Tensor    # [peers * bound, ...]: the rows received, packed by source
    splits: Tensor  # int64 [peers]: in_splits
    out: Tensor     # int64 [2, peers]: out_splits_offsets


class NvshmemBuffers:
    """all_to_all_vdev's symmetric buffers over one group, two sets per (shape, dtype) used in turn (see the module
    doc), allocated and rendezvoused on first use: every rank of the group must issue the same exchanges in the same
    order, as a hop's exchanges are."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._sets: dict[tuple, list[_SymmetricSet]] = {}
        self._turn: dict[tuple, int] = {}

    def next(self, rows: Tensor, peers: int) -> _SymmetricSet:
        """The buffer set for the next exchange of blocks shaped like rows."""
        key = (tuple(rows.shape), rows.dtype, rows.device)
        if key not in self._sets:
            self._sets[key] = [_SymmetricSet(*(self.make(shape, dtype, rows.device) for shape, dtype in (
                ((rows.shape[0] + 1, *rows.shape[1:]), rows.dtype), (tuple(rows.shape), rows.dtype),
                ((peers,), torch.int64), ((2, peers), torch.int64)))) for _ in range(2)]
            self._turn[key] = 0
        turn = self._turn[key]
        self._turn[key] = 1 - turn
        return self._sets[key][turn]

    def make(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A symmetric tensor on device, rendezvoused on the group (NVSHMEM's backend chosen before the first)."""
        from torch.distributed import _symmetric_memory as symm_mem

        if symm_mem.get_backend(device) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")
        tensor = symm_mem.empty(shape, dtype=dtype, device=device)
        symm_mem.rendezvous(tensor, self.group)
        return tensor


def all_to_all_vdev(input: Tensor, out: Tensor, in_splits: Tensor, out_splits_offsets: Tensor, group_name: str) -> None:
    """torch.ops.symm_mem.all_to_all_vdev (the contract in the module doc)."""
    torch.ops.symm_mem.all_to_all_vdev(input, out, in_splits, out_splits_offsets, group_name)


def nvshmem_split(rows: Tensor, sent: Tensor, buffers: NvshmemBuffers, padding: Tensor | None = None
                  ) -> tuple[Tensor, Tensor]:
    """The CUDA implementation of DeviceSplit.start_split's contract, on the current stream: rows [peers * bound, ...]
    in blocks of bound, each block's leading sent[p] rows for group rank p -> (rows received in the same blocks, the
    rows past received[p] of block p as padding; received int64 [peers]). Reads nothing to the host."""
    peers = sent.numel()
    bound = rows.shape[0] // peers
    buf = buffers.next(rows, peers)
    within = torch.arange(bound, device=rows.device)
    starts = torch.cumsum(sent, 0) - sent  # where each block's rows start in the packed send buffer
    packed_at = torch.where(within < sent.unsqueeze(1), starts.unsqueeze(1) + within, peers * bound)  # else: dropped
    buf.send.index_copy_(0, packed_at.reshape(-1), rows)
    buf.splits.copy_(sent)
    all_to_all_vdev(buf.send, buf.recv, buf.splits, buf.out, buffers.group.group_name)
    received, offsets = buf.out[0].clone(), buf.out[1]
    taken_from = (offsets.unsqueeze(1) + within).clamp(max=max(peers * bound - 1, 0)).reshape(-1)
    return pad_blocks(buf.recv.index_select(0, taken_from), received, bound, padding), received


def nvshmem_usable(rows: Tensor, group: dist.ProcessGroup) -> bool:
    """Whether rows can take the NVSHMEM path over group: CUDA tensors, an NCCL group, NVSHMEM available."""
    if not rows.is_cuda or dist.get_backend(group) != "nccl":
        return False
    from torch.distributed import _symmetric_memory as symm_mem
    return symm_mem.is_nvshmem_available()


class DeviceSplit:
    """A padded hop's transport whose blocks move only their filled rows (see the module doc); exact and padded
    exchanges (start_exchange, start_counts) go to the channel it wraps, a group of exactly the hop's peers."""

    def __init__(self, channel: Channel) -> None:
        if channel.members != channel.peers:
            raise ValueError(f"a device-split exchange on the {channel.name} hop needs a group of exactly its peers "
                             f"{channel.peers}, got members {channel.members}")
        self.channel = channel
        self.peers, self.name, self.rank = channel.peers, channel.name, channel.rank
        self.topology, self.meter = channel.topology, channel.meter
        self._others = [i for i, peer in enumerate(self.peers) if peer != self.rank]
        self._inter = [not self.topology.same_node(self.rank, self.peers[i]) for i in self._others]
        self._nvshmem: bool | None = None
        self._buffers = NvshmemBuffers(channel.group)
        self.exchange_alone = False  # True: a hop of one peer exchanges too (gpu_check runs the op at world size 1)

    def start_exchange(self, rows: Tensor, send_splits: list[int] | None, recv_splits: list[int] | None, kind: str,
                       part: str = "payload") -> Pending:
        """Channel.start_exchange of the wrapped channel."""
        return self.channel.start_exchange(rows, send_splits, recv_splits, kind, part)

    def start_counts(self, counts: list[list[int]], kind: str, device: torch.device) -> Pending:
        """Channel.start_counts of the wrapped channel."""
        return self.channel.start_counts(counts, kind, device)

    def start_split(self, rows: Tensor, sent: Tensor, received: Tensor | None, kind: str, part: str = "payload",
                    padding: Tensor | None = None) -> tuple[Pending, Tensor]:
        """Start sending the leading sent[i] rows of block i of rows ([peers * bound, ...], blocks in peer order) to
        peer i. Returns (the Pending, whose wait() gives the rows received in the same blocks, block i holding the
        rows peer i sent, then padding (a row; None: zeros) up to bound; received: int64 [peers], the rows that come
        from each peer, valid once the Pending is waited for). received given (a return along a hop whose forward
        learnt it): not traded again. The meter counts the filled rows (and the counts, when traded) per peer, from
        the device."""
        peers = len(self.peers)
        if rows.shape[0] % peers or sent.shape != (peers,):
            raise ValueError(f"a device-split exchange on the {self.name} hop sends one block per peer ({peers}): got "
                             f"{rows.shape[0]} rows and counts of shape {list(sent.shape)}")
        bound = rows.shape[0] // peers
        row_bytes = rows.element_size() * math.prod(rows.shape[1:])
        if self._others:
            others = device_index(tuple(self._others), sent.device)
            self.meter.add_rows(kind, part, sent.index_select(0, others), row_bytes,
                                [self.peers[i] for i in self._others], self._inter, self.name)
            if received is None:
                for i, inter in zip(self._others, self._inter):
                    self.meter.add(kind, inter, "meta", COUNT_BYTES, self.peers[i], self.name)
        if peers == 1 and not self.exchange_alone:  # nothing crosses a wire
            out = pad_blocks(rows, sent, bound, padding)
            return Pending(None, lambda: out), sent
        if self._nvshmem is None:
            self._nvshmem = nvshmem_usable(rows, self.channel.group)
        if self._nvshmem:
            out, counts = nvshmem_split(rows.contiguous(), sent, self._buffers, padding)
            return Pending(None, lambda: out), counts if received is None else received
        return self._reference(rows.contiguous(), sent.contiguous(), received, bound, padding)

    def _reference(self, rows: Tensor, sent: Tensor, received: Tensor | None, bound: int, padding: Tensor | None
                   ) -> tuple[Pending, Tensor]:
        """start_split on any backend: whole blocks and the counts exchanged, then the rows past the counts padded."""
        out = torch.empty_like(rows)
        works = [dist.all_to_all_single(out, rows, group=self.channel.group, async_op=True)]
        keep = [rows, out, sent]
        if received is None:
            received = torch.empty_like(sent)
            works.append(dist.all_to_all_single(received, sent, group=self.channel.group, async_op=True))
            keep.append(received)
        counts = received
        return Pending(works, lambda: pad_blocks(out, counts, bound, padding), keep), received
