"""Single-process dispatch/combine: sort token slots by expert and scatter them back, with autograd."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dispatch import rehearsal_rule
from dispatch.layout import count_ids
from dispatch.permute import Permutation, make_padded_permutation, permute, unpermute


@dataclass
class LocalRecvInfo:
    """What arrived for the local experts."""

    tokens_per_local_expert: Tensor  # [E_local] int64 rows per local expert, in row order


@dataclass
class LocalHandle:
    """What combine needs to undo a local dispatch."""

    token_of_row: Tensor   # [N] source token of each dispatched row
    weight_of_row: Tensor  # [N] combine weight of each dispatched row
    num_tokens: int
    perm: Permutation | None = None  # with dropped slots: every slot a row, the dropped ones padding (unpermute)
    weights: Tensor | None = None    # [T, k] the routing weights, for perm


class LocalDispatcher:
    """The EP dispatcher interface for one process holding all experts (no communication)."""

    def __init__(self, num_experts: int, dropless: bool = False) -> None:
        self.num_experts = num_experts
        self.experts_per_rank = num_experts
        self.dropless = dropless  # the router drops no slot (no capacity): every slot is a row, no count to read

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> tuple[Tensor, LocalRecvInfo, LocalHandle]:
        """Rows of x, one per kept (token, expert) slot, stably sorted by expert."""
        flat = indices.reshape(-1)
        if flat.is_meta:  # a rehearsal: no values; rows per expert from the rule (dispatch.rehearsal_rule)
            slots = rehearsal_rule.expert_slots(*indices.shape, self.num_experts, rehearsal_rule.capacity_of(indices))
            order = torch.argsort(flat, stable=True)[:sum(slots)]
            counts = flat.new_empty(self.num_experts)
        elif self.dropless:  # as many rows as slots: sized without reading anything back
            counts = count_ids(flat, self.num_experts)
            order = torch.argsort(flat, stable=True)
        else:  # every slot a row, the kept ones grouped by expert first, the dropped ones padding: nothing read back
            perm, _ = make_padded_permutation(indices, self.num_experts, indices.numel())  # the bound holds every slot
            handle = LocalHandle(perm.row, weights[perm.row, perm.slot], x.shape[0], perm, weights)
            return permute(x, perm), LocalRecvInfo(perm.counts), handle
        token_of_row = order // indices.shape[1]
        handle = LocalHandle(token_of_row, weights.reshape(-1)[order], x.shape[0])
        return x[token_of_row], LocalRecvInfo(counts), handle

    def row_weights(self, handle: LocalHandle) -> Tensor:
        """[N] each dispatched row's combine weight (differentiable), for experts that apply it themselves."""
        return handle.weight_of_row

    def combine(self, y: Tensor, handle: LocalHandle, weighted: bool = True) -> Tensor:
        """out[t] = sum over t's rows of weight * y[row], accumulated in at least fp32; weighted=False: the plain
        sum (the experts applied the weights, row_weights), which keeps nothing of y for backward."""
        if handle.perm is not None:  # padding rows (dropped slots) are summed into no token
            return unpermute(y, handle.perm, handle.weights if weighted else None, y.dtype)
        weight = handle.weight_of_row if weighted else None
        return _Combine.apply(y, weight, handle.token_of_row, handle.num_tokens).to(y.dtype)


class _Combine(torch.autograd.Function):
    """Rows y [N, H], weighted when a weight is given, summed into their tokens in at least fp32, saving y in its own
    dtype for the weight's grad only (autograd's cast, product and index_add would keep fp32 copies of every expert
    output for backward, as the EP combine, dispatch.permute.unpermute, does not)."""

    @staticmethod
    def forward(ctx, y: Tensor, weight: Tensor | None, token: Tensor, num_tokens: int) -> Tensor:  # noqa: D102
        acc = torch.promote_types(y.dtype, torch.float32)
        ctx.save_for_backward(None if weight is None else y, weight, token)
        ctx.y_dtype = y.dtype
        rows = y.to(acc) if weight is None else y.to(acc) * weight.to(acc).unsqueeze(1)
        return rows.new_zeros(num_tokens, y.shape[1]).index_add_(0, token, rows)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor | None, None, None]:  # noqa: D102
        y, weight, token = ctx.saved_tensors
        rows = grad.index_select(0, token)
        if weight is None:
            return rows.to(ctx.y_dtype), None, None, None
        grad_y = (rows * weight.to(grad.dtype).unsqueeze(1)).to(y.dtype)
        grad_weight = (rows * y.to(grad.dtype)).sum(1).to(weight.dtype)
        return grad_y, grad_weight, None, None
