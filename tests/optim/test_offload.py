"""ZeRO-Offload's host<->device traffic: counted on the meta device (the "device") with host memory on the CPU,
rank 0 of a fake 2-rank world; one grad copy to the host and one param copy back per bucket and step."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from optim import ZeroOptimizer

SIZES = [40, 24, 56]  # each larger than the bucket cap: one bucket per param
CAP_MB = 16 * 4 / 2**20  # 16 fp32 elements
STEPS = 3


class CountCopies(TorchDispatchMode):
    """Counts the aten copies (copy_, _to_copy) whose source and destination devices differ, by direction; one
    touching the meta device is not run (meta holds no values): copy_ returns its destination, _to_copy an empty
    tensor where asked."""

    def __init__(self) -> None:
        super().__init__()
        self.to_host = self.to_device = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            source, target, make = args[1].device, args[0].device, lambda: args[0]
        elif func is torch.ops.aten._to_copy.default:
            source, target = args[0].device, kwargs.get("device") or args[0].device
            make = lambda: torch.empty(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=target)
        else:
            return func(*args, **kwargs)
        if torch.device(source) == torch.device(target):
            return func(*args, **kwargs)
        if torch.device(target).type == "cpu":
            self.to_host += 1
        else:
            self.to_device += 1
        return make() if "meta" in (torch.device(source).type, torch.device(target).type) else func(*args, **kwargs)


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_copies_one_grad_shard_out_and_one_param_shard_back_per_bucket_and_step(stage, fake_world):
    params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in SIZES]
    with CountCopies() as counted:
        opt = ZeroOptimizer(params, bucket_cap_mb=CAP_MB, stage=stage, offload="cpu")
        assert (counted.to_host, counted.to_device) == (len(SIZES), 0)  # the masters' first copy
        counted.to_host = 0
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=False)
            for m in range(2):  # two micro-batches (ZeRO-1 reduces after the last, ZeRO-2 after each): no copies
                with opt.reduce_during_backward() if stage == 2 or m == 1 else contextlib.nullcontext():
                    sum(p.square().sum() for p in params).backward()
            opt.step()
    assert (counted.to_host, counted.to_device) == (STEPS * len(SIZES), STEPS * len(SIZES))
    for piece in opt.pieces():
        assert piece.param.device.type == "meta"
        assert {t.device.type for t in [*piece.state.values(), *piece.scalars.values()]} == {"cpu"}
        assert set(piece.state) == {"master", "exp_avg", "exp_avg_sq"}


def test_without_offload_nothing_crosses(fake_world):
    params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in SIZES]
    with CountCopies() as counted:
        opt = ZeroOptimizer(params, bucket_cap_mb=CAP_MB)
        opt.zero_grad(set_to_none=False)
        sum(p.square().sum() for p in params).backward()
        opt.step()
    assert (counted.to_host, counted.to_device) == (0, 0)


def test_offload_with_zero3_is_refused(fake_world):
    with pytest.raises(ValueError, match="allowed with offload: stage 1 or 2"):
        ZeroOptimizer([torch.nn.Parameter(torch.empty(4, device="meta"))], stage=3, offload="cpu")
