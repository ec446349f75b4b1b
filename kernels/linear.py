"""FP8 grouped linear with autograd: e4m3 forward, dgrad and k-grouped wgrad with fp32 accumulation."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import checks
from kernels.ops import run


class FP8GroupedLinear(torch.autograd.Function):
    """out[rows of g] = x[rows of g] @ w[g].T with x in 1x128 tiles and w in 128x128 blocks of e4m3.

    Backward: dx = dy @ w (dy in 1x128 tiles, w's blocks transposed); dw[g] = dy_g^T @ x_g with both
    operands in 1x128 tiles along tokens (k-grouped); every product accumulates in fp32.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offs: Tensor, backend: str | None) -> Tensor:  # noqa: D102
        x = x.contiguous()
        w_q, w_scale = run("quantize_weight", backend, w)
        x_q, x_scale = run("quantize_activation", backend, x)
        ctx.save_for_backward(x, w_q, w_scale, offs)
        ctx.backend, ctx.w_dtype = backend, w.dtype
        return run("gemm", backend, x_q, x_scale, w_q, w_scale, offs, x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        x, w_q, w_scale, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dy_q, dy_scale = run("quantize_activation", ctx.backend, dy)
            dx = run("dgrad", ctx.backend, dy_q, dy_scale, w_q, w_scale, offs, x.dtype)
        if ctx.needs_input_grad[1]:
            dy_t, dy_t_scale = run("quantize_activation_kgrouped", ctx.backend, dy, offs)
            x_t, x_t_scale = run("quantize_activation_kgrouped", ctx.backend, x, offs)
            dw = run("wgrad", ctx.backend, dy_t, dy_t_scale, x_t, x_t_scale, offs).to(ctx.w_dtype)
        return dx, dw, None, None


def fp8_grouped_linear(x: Tensor, w: Tensor, offs: Tensor, *, backend: str | None = None) -> Tensor:
    """Differentiable FP8 grouped linear: x [M, K] rows sorted by group, w [G, N, K], offs int32 [G]
    cumulative group ends -> [M, N] in x.dtype. Triton on CUDA, the torch reference on CPU."""
    checks.check_float("x", x, 2)
    checks.check_float("w", w, 3)
    checks.check_same_size("reduction size K", ("x.shape[1]", x.shape[1]), ("w.shape[2]", w.shape[2]))
    checks.check_offs(offs, x.shape[0], w.shape[0])
    checks.check_same_device(x=x, w=w, offs=offs)
    return FP8GroupedLinear.apply(x, w, offs, backend)
