"""B/W split without user autograd code: nn.Linear weight grads deferred from a split B into a W action.

The deferral core (`WeightGradStore`, `defer_weight_grad`, `accumulate_grad`) lives in
kernels.wgrad_defer, below every package that defers (the grouped expert linears of moe and
kernels use it too); this module re-exports it and adds `split_linear`, which the runtime
installs on the stages' `nn.Linear` modules. A deferred Linear weight grad carries a merge key
(the weight), so a W action covering several chunks computes it as one GEMM over all their rows.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.wgrad_defer import WeightGradStore, accumulate_grad, accumulates_in_place, defer_weight_grad

__all__ = ["WeightGradStore", "accumulate_grad", "defer_weight_grad", "install_split_linear", "split_linear"]


def _linear_weight_grads(weight: Tensor, bias: Tensor | None, x2: Tensor, dy2: Tensor) -> None:
    if weight.requires_grad:
        accumulate_grad(weight, lambda: dy2.t() @ x2, lambda acc: acc.addmm_(dy2.t(), x2))
    if bias is not None and bias.requires_grad:
        accumulate_grad(bias, lambda: dy2.sum(0), lambda acc: acc.add_(dy2.sum(0)))


def _merged_linear_weight_grads(weight: Tensor, bias: Tensor | None, parts: list[tuple[Tensor, Tensor]]) -> None:
    """The weight grads of several chunks' (x2, dy2) at once, their rows stacked."""
    if len(parts) == 1:
        _linear_weight_grads(weight, bias, *parts[0])
    else:
        _linear_weight_grads(weight, bias, torch.cat([x for x, _ in parts]), torch.cat([dy for _, dy in parts]))


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # noqa: D102
        ctx.save_for_backward(x)
        # weight and bias held as they are: a saved-tensor hook (a meter, moe.recompute) hands back an alias of a
        # saved leaf, into which a deferred weight grad would accumulate instead of the parameter
        ctx.weight, ctx.bias = weight, bias
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        (x,), weight = ctx.saved_tensors, ctx.weight
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        if not (ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2])):
            return dx, None, None
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        bias = ctx.bias
        run_all = partial(_merged_linear_weight_grads, weight, bias)
        if defer_weight_grad(weight, partial(run_all, [(x2, dy2)]), (x2, dy2),
                             (("linear", id(weight)), run_all, (x2, dy2)), (bias,) if ctx.has_bias else ()):
            return dx, None, None
        if accumulates_in_place(weight) and (bias is None or accumulates_in_place(bias)):
            _linear_weight_grads(weight, bias, x2, dy2)  # into .grad, no temporary
            return dx, None, None
        # returned, not added from here: autograd then accumulates (and runs the grad hooks) once per param
        return (dx, dy2.t() @ x2 if ctx.needs_input_grad[1] else None,
                dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None)


def split_linear(module: nn.Linear, x: Tensor) -> Tensor:
    """nn.Linear forward whose weight (and bias) grads can be deferred to a W action."""
    return _SplitLinear.apply(x, module.weight, module.bias)


def install_split_linear(modules: list[nn.Module]) -> list[nn.Linear]:
    """Route the forward of every nn.Linear inside modules through split_linear; return them."""
    installed = []
    for root in modules:
        for m in root.modules():
            if type(m) is nn.Linear and "forward" not in m.__dict__:
                m.forward = split_linear.__get__(m)
                installed.append(m)
    return installed
