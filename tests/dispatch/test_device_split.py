"""The device-split exchange's transport (dispatch.device_split) on 2 gloo ranks, as 2 simulated nodes.

Each rank sends each peer (itself included) a block of BOUND rows of which a count travels; over ROUNDS every
direction sees the counts 0, 1 and BOUND. The reference delivers the padded exchange's blocks with the rows past each
count replaced by padding (zeros, or a given row), learns the counts, returns rows along the same blocks, reads nothing
to the host, and meters only the rows that count. The NVSHMEM path's packing and unpacking (nvshmem_split), run here
with all_to_all_vdev emulated from its contract over gloo, gives the reference's results bit for bit.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from dispatch import device_split
from dispatch.channel import Channel
from dispatch.device_split import DeviceSplit, NvshmemBuffers, nvshmem_split, pad_blocks
from dispatch.topology import make_topology
from dispatch.traffic import TrafficMeter
from launch.parallel.spawn import run_processes
from tests.syncs import SyncDetector

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

WORLD, BOUND, WIDTH, ROUNDS = 2, 3, 5, 3
COUNTS = (0, 1, BOUND)


def count(round_: int, source: int, dest: int) -> int:
    """Rows source sends dest in a round: every (source, dest) pair sees each of COUNTS over the rounds."""
    return COUNTS[(round_ + source + 2 * dest) % len(COUNTS)]


def payload(round_: int, rank: int) -> torch.Tensor:
    """rank's float64 rows of a round, [WORLD * BOUND, WIDTH], no zero among them."""
    gen = torch.Generator().manual_seed(10 * round_ + rank)
    return torch.rand(WORLD * BOUND, WIDTH, generator=gen, dtype=torch.float64) + 1


def metadata(round_: int, rank: int) -> torch.Tensor:
    """rank's int32 rows of a round (as routing metadata travels), no -1 among them."""
    return torch.arange(WORLD * BOUND * 2, dtype=torch.int32).view(-1, 2) + 100 * round_ + 10 * rank


def emulated_vdev(input: torch.Tensor, out: torch.Tensor, in_splits: torch.Tensor, out_splits_offsets: torch.Tensor,
                  group_name: str) -> None:
    """torch.ops.symm_mem.all_to_all_vdev's contract (dispatch.device_split's doc) over gloo, its splits read."""
    recv = torch.empty_like(in_splits)
    dist.all_to_all_single(recv, in_splits)
    sends, recvs = in_splits.tolist(), recv.tolist()
    got = input.new_empty((sum(recvs), *input.shape[1:]))
    dist.all_to_all_single(got, input[:sum(sends)].contiguous(), recvs, sends)
    out[:sum(recvs)] = got
    out_splits_offsets[0] = recv
    out_splits_offsets[1] = torch.cumsum(recv, 0) - recv


def _exchanges(rank: int, world_size: int) -> list[dict]:
    meter = TrafficMeter()
    channel = Channel(dist.group.WORLD, make_topology(WORLD, 1), meter)
    split = DeviceSplit(channel)
    buffers = NvshmemBuffers(dist.group.WORLD)
    results = []
    for round_ in range(ROUNDS):
        rows, meta = payload(round_, rank), metadata(round_, rank)
        sent = torch.tensor([count(round_, rank, peer) for peer in range(WORLD)])
        padding = torch.full((2,), -1, dtype=torch.int32)
        meter.start("dispatch")
        meter.start("combine")
        with SyncDetector() as detector:
            pending, received = split.start_split(rows, sent, None, "dispatch")
            got = pending.wait()
            pending, _ = split.start_split(meta, sent, received, "dispatch", "meta", padding)
            got_meta = pending.wait()
            pending, _ = split.start_split(got, received, sent, "combine")
            back = pending.wait()
        whole, whole_meta = torch.empty_like(rows), torch.empty_like(meta)
        dist.all_to_all_single(whole, rows)
        dist.all_to_all_single(whole_meta, meta)
        with mock.patch.object(device_split, "all_to_all_vdev", emulated_vdev), \
                mock.patch.object(NvshmemBuffers, "make", lambda self, shape, dtype, device:
                                  torch.full(shape, 7, dtype=dtype)):  # stale values in the buffers
            nvshmem = [nvshmem_split(rows, sent, buffers), nvshmem_split(meta, sent, buffers, padding)]
        results.append({"got": got, "received": received, "meta": got_meta, "back": back, "whole": whole,
                        "whole_meta": whole_meta, "reads": detector.kinds(), "nvshmem": nvshmem,
                        "bytes": {kind: meter.last[kind].as_dict() for kind in ("dispatch", "combine")}})
    return results


