"""dispatch.device_split_check.gpu_check here, without CUDA: a result naming why, not an exception; and its two checks
run on the CPU (1 gloo rank) with all_to_all_vdev emulated from its contract, so that what the GPU runs is known to
pass where the op keeps that contract."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from dispatch import device_split
from dispatch.device_split import NvshmemBuffers
from dispatch.device_split_check import _check_exchange, _check_layer, gpu_check
from launch.parallel.spawn import run_processes
from tests.dispatch.test_device_split import emulated_vdev


def test_gpu_check_without_cuda_returns_the_reason():
    result = gpu_check("cpu")
    assert result["ok"] is False and "needs a CUDA device" in result["reason"]


def _checks(rank: int, world_size: int) -> tuple[dict, dict]:
    with mock.patch.object(device_split, "all_to_all_vdev", emulated_vdev), \
            mock.patch.object(NvshmemBuffers, "make", lambda self, shape, dtype, device:
                              torch.full(shape, 7, dtype=dtype)), \
            mock.patch.object(torch.cuda, "synchronize", lambda *args: None):
        return _check_exchange(torch.device("cpu"), dist.group.WORLD), _check_layer(torch.device("cpu"))


@pytest.mark.slow  # spawns a process
def test_gpu_checks_pass_on_the_cpu_with_the_op_emulated():
    exchange, layer = run_processes(_checks, 1, timeout_s=120)[0]
    assert exchange["bitwise"] and [case["count"] for case in exchange["cases"]][:2] == [0, 8]
    assert layer["max_abs_diff"] <= layer["bound"]
