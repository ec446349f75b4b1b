"""FP8 linears with autograd: e4m3 forward, dgrad and k-grouped wgrad with fp32 accumulation.

One autograd Function serves the routed experts (`fp8_grouped_linear`, G weight groups over rows sorted by group)
and every other linear (`FP8Linear`, an nn.Linear computed as a grouped linear of one group). What it keeps for
backward is the e4m3 tiles (+ fp32 scales) its forward made of its input, never a float copy of the input:

- Fprop quantises the input x [M, K] in 1x128 tiles along K (the hidden dim) and the weight in 128x128 blocks;
- Dgrad quantises dy [M, N] in 1x128 tiles along N and the weight in the same 128x128 blocks written K-major for
  this product ([G, K, N], kernels.quantize_weight(transposed=True): no transpose pass, the scales shared);
- Wgrad dw = dy^T x needs both operands in 1x128 tiles along the tokens (M, "k-grouped"), while the saved tiles run
  along K. Backward re-tiles them as DeepSeek-V3 does: dequantise the saved e4m3 rows (to fp32: relative rounding
  2^-24, the product of a 4-bit significand and the scale), requantise
  them k-grouped, in one op (ops.retile_kgrouped; on GPU one kernel that dequantises in registers, never an fp32
  copy of x). That is a second e4m3 rounding of x on top of the forward's: relative error <= 2^-4 per element
  each, so the wgrad's x operand is off by up to (1 + 2^-4)^2 - 1 ~ 2^-3.9 instead of 2^-4 (plus e4m3's subnormal
  steps for elements far below their tile's maximum); tests/kernels/test_fp8_linear.py measures it.

The weight is kept as it is (not its e4m3 blocks: one copy per micro-batch in flight); backward requantises it.
Inside a kernels.wgrad_defer capture (the pipeline's B/W split) dw is left to the W action, which holds the saved
e4m3 tiles (never a dequantised copy) and dy until it runs: a grouped linear's (the routed experts') dy as the
wgrad's own e4m3 operand, quantised along tokens in B (the same tiles W would make: bitwise the same dw, at about half
dy's bytes); a plain linear's dy as it is, since its deferred wgrads of several chunks merge into one GEMM over all
their rows (one group), whose token tiles run across the chunks.

`keep_input`: the input is a tensor another op keeps anyway (the attention core keeps its output for its own
backward, and the out projection reads it through a view): the linear saves that view, no bytes of its own, and its
immediate wgrad quantises it k-grouped directly (no re-tiling); a deferred wgrad quantises it in 1x128 rows at B
time and holds those, so the core's output is freed with the core's backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from kernels import checks
from kernels.ops import run
from kernels.wgrad_defer import accumulate_grad, capturing, defer_weight_grad, grad_target


@dataclass
class FP8Rows:
    """Rows already in e4m3 with 1x128 tile scales (an fp8 dispatch's, or a norm's output its caller quantised),
    an FP8 linear's x as is.

    rows stands for their dequantised values in the dtype gradients take: autograd's input, which the linear's dx
    flows to, [M, K] or [..., K] with M rows in all; its values are never read, so it may be a zero-stride stand-in.
    """

    q: Tensor      # e4m3 [M, K]
    scale: Tensor  # fp32 [M, ceil(K/128)]
    rows: Tensor   # [..., K] stand-in of q * scale


def _wgrad(dy: Tensor | tuple[Tensor, Tensor], x_t: tuple[Tensor, Tensor], offs: Tensor, backend: str | None,
           w_dtype: torch.dtype, rows: int) -> Tensor:
    """dw[g] = dy_g^T @ x_g from x's k-grouped tiles x_t (e4m3, scales) of its rows rows, dy quantised the same way
    (or given as those tiles already: quantize_activation_kgrouped's (q, scale)), fp32 accumulation, in w_dtype."""
    dy_t = dy if isinstance(dy, tuple) else run("quantize_activation_kgrouped", backend, dy, offs)
    return run("wgrad", backend, *dy_t, *x_t, offs, rows).to(w_dtype)


def _kgrouped_wgrad(dy: Tensor, x: Tensor, offs: Tensor, backend: str | None, w_dtype: torch.dtype) -> Tensor:
    """The wgrad from x itself, quantised in 1x128 tiles along tokens."""
    return _wgrad(dy, run("quantize_activation_kgrouped", backend, x, offs), offs, backend, w_dtype, x.shape[0])


def _retiled_wgrad(dy: Tensor | tuple[Tensor, Tensor], x_q: Tensor, x_scale: Tensor, offs: Tensor, backend: str | None,
                   w_dtype: torch.dtype) -> Tensor:
    """The wgrad from the forward's e4m3 rows (1x128 tiles along K), re-tiled along tokens by one op
    (retile_kgrouped: the k-grouped quantisation of their dequantised values, no fp32 copy on GPU)."""
    return _wgrad(dy, run("retile_kgrouped", backend, x_q, x_scale, offs), offs, backend, w_dtype, x_q.shape[0])


def _merged_wgrad(weight: Tensor, backend: str | None, parts: list[tuple[Tensor, Tensor, Tensor]]) -> None:
    """A plain FP8 linear's deferred wgrads of several chunks (each (x_q, x_scale, dy)) as one group of all their rows,
    accumulated into weight's grad."""
    x_q, x_scale, dy = (torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*parts))
    offs = torch.full((1,), dy.shape[0], dtype=torch.int32, device=dy.device)

    def grad() -> Tensor:
        return _retiled_wgrad(dy, x_q, x_scale, offs, backend, weight.dtype)[0]

    accumulate_grad(weight, grad, lambda acc: acc.add_(grad()))