@pytest.fixture(scope="module")
def results():
    return run_processes(_exchanges, WORLD, timeout_s=120)


def expected(round_: int, rank: int) -> torch.Tensor:
    """The rows rank receives from each peer in a round."""
    return torch.tensor([count(round_, peer, rank) for peer in range(WORLD)])


def test_reference_delivers_the_padded_blocks_with_rows_past_each_count_as_padding(results):
    for rank, rounds in enumerate(results):
        for round_, res in enumerate(rounds):
            counts = expected(round_, rank)
            assert res["received"].tolist() == counts.tolist(), (rank, round_)
            assert torch.equal(res["got"], pad_blocks(res["whole"], counts, BOUND)), (rank, round_)
            padding = torch.full((2,), -1, dtype=torch.int32)
            assert torch.equal(res["meta"], pad_blocks(res["whole_meta"], counts, BOUND, padding)), (rank, round_)
            kept = [(res["got"][p * BOUND:(p + 1) * BOUND] != 0).all(1).sum().item() for p in range(WORLD)]
            assert kept == counts.tolist()  # the filled rows arrive whole, the others are zero


def test_return_along_the_blocks_gives_each_sender_its_filled_rows_back(results):
    for rank, rounds in enumerate(results):
        for round_, res in enumerate(rounds):
            sent = torch.tensor([count(round_, rank, peer) for peer in range(WORLD)])
            assert torch.equal(res["back"], pad_blocks(payload(round_, rank), sent, BOUND)), (rank, round_)


def test_device_split_reads_nothing_to_the_host(results):
    assert all(res["reads"] == [] for rounds in results for res in rounds)


def test_meter_counts_the_filled_rows_sent_to_the_other_rank_and_the_counts_traded(results):
    """Both ranks are on nodes of their own: everything to the peer is inter-node, what a rank sends itself is free.
    dispatch: the filled payload rows (float64) and metadata rows (int32), the counts once (8 bytes); combine: the
    rows received, returned, no counts."""
    for rank, rounds in enumerate(results):
        other = 1 - rank
        for round_, res in enumerate(rounds):
            out, back = count(round_, rank, other), count(round_, other, rank)
            dispatch, combine = res["bytes"]["dispatch"], res["bytes"]["combine"]
            assert (dispatch["inter_payload"], dispatch["inter_meta"]) == (out * WIDTH * 8, out * 2 * 4 + 8)
            assert (combine["inter_payload"], combine["inter_meta"]) == (back * WIDTH * 8, 0)
            assert dispatch["intra_node"] == combine["intra_node"] == 0


def test_nvshmem_packing_gives_the_reference_result(results):
    """nvshmem_split with the op emulated from its contract (packed by destination, received packed by source at the
    offsets it reports), over buffers whose stale contents are 7s, equals the reference bit for bit."""
    for rank, rounds in enumerate(results):
        for round_, res in enumerate(rounds):
            (rows, counts), (meta, meta_counts) = res["nvshmem"]
            assert torch.equal(rows, res["got"]) and torch.equal(meta, res["meta"]), (rank, round_)
            assert counts.tolist() == meta_counts.tolist() == res["received"].tolist()
