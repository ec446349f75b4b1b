"""B/W split without user autograd code: weight grads deferred from a split B into a later W action.

A runtime owns a `WeightGradStore`. While it runs a split backward (`store.capture(key)`), any
op that supports deferral (`nn.Linear` modules the runtime installed `split_linear` on, and any
module whose backward calls `defer_weight_grad`) computes only its input grad and queues the
weight-grad computation under `key`; `store.run(key)` (the W action) executes the queue.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Hashable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ACTIVE: ContextVar[WeightGradStore | None] = ContextVar("pipeline_wgrad_store", default=None)


class WeightGradStore:
    """Queued weight-grad closures per key (one key per split backward), run by W actions."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, list[tuple[Callable[[], None], int]]] = {}
        self._key: Hashable | None = None
        self.held_bytes = 0  # bytes of tensors the queued closures keep alive

    @contextmanager
    def capture(self, key: Hashable) -> Iterator[None]:
        """Within this block, deferrable weight grads are queued under key instead of computed."""
        token = _ACTIVE.set(self)
        self._key = key
        self._queues.setdefault(key, [])
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            self._key = None

    def push(self, fn: Callable[[], None], nbytes: int = 0) -> None:
        """Queue fn (keeping nbytes of tensors alive until it runs) under the key being captured."""
        self._queues[self._key].append((fn, nbytes))
        self.held_bytes += nbytes

    def run(self, key: Hashable) -> int:
        """Execute and drop the closures queued under key; return how many ran."""
        fns = self._queues.pop(key, [])
        for fn, nbytes in fns:
            fn()
            self.held_bytes -= nbytes
        return len(fns)

    def pending(self) -> int:
        """Closures queued and not yet run."""
        return sum(map(len, self._queues.values()))


def accumulate_grad(param: Tensor, grad: Callable[[], Tensor], fused: Callable[[Tensor], None]) -> None:
    """Add grad() to param.grad: for a leaf without post-accumulate hooks, by assignment or by
    fused(param.grad) (an in-place `acc += grad` kernel such as addmm_, no temporary); otherwise
    through autograd, so hooks run and non-leaf params pass the grad on to their leaves."""
    if not param.is_leaf or getattr(param, "_post_accumulate_grad_hooks", None):
        torch.autograd.backward(param, grad())
        return
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad()
        else:
            fused(param.grad)


def defer_weight_grad(weight: Tensor, compute: Callable[[], None], holds: tuple[Tensor, ...] = ()) -> bool:
    """Call from a backward: inside a split B, queue `compute()` (which accumulates weight's grad,
    e.g. with accumulate_grad) for the W action and return True (the backward then returns None
    for weight); elsewhere return False. holds: tensors compute keeps alive (memory accounting)."""
    store = _ACTIVE.get()
    if store is None or not weight.requires_grad:
        return False
    store.push(compute, sum(t.nbytes for t in holds))
    return True


def _linear_weight_grads(weight: Tensor, bias: Tensor | None, x2: Tensor, dy2: Tensor) -> None:
    if weight.requires_grad:
        accumulate_grad(weight, lambda: dy2.t() @ x2, lambda acc: acc.addmm_(dy2.t(), x2))
    if bias is not None and bias.requires_grad:
        accumulate_grad(bias, lambda: dy2.sum(0), lambda acc: acc.add_(dy2.sum(0)))


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # noqa: D102
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.bias = bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        if not (ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2])):
            return dx, None, None
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        bias = ctx.bias
        if not defer_weight_grad(weight, lambda: _linear_weight_grads(weight, bias, x2, dy2), (x2, dy2)):
            _linear_weight_grads(weight, bias, x2, dy2)
        return dx, None, None


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
