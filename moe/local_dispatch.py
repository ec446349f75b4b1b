"""Single-process dispatch/combine: sort token slots by expert and scatter them back, with autograd."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dispatch import rehearsal


@dataclass
class RecvInfo:
    """What arrived for the local experts."""

    tokens_per_local_expert: Tensor  # [E_local] int64 rows per local expert, in row order


@dataclass
class LocalHandle:
    """What combine needs to undo a local dispatch."""

    token_of_row: Tensor   # [N] source token of each dispatched row
    weight_of_row: Tensor  # [N] combine weight of each dispatched row
    num_tokens: int


class LocalDispatcher:
    """The EP dispatcher interface for one process holding all experts (no communication)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.experts_per_rank = num_experts

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> tuple[Tensor, RecvInfo, LocalHandle]:
        """Rows of x, one per kept (token, expert) slot, stably sorted by expert."""
        flat = indices.reshape(-1)
        if flat.is_meta:  # a rehearsal: no values; rows per expert from the rule (dispatch.rehearsal)
            slots = rehearsal.expert_slots(*indices.shape, self.num_experts, rehearsal.capacity_of(indices))
            order = torch.argsort(flat, stable=True)[:sum(slots)]
            counts = flat.new_empty(self.num_experts)
        else:
            kept = torch.nonzero(flat >= 0).squeeze(1)
            order = kept[torch.argsort(flat[kept], stable=True)]
            counts = torch.bincount(flat[kept], minlength=self.num_experts)
        token_of_row = order // indices.shape[1]
        handle = LocalHandle(token_of_row, weights.reshape(-1)[order], x.shape[0])
        return x[token_of_row], RecvInfo(counts), handle

    def combine(self, y: Tensor, handle: LocalHandle) -> Tensor:
        """out[t] = sum over t's rows of weight * y[row], accumulated in at least fp32."""
        acc_dtype = torch.promote_types(y.dtype, torch.float32)
        weighted = y.to(acc_dtype) * handle.weight_of_row.to(acc_dtype).unsqueeze(1)
        out = weighted.new_zeros(handle.num_tokens, y.shape[1])
        return out.index_add(0, handle.token_of_row, weighted).to(y.dtype)