class FP8GroupedLinear(torch.autograd.Function):
    """out[rows of g] = x[rows of g] @ w[g].T with x in 1x128 tiles and w in 128x128 blocks of e4m3 (w [G, N, K]; a
    2-D w [N, K] is one group). x has `fold` trailing dims making K ([..., K], or [..., heads, D] with fold 2).

    Saved for backward: w, offs and the e4m3 tiles of x with their scales (x_q, x_scale as made or handed over),
    or with keep_input x itself (see the module doc). Backward: dx = dy @ w (dy in 1x128 tiles, w's blocks
    transposed); dw[g] = dy_g^T @ x_g from the re-tiled x (module doc), fp32 accumulation throughout.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offs: Tensor, backend: str | None, x_q: Tensor | None,
                x_scale: Tensor | None, keep_input: bool, fold: int) -> Tensor:  # noqa: D102
        lead, k = x.shape[:x.dim() - fold], w.shape[-1]
        w_q, w_scale = run("quantize_weight", backend, w if w.dim() == 3 else w.unsqueeze(0))
        if x_q is None:
            x_q, x_scale = run("quantize_activation", backend, x.reshape(-1, k).contiguous())
        ctx.save_for_backward(w, offs, *((x,) if keep_input else (x_q, x_scale)))
        ctx.backend, ctx.keep_input, ctx.k, ctx.x_shape, ctx.x_dtype = backend, keep_input, k, x.shape, x.dtype
        out = run("gemm", backend, x_q, x_scale, w_q, w_scale, offs, x.dtype)
        return out.view(*lead, out.shape[-1])

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        w, offs, *saved = ctx.saved_tensors
        backend, grouped = ctx.backend, w.dim() == 3
        dy = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_t, w_scale = run("quantize_weight_t", backend, w if grouped else w.unsqueeze(0))
            dy_q, dy_scale = run("quantize_activation", backend, dy)
            dx = run("dgrad", backend, dy_q, dy_scale, w_t, w_scale, offs, ctx.x_dtype).view(ctx.x_shape)
            del w_t  # not held through the wgrad
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(ctx, w, offs, saved, dy, grouped)
        return dx, dw, None, None, None, None, None, None


def _weight_grad(ctx, w: Tensor, offs: Tensor, saved: list[Tensor], dy: Tensor, grouped: bool) -> Tensor | None:
    """dw now, or None when deferred to the W action (inside a kernels.wgrad_defer capture)."""
    backend, w_dtype = ctx.backend, w.dtype
    target = grad_target(ctx, 1)
    deferred = capturing(target)
    if ctx.keep_input:
        x = saved[0].reshape(-1, ctx.k)
        if not deferred:
            dw = _kgrouped_wgrad(dy, x, offs, backend, w_dtype)
            return dw if grouped else dw[0]
        saved = list(run("quantize_activation", backend, x.contiguous()))  # held by the W action, not x
    x_q, x_scale = saved

    def grad() -> Tensor:
        dw = _retiled_wgrad(dy, x_q, x_scale, offs, backend, w_dtype)
        return dw if grouped else dw[0]

    if not deferred:
        return grad()
    held = (x_q, x_scale, dy)
    if not grouped and isinstance(target, Tensor):  # one group: the chunks' wgrads merge into one GEMM
        run_all = partial(_merged_wgrad, target, backend)
        defer_weight_grad(target, partial(run_all, [held]), held, (("fp8-linear", id(target)), run_all, held))
    else:  # the W action's dy operand made now, in e4m3 along tokens as the wgrad reads it: held at ~half the bytes
        dy_t = tuple(run("quantize_activation_kgrouped", backend, dy, offs))

        def tiled_grad() -> Tensor:
            dw = _retiled_wgrad(dy_t, x_q, x_scale, offs, backend, w_dtype)
            return dw if grouped else dw[0]

        defer_weight_grad(target, lambda: accumulate_grad(target, tiled_grad, lambda acc: acc.add_(tiled_grad())),
                          (x_q, x_scale, *dy_t))
    return None


def _check_rows(x: FP8Rows, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x's rows, q and scale after checking they agree with each other and with w's device."""
    checks.check_fp8("x.q", x.q, 2)
    checks.check_scale("x.scale", x.scale, checks.activation_scale_shape(x.q))
    checks.check_same_size("row width", ("x.q.shape[1]", x.q.shape[1]), ("x.rows.shape[-1]", x.rows.shape[-1]))
    checks.check_same_size("rows", ("x.q.shape[0]", x.q.shape[0]),
                           ("rows of x.rows", math.prod(x.rows.shape[:-1])))
    checks.check_same_device(x_q=x.q, x_scale=x.scale, w=w)
    return x.rows, x.q, x.scale


