"""ZeRO1 at stages 2 and 3 and offloaded to the host take the same steps as stage 1 (fp32 and bf16 params, two
micro-batches per step, one gloo rank): the sharding moves bytes, never changes an update."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from optim import ZeRO1

STEPS = 4


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def train(kind: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each param's fp32 master after STEPS clipped steps of ZeRO1 in the given configuration."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).to(dtype)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    stage, offload = {"zero1": (1, None), "zero2": (2, None), "zero3": (3, None), "offload1": (1, "cpu"),
                      "offload2": (2, "cpu")}[kind]
    groups = ([{"params": list(m.parameters()), "module": m} for m in linears] if stage == 3
              else model.parameters())
    opt = ZeRO1(groups, lr=1e-2, stage=stage, offload=offload, bucket_cap_mb=300 * 4 / 2**20)
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
