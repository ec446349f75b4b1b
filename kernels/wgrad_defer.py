"""Deferred weight grads: inside a capture, a backward queues its weight-grad work for a later W action.

A `WeightGradStore` opens a capture (`store.capture(key)`) around a backward; an op that supports
deferral (its backward calls `defer_weight_grad`, or `weight_grad_or_defer` for a custom Function)
then computes only its input grad and queues the weight-grad computation under `key`, and
`store.run(key)` (the W action) executes the queue later; `store.run(k1, k2, ...)` executes several
chunks' queues at once, and work queued with a merge key (e.g. one Linear's weight grad) then
runs once over all those chunks' inputs: one larger GEMM instead of one per chunk. The open
capture lives in one process-wide slot, not a thread- or context-local one, so a backward run by
the autograd engine's own device threads (CUDA) sees it too; captures therefore do not nest. Pure
autograd: no torch.distributed here. The store counts, per leaf tensor, the queued work that will
still add to its grad (`outstanding`), so a caller can tell a weight's last grad of a step from the
others (ZeRO-1 starts reducing it then).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

_LOCK = threading.Lock()
_active: WeightGradStore | None = None  # the store whose capture is open, seen from every thread

GradTarget = Tensor | GradientEdge
Merge = tuple[Hashable, Callable[[list[Any]], None], Any]  # (key, run over every queued args, these args)
Item = tuple[Callable[[], None], int, Merge | None, tuple[Tensor, ...]]  # (work, bytes held, merge, leaves)


class WeightGradStore:
    """Queued weight-grad closures per key (one key per split backward), run by W actions."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, list[Item]] = {}
        self._key: Hashable | None = None
        self.held_bytes = 0  # bytes of tensors the queued closures keep alive
        self._outstanding: dict[Tensor, int] = {}  # leaf -> queued work items that still add to its grad

    @contextmanager
    def capture(self, key: Hashable) -> Iterator[None]:
        """Within this block, deferrable weight grads (from any thread) are queued under key."""
        global _active
        with _LOCK:
            if _active is not None:
                raise RuntimeError(f"a weight-grad capture (key {_active._key!r}) is already open; "
                                   f"captures do not nest, one backward is captured at a time per process")
            _active, self._key = self, key
            self._queues.setdefault(key, [])
        try:
            yield
        finally:
            with _LOCK:
                _active, self._key = None, None

    def push(self, fn: Callable[[], None], nbytes: int = 0, merge: Merge | None = None,
             targets: tuple[GradTarget, ...] = ()) -> None:
        """Queue fn (keeping nbytes of tensors alive until it runs) under the key being captured;
        with merge = (key, run_all, args), queued work of the same merge key runs as one
        run_all([args, ...]) instead of fn each. targets: what fn accumulates grads into."""
        leaves = _leaves(targets)
        with _LOCK:
            self._queues[self._key].append((fn, nbytes, merge, leaves))
            self.held_bytes += nbytes
            for leaf in leaves:
                self._outstanding[leaf] = self._outstanding.get(leaf, 0) + 1

    def outstanding(self, leaf: Tensor) -> int:
        """Queued work items that will still add to leaf's grad; an item stops counting just before it
        runs, so a post-accumulate-grad hook of leaf that reads 0 sees its last grad from this store."""
        return self._outstanding.get(leaf, 0)

    def _release(self, leaves: tuple[Tensor, ...]) -> None:
        """One work item adding to these leaves is about to run."""
        with _LOCK:
            for leaf in leaves:
                left = self._outstanding.pop(leaf) - 1
                if left:
                    self._outstanding[leaf] = left

    def run(self, *keys: Hashable) -> int:
        """Execute and drop the work queued under keys (one W action for those chunks), merged by
        merge key (in order of first appearance; unmergeable work first, in order); return how
        many closures were queued."""
        items = [item for key in keys for item in self._queues.pop(key, [])]
        merged: dict[Hashable, tuple[Callable[[list[Any]], None], list[Any], list[Tensor]]] = {}
        for fn, _, merge, leaves in items:
            if merge is None:
                self._release(leaves)
                fn()
            else:
                run_all, args, merged_leaves = merged.setdefault(merge[0], (merge[1], [], []))
                args.append(merge[2])
                merged_leaves.extend(leaves)
        for run_all, args, leaves in merged.values():
            self._release(tuple(leaves))
            run_all(args)
        self.held_bytes -= sum(item[1] for item in items)
        return len(items)

    def pending(self) -> int:
        """Closures queued and not yet run."""
        return sum(map(len, self._queues.values()))


