"""RMSNorm whose backward keeps only its input and one fp32 rstd per row, on every device."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm with a fixed memory footprint: on CUDA torch's fused kernel, elsewhere (CPU runs, a meta
    rehearsal) _RMSNorm, which saves what that kernel saves instead of the composite form's fp32 copies of the
    input and the normalised tensor. The weight's grad is computed in the backward (B), as nn.RMSNorm's."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        if x.is_cuda:
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _RMSNorm.apply(x, self.weight, eps)


class _RMSNorm(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * weight over the last dim, in at least fp32, rounded to x's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # noqa: D102
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # noqa: D102
        x, weight, rstd = ctx.saved_tensors
        normed = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype)
        gw = g * weight.to(rstd.dtype)
        dx = rstd * (gw - normed * (gw * normed).mean(-1, keepdim=True))
        dw = (g * normed).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None
