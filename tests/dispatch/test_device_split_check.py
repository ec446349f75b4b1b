"""dispatch.device_split_check.gpu_check where it cannot run (no CUDA here): a result naming why, not an exception."""

from __future__ import annotations

from dispatch.device_split_check import gpu_check


def test_gpu_check_without_cuda_returns_the_reason():
    result = gpu_check("cpu")
    assert result["ok"] is False and "needs a CUDA device" in result["reason"]