def accumulates_in_place(param: GradTarget) -> bool:
    """Whether accumulate_grad adds into param.grad directly: a leaf without post-accumulate hooks."""
    return isinstance(param, Tensor) and param.is_leaf and not getattr(param, "_post_accumulate_grad_hooks", None)


def accumulate_grad(param: GradTarget, grad: Callable[[], Tensor], fused: Callable[[Tensor], None]) -> None:
    """Add grad() to param.grad: for a leaf without post-accumulate hooks, by assignment or by
    fused(param.grad) (an in-place `acc += grad` kernel such as addmm_, no temporary); otherwise
    (hooks, a non-leaf, or a GradientEdge into the graph) through autograd, so hooks run and
    non-leaf params pass the grad on to their leaves."""
    if not accumulates_in_place(param):
        torch.autograd.backward(param, grad())
        return
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad()
        else:
            fused(param.grad)


def capturing(weight: GradTarget) -> bool:
    """Whether defer_weight_grad(weight, ...) would queue now: a capture is open and weight needs a grad."""
    return _active is not None and not (isinstance(weight, Tensor) and not weight.requires_grad)


def defer_weight_grad(weight: GradTarget, compute: Callable[[], None], holds: tuple[Tensor, ...] = (),
                      merge: Merge | None = None, others: tuple[GradTarget, ...] = ()) -> bool:
    """Call from a backward: inside a capture, queue `compute()` (which accumulates weight's grad,
    e.g. with accumulate_grad) for the W action and return True (the backward then returns None
    for weight); elsewhere return False. holds: tensors compute keeps alive (memory accounting);
    merge: see WeightGradStore.push; others: further tensors compute accumulates into (a bias)."""
    store = _active
    if store is None or not capturing(weight):
        return False
    store.push(compute, sum(t.nbytes for t in holds), merge, (weight, *others))
    return True


def _leaves(targets: tuple[GradTarget, ...]) -> tuple[Tensor, ...]:
    """The leaf tensors whose grads a backward into targets accumulates (a non-leaf tensor or a GradientEdge:
    the leaves its graph reaches, e.g. the parameter behind a dtype cast)."""
    leaves, nodes, seen = [], [], set()
    for target in targets:
        if isinstance(target, Tensor) and target.is_leaf:
            leaves.append(target)
        else:
            nodes.append(target.node if isinstance(target, GradientEdge) else target.grad_fn)
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad holds its leaf
        if leaf is not None:
            leaves.append(leaf)
        else:
            nodes.extend(next_node for next_node, _ in node.next_functions)
    return tuple(leaves)


def grad_target(ctx: torch.autograd.function.FunctionCtx, index: int) -> GradTarget:
    """Where a custom Function's input `index` sends its grad: the leaf tensor itself, or the edge
    into the graph that produced the input (e.g. a dtype cast of a parameter). Needs no reference
    to the input saved in forward."""
    node, output_nr = ctx.next_functions[index]
    leaf = getattr(node, "variable", None)  # AccumulateGrad holds its leaf
    return leaf if leaf is not None else GradientEdge(node, output_nr)


def weight_grad_or_defer(ctx: torch.autograd.function.FunctionCtx, index: int, grad: Callable[[], Tensor],
                         holds: tuple[Tensor, ...] = ()) -> Tensor | None:
    """For a custom Function's backward: inside a capture, queue the accumulation of grad() into
    input `index` for the W action and return None; otherwise return grad() now."""
    if _active is None:
        return grad()
    target = grad_target(ctx, index)
    if defer_weight_grad(target, lambda: accumulate_grad(target, grad, lambda acc: acc.add_(grad())), holds):
        return None
    return grad()
