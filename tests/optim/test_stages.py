"""ZeroOptimizer at stages 2 and 3 and offloaded to the host take the same steps as stage 1 (fp32 and bf16 params, two
micro-batches per step, one gloo rank): the sharding moves bytes, never changes an update."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from optim import ZeroOptimizer

STEPS = 4


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def train(kind: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each param's fp32 master after STEPS clipped steps of ZeroOptimizer in the given configuration."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).to(dtype)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    stage, offload = {"zero1": (1, None), "zero2": (2, None), "zero3": (3, None), "offload1": (1, "cpu"),
                      "offload2": (2, "cpu")}[kind]
    groups = ([{"params": list(m.parameters()), "module": m} for m in linears] if stage == 3
              else model.parameters())
    opt = ZeroOptimizer(groups, lr=1e-2, stage=stage, offload=offload, bucket_cap_mb=300 * 4 / 2**20)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            x = torch.randn(8, 16, generator=generator).to(dtype)
            armed = stage >= 2 or micro == 1
            with opt.reduce_during_backward() if armed else contextlib.nullcontext():
                model(x).float().square().mean().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
    index = {id(p): i for i, p in enumerate(model.parameters())}
    runs = sorted((index[id(piece.param)], piece.start, piece.state["master"]) for piece in opt.pieces())
    return [torch.cat([m for j, _, m in runs if j == i]) for i in range(len(index))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["zero2", "zero3", "offload1", "offload2"])
def test_stage_or_offload_steps_equal_zero1(kind, dtype, one_rank):
    """The fp32 masters (the params themselves for fp32 ZeRO-1/2) bitwise equal after every step."""
    for got, want in zip(train(kind, dtype), train("zero1", dtype), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero2_frees_each_full_grad_bucket_during_the_backward(stage, one_rank):
    """Four layers, one bucket each: sampled at every grad hook of a backward, ZeRO-1 holds all four full grad
    buckets; ZeRO-2 at most the bucket being filled and the one just launched, each freed once reduced."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    opt = ZeroOptimizer(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=(32 * 32 + 32) * 4 / 2**20)
    buckets = [g for shard in opt._shards for g in shard.grad_buckets]
    assert len(buckets) == 4
    seen: list[int] = []
    for p in model.parameters():  # after ZeroOptimizer's own hooks
        p.register_post_accumulate_grad_hook(lambda _: seen.append(sum(g.untyped_storage().nbytes() for g in buckets)))
    opt.zero_grad()
    with opt.reduce_during_backward():
        model(torch.randn(4, 32)).square().sum().backward()
    full = sum(g.numel() * g.element_size() for g in buckets)
    assert max(seen) == full if stage == 1 else max(seen) <= full / 2, (seen, full)
    opt.step()
