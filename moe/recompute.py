"""Activation recomputation (train.recompute): what a block keeps for backward and what backward rebuilds.

"selective" (DeepSeek-V3's choice): the RMSNorm outputs, MLA's q/k/v from their latents and the SwiGLU products
are not kept; `Rebuild` drops them where an op would save them and backward rebuilds each from the tensors the
ops before it keep anyway (the norm's input, the latents, gate|up). "full": `recomputed` keeps a segment's
inputs only and reruns the segment in its backward; moe.model cuts a block into segments that hold no
communication (see Block), so no collective is issued again in backward.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Literal, Sequence, get_args

import torch
from torch import Tensor

Recompute = Literal["none", "selective", "full"]
RECOMPUTE = get_args(Recompute)


def _storage_id(t: Tensor) -> int:
    """Identity of t's storage (meta tensors too, whose data pointers are all 0)."""
    return t.untyped_storage()._cdata


class _Rebuilt:
    """What a Rebuild region keeps instead of a dropped tensor: the thunk that rebuilds its storage's tensor and
    the saved view's geometry."""

    __slots__ = ("thunk", "shape", "stride", "offset")

    def __init__(self, thunk: Callable[[], Tensor], t: Tensor) -> None:
        self.thunk, self.shape, self.stride, self.offset = thunk, t.shape, t.stride(), t.storage_offset()

    def unpack(self) -> Tensor:
        with torch.no_grad():
            return self.thunk().as_strided(self.shape, self.stride, self.offset)


class Rebuild:
    """Saved-tensor hooks for regions of one forward: a tensor registered with drop() (or any view of its storage)
    is not kept when an op inside the region saves it; backward rebuilds it from its thunk. Every other saved tensor
    goes to the hooks active outside (e.g. pipeline.memory.SavedTensorMeter) unchanged. The region may be entered
    several times (never across a generator's pause: hooks are per thread, and a paused forward lets another chunk
    run)."""

    def __init__(self) -> None:
        self._drops: dict[int, tuple[Tensor, Callable[[], Tensor]]] = {}  # held: no other storage takes its id

    def drop(self, t: Tensor, thunk: Callable[[], Tensor]) -> Tensor:
        """Register t (a fresh tensor owning its storage) to be rebuilt by thunk() (run without grad, from detached
        inputs only) instead of kept; return t (held as long as this Rebuild, so its storage id stays its own)."""
        self._drops[_storage_id(t)] = (t, thunk)
        return t

    def drop_tiles(self, q: Tensor, scale: Tensor, make: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """drop() for a pair of e4m3 tiles and their scales that make() rebuilds together: the consumer that unpacks
        q, then scale, pays one make(); the rebuilt scale waits for its unpack only (no tensor held longer)."""
        waiting: list[Tensor] = []

        def q_again() -> Tensor:
            q_new, scale_new = make()
            waiting.append(scale_new)
            return q_new
        return self.drop(q, q_again), self.drop(scale, lambda: waiting.pop() if waiting else make()[1])

    def __enter__(self) -> Rebuild:
        # torch applies only the innermost hooks: this region's pass what they keep to the ones active outside it.
        # Every saved tensor keeps both hooks alive: the pack hook reaches this Rebuild (and the tensors it holds)
        # through a weak reference only, so they are freed once the forward is done with them
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack, unpack = outer if outer is not None else (None, None)
        me = weakref.ref(self)
        torch._C._autograd._push_saved_tensors_default_hooks(
            lambda t: me()._pack(t, pack), lambda held: _unpack(held, unpack))
        return self

    def __exit__(self, *_: object) -> None:
        torch._C._autograd._pop_saved_tensors_default_hooks()

    def _pack(self, t: Tensor, outer: Callable[[Tensor], Any] | None) -> Any:
        dropped = self._drops.get(_storage_id(t))
        if dropped is not None:
            return _Rebuilt(dropped[1], t)
        # a detached alias, as pipeline.memory's meter keeps: an op's own output saved with its grad_fn makes a
        # reference cycle through its node that outlives a branch whose backward never runs (a router loss with a
        # zero coefficient), and keeps every node behind it -- and what their contexts hold -- alive
        return outer(t) if outer is not None else t.detach()


def _unpack(held: Any, outer: Callable[[Any], Tensor] | None) -> Tensor:
    if isinstance(held, _Rebuilt):
        return held.unpack()
    return outer(held) if outer is not None else held


def norm_output(rebuild: Rebuild | None, norm: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """norm(x); with a Rebuild (selective recompute), its output is rebuilt from x in backward instead of kept (x,
    and the norm's rstd, are what the norm keeps itself)."""
    out = norm(x)
    if rebuild is None:
        return out
    kept = x.detach()
    return rebuild.drop(out, lambda: norm(kept))


class _Recompute(torch.autograd.Function):
    """Outputs of fn(*inputs) computed without a graph; backward reruns fn with grad on the saved inputs and
    back-propagates through that graph (parameters' grads accumulate, or are deferred, there)."""

    @staticmethod
    def forward(ctx, fn: Callable[..., tuple[Tensor, ...]], anchor: Tensor, *inputs: Tensor
                ) -> tuple[Tensor, ...]:  # noqa: D102
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return tuple(fn(*inputs))

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # noqa: D102
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = ctx.fn(*inputs)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(t.grad if t.requires_grad else None for t in inputs))


def recomputed(fn: Callable[..., tuple[Tensor, ...]], inputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """fn(*inputs) (a tuple of tensors) keeping only inputs for backward, which reruns fn: fn must be a pure
    function of inputs and the parameters it reads, and issue no communication (it runs again in backward)."""
    # an empty leaf that needs grad: the outputs need grad even where no input does (fn's parameters do), and no
    # parameter's grad hooks fire for it (a ZeRO-1 bucket would see a second grad after the rerun's)
    anchor = inputs[0].new_empty(0).requires_grad_()
    return _Recompute.apply(fn, anchor, *inputs)
