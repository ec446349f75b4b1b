"""ZeRO-3's parameter gathers: a module's sharded params all-gathered before each forward and backward, freed after.

A unit is one module holding params of ZeRO-3 groups (the trainer: every module with dense params of its own, a
norm, a linear, a router, the embedding). Its forward pre-hook waits for its gather (starting it if no one did) and
starts the next unit's (the order the units first ran in: the same on every replica, so the collectives match);
its forward hook frees the params, hooks its outputs' grads (tensors, also inside tuples, dicts and dataclasses
such as a routing result) to gather them again before its backward runs, and its inputs' grads to free them
after it. (Saved-tensor hooks would return autograd's alias of a saved param, whose .grad a deferred weight grad
would then set instead of the param's.) A deferred weight grad (kernels.wgrad_defer) needs the layer's input and
output grad, not its weight, so the W after B finds nothing to gather. A unit whose inputs need no grad (the
embedding) stays gathered from its backward to the optimizer step, which frees every unit: the next step gathers
the updated params. Under a pipeline each micro-batch's forward and backward gather again: 2 x micro-batches x the
dense params per step instead of one all-gather (launch.plan counts it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from optim.shard import ShardedParams

FREE, PENDING, READY = "free", "pending", "ready"


class Unit:
    """One module's ZeRO-3 shards and the hooks that gather them around its forward and backward."""

    def __init__(self, module: nn.Module, shards: Sequence[ShardedParams], order: list[Unit]) -> None:
        self.shards = list(shards)
        self.order = order  # every unit, in the order they first ran (shared)
        self.index: int | None = None  # position in order once run
        self.state = FREE
        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)

    def start(self) -> None:
        """Start gathering the full params unless they are held or on their way (the shards hold the gathers)."""
        if self.state == FREE:
            for shard in self.shards:
                shard.gather()
            self.state = PENDING

    def ensure(self) -> None:
        """The full params in place (gathered now if needed)."""
        self.start()
        if self.state == PENDING:
            for shard in self.shards:
                shard.gathered()
            self.state = READY

    def release(self) -> None:
        """Free the full params (a gather in flight is finished first: it writes into them)."""
        if self.state == FREE:
            return
        for shard in self.shards:
            shard.release()
        self.state = FREE

    def _before_forward(self, _module: nn.Module, _args: Any) -> None:
        if self.index is None:
            self.index = len(self.order)
            self.order.append(self)
        self.ensure()
        if self.index + 1 < len(self.order):
            self.order[self.index + 1].start()

    def _after_forward(self, _module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for out in _grad_tensors(output):
                out.register_hook(self._before_backward)
            inputs = _grad_tensors(args)
            if inputs:
                torch.autograd.graph.register_multi_grad_hook(inputs, self._after_backward)
        self.release()

    def _before_backward(self, _grad: torch.Tensor) -> None:
        self.ensure()

    def _after_backward(self, _grads: Sequence[torch.Tensor | None]) -> None:
        self.release()


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in a nested structure (containers and dataclasses) that take part in autograd."""
    out = []
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            out += [leaf] if leaf.requires_grad else []
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out += _grad_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return out
