"""Bad input fails early and locally; a failed or killed rank never leaves the others waiting unbounded."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dispatch import EPDispatcher
from launch.parallel.spawn import WorkerError, run_processes

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

GROUP_TIMEOUT_S = 6.0
BAD_INPUTS = {  # name -> (x, indices, weights) for 8 experts
    "expert id out of range": (torch.zeros(2, 4), torch.tensor([[0, 8], [1, 2]]), torch.ones(2, 2)),
    "x rows differ from indices": (torch.zeros(3, 4), torch.tensor([[0, 1], [1, 2]]), torch.ones(2, 2)),
    "weights shape differs": (torch.zeros(2, 4), torch.tensor([[0, 1], [1, 2]]), torch.ones(2, 3)),
}


def _bad_input_then_a_failed_rank(rank: int, world_size: int) -> dict:
    group = dist.new_group(timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    out: dict = {}
    with pytest.raises(ValueError, match="num_experts = 6 must be divisible by the EP size 4"):
        EPDispatcher(6, group=group, gpus_per_node=2)
    dispatcher = EPDispatcher(8, group=group, gpus_per_node=2, backend="hierarchical")
    if rank == 0:  # only rank 0 calls: any communication would wait for the group timeout
        for name, (x, indices, weights) in BAD_INPUTS.items():
            start = time.monotonic()
            try:
                dispatcher.dispatch(x, indices, weights)
            except ValueError as err:
                out[name] = (str(err), time.monotonic() - start)
    dist.barrier()
    if rank == 1:  # this rank fails before reaching the collective and leaves
        return {"survived": None}
    start = time.monotonic()
    try:
        dispatcher.dispatch(torch.ones(4, 4), torch.tensor([[0, 7]] * 4), torch.ones(4, 2))
    except RuntimeError as err:
        out["survived"] = (type(err).__name__, time.monotonic() - start)
    return out


def _rank_killed_mid_dispatch(rank: int, world_size: int, log_dir: str) -> None:
    dispatcher = EPDispatcher(8, gpus_per_node=2)
    if rank == 2:  # dies once the others are about to wait on it, so a loaded machine cannot reorder this
        while len([p for p in os.listdir(log_dir) if p.startswith("ready")]) < world_size - 1:
            time.sleep(0.01)
        time.sleep(0.2)
        os._exit(3)
    open(os.path.join(log_dir, f"ready{rank}"), "w").close()
    start = time.monotonic()
    try:
        dispatcher.dispatch(torch.ones(4, 4), torch.tensor([[0, 7]] * 4), torch.ones(4, 2))
    except RuntimeError:
        with open(os.path.join(log_dir, f"rank{rank}"), "w") as log:
            log.write(str(time.monotonic() - start))
        raise


def test_bad_input_raises_before_communication_and_survivors_of_a_failed_rank_exit():
    results = run_processes(_bad_input_then_a_failed_rank, 4, timeout_s=90)
    for name, (message, seconds) in ((n, results[0][n]) for n in BAD_INPUTS):
        assert seconds < GROUP_TIMEOUT_S / 2, name  # no collective was waited on
    assert "indices must lie in [-1, 7]" in results[0]["expert id out of range"][0]
    assert "x must be [num_tokens=2, hidden]" in results[0]["x rows differ from indices"][0]
    assert "weights shape [2, 3] must equal indices shape [2, 2]" in results[0]["weights shape differs"][0]
    assert results[1] == {"survived": None}
    for rank in (0, 2, 3):
        kind, seconds = results[rank]["survived"]
        assert seconds < GROUP_TIMEOUT_S + 20, (rank, kind, seconds)


def test_a_killed_rank_ends_the_run_promptly_and_survivors_raise_by_themselves(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 2 died|remote worker"):
        run_processes(_rank_killed_mid_dispatch, 4, str(tmp_path), timeout_s=120)
    assert time.monotonic() - start < 60  # run_processes has killed and joined every rank: no log is still written
    logs = {p.name: float(p.read_text() or "nan") for p in tmp_path.iterdir() if not p.name.startswith("ready")}
    assert logs and set(logs) <= {"rank0", "rank1", "rank3"}
    assert all(seconds < 30 for seconds in logs.values()), logs
