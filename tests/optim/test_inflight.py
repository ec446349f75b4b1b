"""ZeRO's collectives in flight keep their buffers, and no grad or param storage is freed under them (issue 51):
ZeRO-2's zero_grad waits for a reduction in flight before freeing its bucket (a bucket freed under one is
refused), ZeRO-3's release waits for the gathers writing into the params."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import optim.shard
from optim.shard import ShardedParams
from tests.inflight import fake_world, record_works

# collectives -> (owner, the async calls it makes)
CALLS = {"p2p": (dist, ("isend", "irecv")),
         "scatter_gather": (optim.shard, ("_reduce_scatter_flat", "_all_gather_flat"))}


def _sharded(collectives: str, stage: int) -> ShardedParams:
    params = [torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(5))]
    return ShardedParams(params, None, bucket_cap=1 << 20, grad_divisor=2.0, collectives=collectives,
                         shard_grads=stage >= 2, shard_params=stage == 3)


@pytest.mark.parametrize("collectives", CALLS)
def test_zero2_frees_a_bucket_only_once_its_reduction_is_done(collectives: str, monkeypatch: pytest.MonkeyPatch):
    works = record_works(monkeypatch, CALLS[collectives][0], *CALLS[collectives][1])
    with fake_world(2):
        shard = _sharded(collectives, stage=2)
        shard.launch(0)
        assert works and all(w.alive() and not w.waited for w in works)
        with pytest.raises(RuntimeError, match="in flight"):
            shard._free(0)
        shard.zero_grad(set_to_none=True)
        assert all(w.waited for w in works) and shard.grad_buckets[0].untyped_storage().nbytes() == 0
        assert not shard.launched


@pytest.mark.parametrize("collectives", CALLS)
def test_zero3_frees_the_params_only_once_their_gathers_are_done(collectives: str, monkeypatch: pytest.MonkeyPatch):
    works = record_works(monkeypatch, CALLS[collectives][0], *CALLS[collectives][1])
    with fake_world(2):
        shard = _sharded(collectives, stage=3)
        shard.gather()
        assert works and shard.param_flat.untyped_storage().nbytes() > 0
        assert all(w.alive() and not w.waited for w in works)
        shard.release()
        assert all(w.waited for w in works) and shard.param_flat.untyped_storage().nbytes() == 0
