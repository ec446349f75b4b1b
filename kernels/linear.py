"""FP8 grouped linear with autograd: e4m3 forward, dgrad and k-grouped wgrad with fp32 accumulation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import checks
from kernels.ops import run
from kernels.quant_ref import dequantize_activation
from kernels.wgrad_defer import weight_grad_or_defer


@dataclass
class FP8Rows:
    """Rows already in e4m3 with 1x128 tile scales (e.g. an fp8 dispatch's), the FP8 grouped linear's x as is.

    rows stands for their dequantised values in the dtype gradients take: autograd's input, which the
    linear's dx flows to; its values are never read, so it may be a zero-stride stand-in.
    """

    q: Tensor      # e4m3 [M, K]
    scale: Tensor  # fp32 [M, ceil(K/128)]
    rows: Tensor   # [M, K] stand-in of q * scale


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
    def forward(ctx, x: Tensor, w: Tensor, offs: Tensor, backend: str | None, x_q: Tensor | None = None,
                x_scale: Tensor | None = None) -> Tensor:  # noqa: D102
        w_q, w_scale = run("quantize_weight", backend, w)
        if x_q is None:
            x = x.contiguous()
            x_q, x_scale = run("quantize_activation", backend, x)
            saved = (x,)
        else:  # pre-quantised: x only stands in for q * scale, which backward rebuilds for the wgrad
            saved = (x_q, x_scale)
        ctx.save_for_backward(w, offs, *saved)  # not w_q: an e4m3 copy per micro-batch in flight; backward requantises
        ctx.backend, ctx.w_dtype, ctx.x_dtype = backend, w.dtype, x.dtype
        return run("gemm", backend, x_q, x_scale, w_q, w_scale, offs, x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        w, offs, *saved = ctx.saved_tensors
        x = saved[0] if len(saved) == 1 else dequantize_activation(*saved).to(ctx.x_dtype)
        backend, w_dtype = ctx.backend, ctx.w_dtype
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_q, w_scale = run("quantize_weight", backend, w)
            dy_q, dy_scale = run("quantize_activation", backend, dy)
            dx = run("dgrad", backend, dy_q, dy_scale, w_q, w_scale, offs, x.dtype)
        if ctx.needs_input_grad[1]:  # inside a split backward's capture: computed by the W action
            dw = weight_grad_or_defer(ctx, 1, lambda: _wgrad(dy, x, offs, backend, w_dtype), (x, dy))
        return dx, dw, None, None, None, None


def fp8_grouped_linear(x: Tensor | FP8Rows, w: Tensor, offs: Tensor, *, backend: str | None = None) -> Tensor:
    """Differentiable FP8 grouped linear: x [M, K] rows sorted by group (or FP8Rows, used without
    requantising), w [G, N, K], offs int32 [G] cumulative group ends -> [M, N] in x's dtype. Triton on CUDA,
    the torch reference on CPU."""
    if isinstance(x, FP8Rows):
        checks.check_fp8("x.q", x.q, 2)
        checks.check_scale("x.scale", x.scale, checks.activation_scale_shape(x.q))
        checks.check_same_size("rows", ("x.q.shape[0]", x.q.shape[0]), ("x.rows.shape[0]", x.rows.shape[0]))
        checks.check_same_size("row width", ("x.q.shape[1]", x.q.shape[1]), ("x.rows.shape[1]", x.rows.shape[1]))
        checks.check_same_device(x_q=x.q, x_scale=x.scale, w=w)
        x, pre = x.rows, (x.q, x.scale)
    else:
        pre = ()
    checks.check_float("x", x, 2)
    checks.check_float("w", w, 3)
    checks.check_same_size("reduction size K", ("x.shape[1]", x.shape[1]), ("w.shape[2]", w.shape[2]))
    checks.check_offs(offs, x.shape[0], w.shape[0])
    checks.check_same_device(x=x, w=w, offs=offs)
    return FP8GroupedLinear.apply(x, w, offs, backend, *pre)
