"""Which implementation runs: Triton on CUDA tensors, the torch reference on CPU, unless forced."""

from __future__ import annotations

import os

from torch import Tensor

BACKENDS = ("auto", "triton", "torch")
BACKEND_ENV = "MOE_KERNELS_BACKEND"


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
