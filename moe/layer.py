"""MoE layer: router, dispatch to experts (local or expert-parallel), grouped experts, combine, shared experts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from moe.config import ModelConfig
from moe.experts import GroupedExperts, SwiGLU
from moe.local_dispatch import LocalDispatcher
from moe.router import TopKRouter

if TYPE_CHECKING:
    from dispatch import EPDispatcher


@dataclass
class MoEStats:
    """Routing statistics of one MoE layer call, for losses and metrics."""

    aux_loss: Tensor
    tokens_per_expert: Tensor  # [E] slots kept per expert (this rank's tokens)
    dropped: Tensor
    losses: dict[str, Tensor]


def build_router(cfg: ModelConfig) -> TopKRouter:
    """The router a config describes."""
    return TopKRouter(cfg.num_experts, cfg.top_k, cfg.hidden_size, score_func=cfg.score_func,
                      num_groups=cfg.num_groups, topk_groups=cfg.topk_groups,
                      capacity_factor=cfg.capacity_factor, drop_policy=cfg.drop_policy,
                      norm_topk=cfg.norm_topk, route_scale=cfg.route_scale,
                      aux_loss_coeff=cfg.aux_loss_coeff, seq_aux_loss_coeff=cfg.seq_aux_loss_coeff,
                      z_loss_coeff=cfg.z_loss_coeff, bias_update_rate=cfg.bias_update_rate,
                      init_std=cfg.init_std)


class MoELayer(nn.Module):
    """Routed experts (+ shared experts), all held here until to_expert_parallel() keeps one block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = build_router(cfg)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.dispatcher = LocalDispatcher(cfg.num_experts)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size,
                                      precision=cfg.expert_precision, init_std=cfg.init_std, out_std=out_std)
        self.shared = (SwiGLU(cfg.hidden_size, cfg.num_shared_experts * cfg.expert_ffn_size,
                              init_std=cfg.init_std, out_std=out_std)
                       if cfg.num_shared_experts else None)

    @torch.no_grad()
    def to_expert_parallel(self, dispatcher: EPDispatcher) -> None:
        """Route through an expert-parallel dispatcher and keep only its rank's contiguous expert block."""
        count = dispatcher.experts_per_rank
        if self.experts.num_experts != dispatcher.num_experts:
            raise ValueError(f"the layer holds {self.experts.num_experts} experts, the dispatcher expects "
                             f"{dispatcher.num_experts}: call to_expert_parallel once, on the full layer")
        block = slice(dispatcher.rank * count, (dispatcher.rank + 1) * count)
        for name in ("w_gate_up", "w_down"):
            weight = getattr(self.experts, name)
            setattr(self.experts, name, nn.Parameter(weight[block].clone(), requires_grad=weight.requires_grad))
        self.dispatcher = dispatcher

    def forward(self, x: Tensor, seq_len: int | None = None) -> tuple[Tensor, MoEStats]:
        """x [..., H] -> (out [..., H], stats); seq_len feeds the sequence-wise balance loss."""
        flat = x.reshape(-1, x.shape[-1])
        route = self.router(flat, seq_len)
        recv_x, recv_info, handle = self.dispatcher.dispatch(flat, route.indices, route.weights)
        y = self.experts(recv_x, recv_info.tokens_per_local_expert)
        out = self.dispatcher.combine(y, handle)
        if self.shared is not None:
            out = out + self.shared(flat)
        stats = MoEStats(route.aux_loss, route.tokens_per_expert, route.dropped, route.losses)
        return out.view_as(x), stats
