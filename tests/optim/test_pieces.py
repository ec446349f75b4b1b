"""ZeroOptimizer.pieces: per param, the runs of its flattened elements each rank's shard holds, as views of the live
master and optimizer state (what checkpoints write and read); checked on every rank of a fake 4-rank world."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import optim.shard
from optim import ZeroOptimizer

SHAPES = [(3, 5), (7,), (40,), (2, 2)]
WORLD = 4


def rank_pieces(rank: int, dtype: torch.dtype) -> list[tuple[int, int, int, dict, dict]]:
    """(param index, start, length, state views, scalars) of rank's pieces after reset_state, with checks."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in SHAPES]
        opt = ZeroOptimizer(params, bucket_cap_mb=24 * 4 / 2**20)
        assert all(set(p.state) == {"master"} and not p.scalars for p in opt.pieces())  # no step yet: no state
        opt.reset_state(["exp_avg", "exp_avg_sq"], {"step": torch.tensor(3.0)})
        out = []
        for piece in opt.pieces():
            index = [id(p) for p in params].index(id(piece.param))
            assert set(piece.state) == {"master", "exp_avg", "exp_avg_sq"} and float(piece.scalars["step"]) == 3
            values = piece.param.detach().view(-1)[piece.start:piece.start + piece.length]
            assert torch.equal(piece.state["master"], values.to(piece.state["master"].dtype))
            piece.state["exp_avg"].fill_(index + 1)  # a view: the optimizer's own state changes
            out.append((index, piece.start, piece.length, piece.state, piece.scalars))
        assert all(torch.equal(p.state["exp_avg"], o[3]["exp_avg"]) for p, o in zip(opt.pieces(), out))
        opt.reset_state([], {})
        assert all(set(p.state) == {"master"} and not p.scalars for p in opt.pieces())
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_tile_every_param_once_as_views_cut_at_chunks(dtype, monkeypatch):
    monkeypatch.setattr(optim.shard, "CHUNK", 7)  # inner-optimizer chunks of 7 elements: runs are cut at them
    runs = {i: [] for i in range(len(SHAPES))}
    for rank in range(WORLD):
        for index, start, length, state, _ in rank_pieces(rank, dtype):
            assert 0 < length <= 7 and state["master"].dtype == torch.float32
            runs[index].append((start, length))
    for index, found in runs.items():
        covered = [e for start, length in found for e in range(start, start + length)]
        assert sorted(covered) == list(range(torch.Size(SHAPES[index]).numel())), index
    assert len(runs[2]) > WORLD  # the 40-element param spans chunks on every rank


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_local_grads_are_zero1s_fp32_sums_whatever_the_param_dtype(dtype):
    """A bf16 param's grad is moved into ZeRO-1's fp32 buffer as it arrives (.grad dropped): local_grads hands out
    those sums (views: writing them is what the TP sum of partial grads does), for fp32 params the bound .grad."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        params = [torch.nn.Parameter(torch.ones(s, dtype=dtype)) for s in SHAPES]
        opt = ZeroOptimizer(params, bucket_cap_mb=24 * 4 / 2**20)
        opt.zero_grad(set_to_none=False)
        for k in (1, 2):  # two micro-batches accumulate
            sum(k * p.float().sum() for p in params).backward()
        grads = opt.local_grads(params[::-1])
        assert [g.dtype for g in grads] == [torch.float32] * len(SHAPES)
        assert all(torch.equal(g, torch.full(p.shape, 3.0)) for g, p in zip(grads, params[::-1]))
        assert all((p.grad is None) == (dtype == torch.bfloat16) for p in params)
        grads[0].mul_(2)  # a view of the sums the reduction reads
        assert torch.equal(opt.local_grads([params[-1]])[0], torch.full(SHAPES[-1], 6.0))
    finally:
        dist.destroy_process_group()
