"""Grouped linear over rows sorted by group: out[rows of g] = x[rows of g] @ w[g].T, with autograd."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.grouped_ref import grouped_rows_matmul, grouped_rows_wgrad
from kernels.wgrad_defer import weight_grad_or_defer

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16)


def group_offsets(counts: Tensor) -> Tensor:
    """Cumulative group ends (int32) from per-group row counts, the `offs` grouped GEMMs take."""
    return torch.cumsum(counts, 0).to(torch.int32)


def _native_ok(*tensors: Tensor) -> bool:
    first = tensors[0]
    if first.dtype not in _GROUPED_MM_DTYPES or not hasattr(torch, "_grouped_mm"):
        return False
    if (first.is_cuda or first.is_meta) and first.dtype != torch.bfloat16:  # meta: torch's kernel takes bf16 only
        return False
    return all(t.shape[-1] % 16 == 0 and t.shape[-2] % 16 == 0 for t in tensors[1:])


def grouped_matmul(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """out[rows of g] = x[rows of g] @ w[g].T for x [M, K], w [G, N, K]; rows past offs[-1] (a padded exchange's
    padding rows) are no group's and come out zero on every path. offs stay on the device. No autograd of its own."""
    if _native_ok(x, w):
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        # torch._grouped_mm leaves the rows past the last group unwritten (whatever the memory held, NaN included,
        # which a padding row's zero combine weight would turn into NaN grads): zeroed as the reference does
        rows = torch.arange(out.shape[0], device=out.device).unsqueeze(1)
        return out.masked_fill_(rows >= offs[-1], 0)
    return grouped_rows_matmul(x, w, offs)  # what torch._grouped_mm cannot take (fp64, odd widths): offs stay put


def grouped_weight_grad(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    """dw[g] = dy[rows of g].T @ x[rows of g]: the k-grouped product a weight gradient needs."""
    if _native_ok(x) and dy.shape[1] % 16 == 0 and x.shape[1] % 16 == 0:
        pad = -x.shape[0] % 16  # rows padded to the kernel's alignment: zero rows past the last group add nothing
        if pad:
            x, dy = F.pad(x, (0, 0, 0, pad)), F.pad(dy, (0, 0, 0, pad))
        return torch._grouped_mm(dy.t(), x, offs=offs)
    return grouped_rows_wgrad(dy, x, offs)


class GroupedLinearFunction(torch.autograd.Function):
    """Autograd for grouped_matmul: dgrad is a grouped matmul with w transposed, wgrad k-grouped
    (deferred to a W action inside a kernels.wgrad_defer capture)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:  # noqa: D102
        ctx.save_for_backward(x, w, offs)
        return grouped_matmul(x, w, offs)

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_matmul(dy, w.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:  # inside a split backward's capture: computed by the W action
            dw = weight_grad_or_defer(ctx, 1, lambda: grouped_weight_grad(dy, x, offs), (x, dy))
        return dx, dw, None


def grouped_linear(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Differentiable grouped linear: x [M, K] sorted by group, w [G, N, K], offs int32 [G] -> [M, N]."""
    return GroupedLinearFunction.apply(x, w, offs)
