"""The local multi-process runner returns every rank's result and surfaces a failing rank."""

import time

import pytest
import torch
import torch.distributed as dist

from dispatch.multiproc import WorkerError, run_processes


def _sum_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _rank_one_fails_others_wait(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    dist.barrier()


def test_results_come_back_in_rank_order():
    assert run_processes(_sum_ranks, 3) == [6.0, 6.0, 6.0]


def test_failing_rank_raises_with_traceback_and_does_not_hang():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank one fails on purpose"):
        run_processes(_rank_one_fails_others_wait, 2, timeout_s=20)
    assert time.monotonic() - start < 60