def fp8_grouped_linear(x: Tensor | FP8Rows, w: Tensor, offs: Tensor, *, backend: str | None = None) -> Tensor:
    """Differentiable FP8 grouped linear: x [M, K] rows sorted by group (or FP8Rows, used without
    requantising), w [G, N, K], offs int32 [G] cumulative group ends on the device -> [M, N] in x's dtype; rows past
    offs[-1] (a padded exchange's) are in no group: their outputs and input grads are not data (zero in the
    reference) and they add nothing to w's grad. Triton on CUDA, the torch reference on CPU; no host read."""
    x, *pre = _check_rows(x, w) if isinstance(x, FP8Rows) else (x, None, None)
    checks.check_float("x", x, 2)
    checks.check_float("w", w, 3)
    checks.check_same_size("reduction size K", ("x.shape[1]", x.shape[1]), ("w.shape[2]", w.shape[2]))
    checks.check_offs(offs, x.shape[0], w.shape[0])
    checks.check_same_device(x=x, w=w, offs=offs)
    return FP8GroupedLinear.apply(x, w, offs, backend, *pre, False, 1)


class FP8Linear(nn.Linear):
    """An nn.Linear (bias-free) whose Fprop, Dgrad and Wgrad GEMMs run in FP8 with the experts' tiles and promotion
    (FP8GroupedLinear with one group): to everything that reads weights (TP sharding, checkpoints, HF export, ZeRO)
    it is the nn.Linear it subclasses, and it defers its own wgrad under the B/W split (pipeline.wgrad's
    split_linear installs itself on plain nn.Linear modules only)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None, *,
                 backend: str | None = None) -> None:
        if bias:
            raise ValueError("FP8Linear has no bias (every FP8 linear of the model is bias-free); pass bias=False")
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.backend = backend

    def forward(self, x: Tensor | FP8Rows, fold: int = 1, keep_input: bool = False) -> Tensor:
        """x [..., in_features] -> [..., out_features]; x may be FP8Rows (its caller quantised the rows, e.g. a
        norm's output rebuilt in backward: moe.linear.fp8_norm_output). fold 2: x is [..., heads, D] with heads x D =
        in_features. keep_input: x is a view of a tensor another op keeps anyway (the attention core's output;
        module doc), saved as it is instead of as e4m3 tiles."""
        w = self.weight
        if isinstance(x, FP8Rows):
            if keep_input:
                raise ValueError("keep_input saves the input tensor as it is: pass a tensor, not FP8Rows")
            x, *pre = _check_rows(x, w)
        else:
            pre = [None, None]
        width = math.prod(x.shape[x.dim() - fold:])
        checks.check_same_size("input width", ("x's last dims", width), ("in_features", w.shape[1]))
        checks.check_same_device(x=x, w=w)
        offs = torch.full((1,), math.prod(x.shape[:x.dim() - fold]), dtype=torch.int32, device=w.device)
        return FP8GroupedLinear.apply(x, w, offs, self.backend, *pre, keep_input, fold)
