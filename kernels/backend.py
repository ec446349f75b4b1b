"""Which implementation runs: Triton on CUDA tensors, the torch reference on CPU, unless forced; and which Triton
FP8 grouped GEMM (forward, dgrad, wgrad): the fast Gluon kernels on sm_90, the `tl` reference elsewhere, unless
forced."""

from __future__ import annotations

import importlib.util
import os
from typing import Literal, get_args

import torch
from torch import Tensor

BACKENDS = ("auto", "triton", "torch")
BACKEND_ENV = "MOE_KERNELS_BACKEND"
GemmKernels = Literal["auto", "fast", "reference"]
GEMM_KERNELS: tuple[str, ...] = get_args(GemmKernels)
GEMM_ENV = "MOE_FP8_GEMM"  # overrides train.fp8_gemm (set_gemm_kernels) when set
_gemm_kernels: list[str] = ["reference"]  # the process's choice, from the run's config (set_gemm_kernels)


def use_triton(tensor: Tensor, backend: str | None = None) -> bool:
    """True when the Triton kernels should run on `tensor` (argument, else $MOE_KERNELS_BACKEND, else auto)."""
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV, "auto")
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if tensor.is_meta:  # a rehearsal's meta tensors: shapes only, which the torch reference gives
        return False
    if choice == "triton" and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")
    return choice == "triton" or (choice == "auto" and tensor.is_cuda)


def set_gemm_kernels(choice: str) -> None:
    """The process's FP8 grouped GEMM choice (train.fp8_gemm): auto | fast | reference; $MOE_FP8_GEMM overrides it."""
    if choice not in GEMM_KERNELS:
        raise ValueError(f"train.fp8_gemm must be one of {', '.join(GEMM_KERNELS)}, got {choice!r}")
    _gemm_kernels[0] = choice


def fast_gemm_runs_on(tensor: Tensor) -> bool:
    """Whether the Gluon kernels can run on tensor's device: CUDA, compute capability 9.0 (wgmma: sm_90 only, not
    sm_100), a Triton with Gluon."""
    return (tensor.is_cuda and torch.cuda.get_device_capability(tensor.device) == (9, 0)
            and importlib.util.find_spec("triton.experimental.gluon") is not None)


def use_fast_gemm(tensor: Tensor) -> bool:
    """True when the FP8 grouped GEMM on `tensor` (already chosen to run in Triton) should be the Gluon kernel:
    $MOE_FP8_GEMM, else set_gemm_kernels' choice; auto: where fast_gemm_runs_on; fast: there, else an error."""
    choice = os.environ.get(GEMM_ENV) or _gemm_kernels[0]
    if choice not in GEMM_KERNELS:
        raise ValueError(f"${GEMM_ENV} must be one of {', '.join(GEMM_KERNELS)}, got {choice!r}")
    if choice == "reference":
        return False
    runs = fast_gemm_runs_on(tensor)
    if choice == "fast" and not runs:
        raise ValueError(f"fp8_gemm 'fast' (train.fp8_gemm or ${GEMM_ENV}) needs a CUDA sm_90 GPU and a Triton with "
                         f"Gluon (>= 3.6); here {tensor.device}: use 'auto' or 'reference'")
    return runs
