"""FP8 grouped linear with autograd: e4m3 forward, dgrad and k-grouped wgrad with fp32 accumulation."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import checks
from kernels.ops import run
from kernels.wgrad_defer import weight_grad_or_defer


def _wgrad(dy: Tensor, x: Tensor, offs: Tensor, backend: str | None, w_dtype: torch.dtype) -> Tensor:
    """dw[g] = dy_g^T @ x_g, both operands in 1x128 tiles along tokens, fp32 accumulation, cast to w_dtype."""
    dy_t, dy_t_scale = run("quantize_activation_kgrouped", backend, dy, offs)
    x_t, x_t_scale = run("quantize_activation_kgrouped", backend, x, offs)
    return run("wgrad", backend, dy_t, dy_t_scale, x_t, x_t_scale, offs).to(w_dtype)


class FP8GroupedLinear(torch.autograd.Function):
    """out[rows of g] = x[rows of g] @ w[g].T with x in 1x128 tiles and w in 128x128 blocks of e4m3.

    Backward: dx = dy @ w (dy in 1x128 tiles, w's blocks transposed); dw[g] = dy_g^T @ x_g with both
    operands in 1x128 tiles along tokens (k-grouped); every product accumulates in fp32. Inside a
    kernels.wgrad_defer capture dw is left to the W action.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offs: Tensor, backend: str | None) -> Tensor:  # noqa: D102
        x = x.contiguous()
        w_q, w_scale = run("quantize_weight", backend, w)
        x_q, x_scale = run("quantize_activation", backend, x)
        ctx.save_for_backward(x, w, offs)  # not w_q: an e4m3 copy per micro-batch in flight; backward requantises
        ctx.backend, ctx.w_dtype = backend, w.dtype
        return run("gemm", backend, x_q, x_scale, w_q, w_scale, offs, x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        x, w, offs = ctx.saved_tensors
        backend, w_dtype = ctx.backend, ctx.w_dtype
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_q, w_scale = run("quantize_weight", backend, w)
            dy_q, dy_scale = run("quantize_activation", backend, dy)
            dx = run("dgrad", backend, dy_q, dy_scale, w_q, w_scale, offs, x.dtype)
        if ctx.needs_input_grad[1]:  # inside a split backward's capture: computed by the W action
            dw = weight_grad_or_defer(ctx, 1, lambda: _wgrad(dy, x, offs, backend, w_dtype), (x, dy))
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
