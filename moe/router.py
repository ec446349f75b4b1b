"""Top-k router: softmax/sigmoid scores, group-limited routing, capacity, balance losses, expert bias."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dispatch import rehearsal_rule
from dispatch.layout import count_ids
from moe.config import check_router_settings


class _PromotedLinear(torch.autograd.Function):
    """F.linear(x, w) computed in `dtype` (wider than x's and w's), keeping x and w as given for backward: not the
    promoted copies autograd's casts would keep (an fp32 copy of a bf16 router's input is 4 bytes per hidden
    element and token, twice the input itself; under selective recompute the input is not kept either but rebuilt).
    Grads are those of F.linear(x.to(dtype), w.to(dtype)), cast back to x's and w's dtypes."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:  # noqa: D102
        ctx.save_for_backward(x, w)
        ctx.dtype = dtype
        return F.linear(x.to(dtype), w.to(dtype))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # noqa: D102
        x, w = ctx.saved_tensors
        dx = (grad @ w.to(ctx.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = (grad.t() @ x.to(ctx.dtype)).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def promoted_linear(x: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
    """F.linear in dtype; where x or w is narrower, without keeping their promoted copies (_PromotedLinear)."""
    if x.dtype == w.dtype == dtype:
        return F.linear(x, w)
    return _PromotedLinear.apply(x, w, dtype)


@dataclass
class RoutingResult:
    """What the router decided for T tokens (k slots each); -1 / 0 mark dropped slots."""

    indices: Tensor            # [T, k] int64 expert ids, -1 where the slot was dropped
    weights: Tensor            # [T, k] float32 combine weights, 0 where dropped
    aux_loss: Tensor           # scalar: sum of the enabled balance losses times their coefficients
    tokens_per_expert: Tensor  # [E] int64 slots kept per expert
    dropped: Tensor            # scalar int64: slots dropped by the capacity limit
    losses: dict[str, Tensor]  # unweighted losses by name ("load_balance", "seq_balance", "z")


class TopKRouter(nn.Module):
    """Chooses top-k experts per token; see RoutingResult for the output."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, *, score_func: str = "softmax",
                 num_groups: int = 1, topk_groups: int = 1, capacity_factor: float | None = None,
                 drop_policy: str = "probs", norm_topk: bool = True, route_scale: float = 1.0,
                 aux_loss_coeff: float = 0.0, seq_aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 bias_update_rate: float = 0.0, init_std: float = 0.02, force_balance: bool = False) -> None:
        super().__init__()
        check_router_settings(num_experts, top_k, score_func, num_groups, topk_groups,
                              capacity_factor, drop_policy)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.num_groups, self.topk_groups = score_func, num_groups, topk_groups
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.norm_topk, self.route_scale = norm_topk, route_scale
        self.aux_loss_coeff, self.seq_aux_loss_coeff = aux_loss_coeff, seq_aux_loss_coeff
        self.z_loss_coeff, self.bias_update_rate = z_loss_coeff, bias_update_rate
        self.force_balance = force_balance  # model.force_balance: round-robin slots, for measuring
        self.weight = nn.Parameter(torch.randn(num_experts, hidden_size) * init_std)
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def capacity(self, num_tokens: int) -> int | None:
        """Slots each expert may keep for num_tokens tokens (None when dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def forward(self, x: Tensor, seq_len: int | None = None) -> RoutingResult:
        """Route x [T, H]; seq_len (tokens per sequence) is needed for the sequence-wise loss."""
        if x.dim() != 2 or x.shape[1] != self.weight.shape[1]:
            raise ValueError(f"router input must be [T, {self.weight.shape[1]}], got {list(x.shape)}")
        dtype = torch.promote_types(x.dtype, torch.float32)  # scores and balance statistics in fp32 at least
        logits = promoted_linear(x, self.weight, dtype)
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = self._limit_groups(scores.detach() + self.expert_bias)
        if self.force_balance:
            indices = self._balanced(x.shape[0], x.device)
        elif (topology := rehearsal_rule.forced()) is not None:  # a real-device rehearsal: the rule's routing
            indices = rehearsal_rule.assignment(x.shape[0], self.top_k, self.num_experts, topology, x.device)
        else:
            indices = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = (weights * self.route_scale).float()  # the dispatchers carry float32 combine weights
        losses = self._balance_losses(logits, scores, indices, seq_len)
        aux_loss = sum((c * losses[n] for n, c in self._coefficients() if c), logits.new_zeros(()))
        kept = self._capacity_mask(indices, scores.detach().gather(1, indices))
        indices = indices.masked_fill(~kept, -1)
        weights = weights.masked_fill(~kept, 0.0)
        if indices.is_meta:  # a rehearsal: no values to count; dispatchers count by dispatch.rehearsal_rule's rule
            tokens_per_expert = indices.new_empty(self.num_experts)
            rehearsal_rule.mark_capacity(indices, self.capacity(indices.shape[0]))
        else:
            tokens_per_expert = count_ids(indices, self.num_experts)  # dropped slots are -1 by now
        return RoutingResult(indices, weights, aux_loss, tokens_per_expert, (~kept).sum(), losses)

    def _balanced(self, tokens: int, device: torch.device) -> Tensor:
        """[tokens, k] forced-balance routing (model.force_balance): slot j of token t to expert (t k + j) mod E."""
        slots = torch.arange(tokens * self.top_k, device=device).view(tokens, self.top_k)
        return slots % self.num_experts

    def _coefficients(self) -> list[tuple[str, float]]:
        return [("load_balance", self.aux_loss_coeff), ("seq_balance", self.seq_aux_loss_coeff),
                ("z", self.z_loss_coeff)]

    def _limit_groups(self, choice: Tensor) -> Tensor:
        """Mask out experts outside the topk_groups best groups (group score: sum of its top-2)."""
        if self.num_groups == 1:
            return choice
        tokens = choice.shape[0]
        grouped = choice.view(tokens, self.num_groups, -1)
        top = min(2, grouped.shape[-1])
        group_scores = grouped.topk(top, dim=-1).values.sum(-1)
        keep = group_scores.topk(self.topk_groups, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(tokens, -1)

    def _balance_losses(self, logits: Tensor, scores: Tensor, indices: Tensor,
                        seq_len: int | None) -> dict[str, Tensor]:
        """Switch load-balance loss, DeepSeek sequence-wise loss and router z-loss (unweighted)."""
        tokens, experts, k = scores.shape[0], self.num_experts, self.top_k
        probs = scores / scores.sum(-1, keepdim=True)
        chosen = torch.zeros_like(scores).scatter_(1, indices, 1.0)
        with _graph_if(self.aux_loss_coeff):
            losses = {"load_balance": experts * (chosen.mean(0) / k * probs.mean(0)).sum()}
        with _graph_if(self.z_loss_coeff):
            losses["z"] = torch.logsumexp(logits, -1).square().mean()
        if self.seq_aux_loss_coeff:
            if seq_len is None or tokens % seq_len:
                raise ValueError(f"seq_aux_loss_coeff needs seq_len dividing the {tokens} routed tokens, got {seq_len}")
            per_seq = chosen.view(-1, seq_len, experts).sum(1) * experts / (k * seq_len)
            losses["seq_balance"] = (per_seq * probs.view(-1, seq_len, experts).mean(1)).sum(-1).mean()
        return losses

    def _capacity_mask(self, indices: Tensor, priority: Tensor) -> Tensor:
        """True for slots kept under the capacity limit, chosen by drop_policy inside each expert. Equal priorities
        keep the earliest slot (a stable sort); priorities equal only in exact arithmetic (tokens whose contexts are
        equal) are told apart by rounding, so another layout or CPU kernel may keep the other one of them."""
        capacity = self.capacity(indices.shape[0])
        if capacity is None or indices.is_meta:  # meta: no values to rank; the dispatchers apply the
            return torch.ones_like(indices, dtype=torch.bool)  # capacity by dispatch.rehearsal_rule's rule
        flat_expert = indices.reshape(-1)
        if self.drop_policy == "probs":
            order = torch.argsort(priority.reshape(-1), descending=True, stable=True)
        else:
            order = torch.arange(flat_expert.numel(), device=indices.device)
        order = order[torch.argsort(flat_expert[order], stable=True)]
        counts = count_ids(flat_expert, self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(order.numel(), device=indices.device) - starts[flat_expert[order]]
        kept = torch.zeros_like(flat_expert, dtype=torch.bool)
        kept[order] = rank_in_expert < capacity
        return kept.view_as(indices)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: Tensor) -> None:
        """Aux-loss-free balancing: bias -= rate * sign(load - mean load)."""
        load = tokens_per_expert.to(self.expert_bias.dtype)
        self.expert_bias -= self.bias_update_rate * torch.sign(load - load.mean())


def _graph_if(coefficient: float) -> torch.autograd.grad_mode.set_grad_enabled:
    """Grad mode for a balance loss: a loss with a zero coefficient is a statistic only, computed without a graph
    (nothing of it is kept for a backward that never runs)."""
    return torch.set_grad_enabled(torch.is_grad_enabled() and coefficient != 0)
