"""MoE layer: router, dispatch to experts (local or expert-parallel), grouped experts, combine, shared experts."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator

import torch
from torch import Tensor, nn

from dispatch.channel import run_steps
from dispatch.progress import EXCHANGE, mark
from moe.config import ModelConfig
from moe.experts import GroupedExperts, SwiGLU
from moe.local_dispatch import LocalDispatcher
from moe.recompute import Rebuild
from moe.replicas import ExpertReplicas
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
    recv_rows: Tensor | None = None  # 0-d int64: rows this rank's experts received in this call (EP: from every peer)
    balanced_rows: int = 0           # rows each EP rank would receive under perfect balance: routed tokens x top-k


def build_router(cfg: ModelConfig) -> TopKRouter:
    """The router a config describes."""
    return TopKRouter(cfg.num_experts, cfg.top_k, cfg.hidden_size, score_func=cfg.score_func,
                      num_groups=cfg.num_groups, topk_groups=cfg.topk_groups,
                      capacity_factor=cfg.capacity_factor, drop_policy=cfg.drop_policy,
                      norm_topk=cfg.norm_topk, route_scale=cfg.route_scale,
                      aux_loss_coeff=cfg.aux_loss_coeff, seq_aux_loss_coeff=cfg.seq_aux_loss_coeff,
                      z_loss_coeff=cfg.z_loss_coeff, bias_update_rate=cfg.bias_update_rate,
                      init_std=cfg.init_std, force_balance=cfg.force_balance)


class MoELayer(nn.Module):
    """Routed experts (+ shared experts), all held here until to_expert_parallel() keeps one block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = build_router(cfg)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.dispatcher = LocalDispatcher(cfg.num_experts, dropless=cfg.capacity_factor is None)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size,
                                      precision=cfg.expert_precision, init_std=cfg.init_std, out_std=out_std,
                                      activation_cache=cfg.activation_cache)
        self.shared = (SwiGLU(cfg.hidden_size, cfg.num_shared_experts * cfg.expert_ffn_size,
                              init_std=cfg.init_std, out_std=out_std, precision=cfg.linear_precision)
                       if cfg.num_shared_experts else None)
        if self.shared is not None:
            self.shared.activation_cache = cfg.activation_cache
        self.replicas: ExpertReplicas | None = None  # redundant experts (to_expert_parallel)

    @torch.no_grad()
    def to_expert_parallel(self, dispatcher: EPDispatcher, replicas: ExpertReplicas | None = None) -> None:
        """Route through an expert-parallel dispatcher and keep only its rank's contiguous expert block. replicas
        (parallel.redundant_experts): the dispatcher moves rows to physical slots (replicas.layout: each rank's
        owned experts then its spare slots), which the routed logical experts are mapped to before dispatch; the
        router and its losses stay on the logical experts."""
        logical = replicas.layout.num_slots if replicas is not None else self.experts.num_experts
        count = replicas.layout.owned if replicas is not None else dispatcher.experts_per_rank
        if self.experts.num_experts != self.router.num_experts or logical != dispatcher.num_experts:
            raise ValueError(f"the layer holds {self.experts.num_experts} experts, the dispatcher expects "
                             f"{dispatcher.num_experts}: call to_expert_parallel once, on the full layer")
        if getattr(dispatcher, "fp8_rows", False) and self.experts.precision != "fp8":
            raise ValueError(f"a dispatcher with fp8_rows hands over e4m3 rows, which need expert_precision = "
                             f"'fp8'; this layer's is {self.experts.precision!r}")
        block = slice(dispatcher.rank * count, (dispatcher.rank + 1) * count)
        for name in ("w_gate_up", "w_down"):
            weight = getattr(self.experts, name)
            setattr(self.experts, name, nn.Parameter(weight[block].clone(), requires_grad=weight.requires_grad))
        self.dispatcher = dispatcher
        self.replicas = replicas
        if replicas is not None:
            self.register_buffer("replica_placement", torch.tensor(replicas.placement, dtype=torch.int64,
                                                                   device=self.experts.w_gate_up.device))

    def attach_replicas(self) -> None:
        """Make the redundant experts' weights beside the (materialised) owned ones and use the placement in the
        replica_placement buffer (a checkpoint's after a load), refreshed from the owners."""
        owned = [self.experts.w_gate_up, self.experts.w_down]
        if self.replicas.tables is None or self.replicas.weights[0].device != owned[0].device:
            self.replicas.attach(owned)
            self.experts.hold_spares(self.replicas.weights)
        self.replicas.set_placement(self.replica_placement.tolist() if not owned[0].is_meta
                                    else self.replicas.placement)
        self.replicas.refresh(owned)

    def replace_replicas(self, loads) -> None:
        """Place the spare slots for window loads [E] (the same on every rank) and refresh them from the owners."""
        placement = self.replicas.place(loads)
        self.replica_placement.copy_(torch.tensor(placement, dtype=torch.int64))
        self.replicas.set_placement(placement)
        self.replicas.refresh([self.experts.w_gate_up, self.experts.w_down])

    @property
    def concurrent_backward(self) -> bool:
        """Whether a backward through this layer may run on another thread while a forward runs: its
        dispatcher exchanges gradients on a group of their own (EPDispatcher grad_group), or does
        not communicate at all (one process)."""
        return getattr(self.dispatcher, "concurrent_backward", True)

    def forward_steps(self, x: Tensor, seq_len: int | None = None, saved: Rebuild | None = None
                      ) -> Generator[Any, None, tuple[Tensor, MoEStats]]:
        """forward as a generator that yields while dispatch and combine exchanges are in flight (the
        shared experts run while dispatch's first exchange is); same numbers as forward. saved: the
        block's selective-recompute region (x rebuilt in backward), entered around the router and shared experts."""
        flat = x.reshape(-1, x.shape[-1])
        with saved or nullcontext():
            route = self.router(flat, seq_len)
        mark("dispatch", EXCHANGE)
        indices = route.indices if self.replicas is None else self.replicas.route(route.indices)
        dispatching = _steps(self.dispatcher, "dispatch", flat, indices, route.weights)
        (recv_x, recv_info, handle), shared = yield from _at_first_pause(dispatching, self._shared, flat, saved)
        mark("experts", EXCHANGE)
        fold = self.fold_weights
        row_weight = self.dispatcher.row_weights(handle) if fold else None
        y = self.experts(recv_x, recv_info.tokens_per_local_expert, row_weight)
        mark("combine", EXCHANGE)
        combining = _steps(self.dispatcher, "combine", y, handle, not fold)
        del y  # combine lets go of the expert rows once it has pre-reduced them (unless it keeps them for backward)
        out = yield from combining
        mark("combined", EXCHANGE)
        if shared is not None:
            out = out + shared
        stats = MoEStats(route.aux_loss, route.tokens_per_expert, route.dropped, route.losses,
                         recv_info.tokens_per_local_expert.sum(), flat.shape[0] * self.router.top_k)
        return out.view_as(x), stats

    @property
    def fold_weights(self) -> bool:
        """Whether the routing weights scale the expert rows before their down projection (model.activation_cache
        "fp8"), so that combine is a plain sum keeping no expert output, rather than in combine."""
        return self.experts.activation_cache == "fp8"

    def forward(self, x: Tensor, seq_len: int | None = None) -> tuple[Tensor, MoEStats]:
        """x [..., H] -> (out [..., H], stats); seq_len feeds the sequence-wise balance loss."""
        return run_steps(self.forward_steps(x, seq_len))

    def _shared(self, flat: Tensor, saved: Rebuild | None = None) -> Tensor | None:
        if self.shared is None:
            return None
        with saved or nullcontext():
            return self.shared(flat)


def _steps(dispatcher: Any, name: str, *args: Any) -> Generator[Any, None, Any]:
    """dispatcher's `<name>_steps(*args)` where it has one, else its plain `<name>(*args)` (no pause)."""
    steps = getattr(dispatcher, f"{name}_steps", None)
    if steps is None:
        return getattr(dispatcher, name)(*args)
    running = steps(*args)
    del args  # the steps hold what they need of args, for as long as they need it
    return (yield from running)


def _at_first_pause(steps: Generator[Any, None, Any], work: Callable[..., Any], *args: Any
                    ) -> Generator[Any, None, tuple[Any, Any]]:
    """Yield from steps, running work(*args) at its first pause (at its end if it never pauses);
    return (value of steps, value of work)."""
    ran, extra = False, None
    while True:
        try:
            pending = next(steps)
        except StopIteration as stop:
            return stop.value, (extra if ran else work(*args))
        if not ran:
            ran, extra = True, work(*args)
        yield pending
