"""Splitting MoETransformer into pipeline stages balanced by a per-layer cost estimate, and the stage module."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Generator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dispatch.progress import LAYER, mark
from launch.metrics.flops import head_flops, model_layer_flops, mtp_flops
from moe.config import ModelConfig
from moe.cp import CPRegion
from moe.documents import document_attention_mask
from moe.layer import MoELayer, MoEStats
from moe.model import MoETransformer, position_tables
from moe.mtp import mtp_loss, mtp_steps
from moe.tp import TPRegion, vocab_parallel_cross_entropy
from moe.tp import concurrent_backward as tp_concurrent_backward
from moe.vocab import head_logits
from pipeline.overlap import complete

LOSS_KINDS = ("load_balance", "seq_balance", "z")  # the router's balance losses, in the tallies' order


def split_layers(costs: list[float], num_stages: int, head_cost: float = 0.0) -> list[range]:
    """Contiguous layer ranges, one per stage (each non-empty), minimising the costliest stage;
    head_cost is added to the last stage. Ties keep earlier stages no heavier than later ones."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} layers cannot fill {num_stages} pipeline stages (need 1 <= stages <= layers)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: minimal max-cost splitting the first i layers into s stages; cut[s][i]: start of the last one
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            extra = head_cost if (s == num_stages and i == n) else 0.0
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if value < best[s][i] or (value == best[s][i] and j > cut[s][i]):
                    best[s][i], cut[s][i] = value, j
    bounds, end = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        bounds.append(range(start, end))
        end = start
    return bounds[::-1]


class AuxLossGrad(torch.autograd.Function):
    """Identity on x whose backward also sends gradient 1 into aux_loss: a router loss raised inside a
    pipeline stage reaches backward although it never joins the loss the last stage computes."""

    @staticmethod
    def forward(ctx, x: Tensor, aux_loss: Tensor) -> Tensor:  # noqa: D102
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:  # noqa: D102
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


@dataclass
class LayerTally:
    """One MoE layer's routing statistics summed over the micro-batches of a step (this rank's tokens), on
    the stage's device; aux_loss and losses are each call's values times its loss scale (their share of the
    step's loss). They reach the host once per step, in the trainer's stats all-reduce.

    rows and peak measure the straggler of each all-to-all: the rows this rank's experts received, summed over
    the step's calls, and the largest ratio of one call's rows to the balanced share (MoEStats.balanced_rows), a
    running max on the device (each exchange waits on its own busiest rank: a sum over calls would hide it)."""

    tokens_per_expert: Tensor  # [E] int64
    dropped: Tensor            # 0-d int64
    aux_loss: Tensor           # 0-d float64
    losses: Tensor             # [len(LOSS_KINDS)] float64
    rows: Tensor               # 0-d float64: rows received by this rank's experts
    peak: Tensor               # 0-d float64: max over calls of rows received / balanced rows

    @classmethod
    def zeros(cls, num_experts: int, device: torch.device) -> LayerTally:
        """An empty tally on device."""
        scalar = torch.zeros((), dtype=torch.float64, device=device)
        return cls(torch.zeros(num_experts, dtype=torch.long, device=device),
                   torch.zeros((), dtype=torch.long, device=device), scalar.clone(),
                   torch.zeros(len(LOSS_KINDS), dtype=torch.float64, device=device), scalar.clone(), scalar.clone())

    def zero_(self) -> None:
        """Zero every count in place."""
        for item in dataclasses.fields(self):
            getattr(self, item.name).zero_()

    def add(self, stats: MoEStats, scale: float) -> None:
        """Count one call's statistics (no host sync: device tensors added in place)."""
        self.tokens_per_expert += stats.tokens_per_expert.detach()
        self.dropped += stats.dropped.detach()
        self.aux_loss += stats.aux_loss.detach().double() * scale
        for k, kind in enumerate(LOSS_KINDS):
            if kind in stats.losses:
                self.losses[k] += stats.losses[kind].detach().double() * scale
        if stats.recv_rows is not None and stats.balanced_rows:
            rows = stats.recv_rows.detach().double()
            self.rows += rows
            torch.maximum(self.peak, rows / stats.balanced_rows, out=self.peak)


class Stage(nn.Module):
    """A contiguous run of an MoETransformer's layers: the first stage embeds tokens, the last applies the
    final norm and LM head (its output is logits; under TP this rank's vocab block) and holds the MTP depths
    (moe.mtp) with the embedding they share: the first stage's own tensor where both are here (one stage, or
    DualPipe's V), else a copy whose grads the trainer sums with the first stage's. Router losses are
    scaled by loss_scale (the micro-batch's share of the step's loss) and injected into backward here;
    statistics are tallied."""

    def __init__(self, model: MoETransformer, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.layer_ids = list(layers)
        self.first = first
        self.mtp = model.mtp if last else None
        self.embed = model.embed if first or self.mtp is not None else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.tp: TPRegion | None = model.tp  # under TP+SP the residual stream holds S/tp positions
        self.cp = model.cp  # under CP it holds this rank's zig-zag share of each sequence
        self.loss_scale = 1.0  # the micro-batch's share of the step's loss: the trainer sets it for each step
        self.tallies: dict[int, LayerTally] = {}
        self.mtp_tally: Tensor | None = None  # [mtp_depth] float64: each depth's loss times its loss scale, summed

    def moe_layers(self) -> dict[int, MoELayer]:
        """This stage's MoE layers by model layer index (MTP depth k's: num_layers + k - 1)."""
        blocks = {**self.blocks, **{str(self.cfg.num_layers + k): d.block for k, d in enumerate(self.mtp or ())}}
        return {int(i): b.ffn for i, b in blocks.items() if isinstance(b.ffn, MoELayer)}

    @property
    def concurrent_backward(self) -> bool:
        """Whether this stage's backward may run beside another chunk's forward (pipeline.overlap): true
        when every MoE layer and TP region exchanges gradients on a group of its own."""
        return (all(layer.concurrent_backward for layer in self.moe_layers().values()) and tp_concurrent_backward(self)
                and (self.cp is None or self.cp.concurrent_backward))

    def reset_tallies(self) -> None:
        """Start a new step's routing statistics and EP traffic counters. The tallies are zeroed in place once made
        (on the parameters' device): a CUDA graph captured adding into them keeps adding into the same tensors
        (launch.train.graphs)."""
        device = next(self.parameters()).device
        if sorted(self.tallies) != sorted(self.moe_layers()) or any(
                t.rows.device != device for t in self.tallies.values()):
            self.tallies = {i: LayerTally.zeros(self.cfg.num_experts, device) for i in self.moe_layers()}
        for tally in self.tallies.values():
            tally.zero_()
        if self.mtp is not None:
            if self.mtp_tally is None or self.mtp_tally.device != device:
                self.mtp_tally = torch.zeros(self.cfg.mtp_depth, dtype=torch.float64, device=device)
            self.mtp_tally.zero_()
        for layer in self.moe_layers().values():
            meter = getattr(layer.dispatcher, "meter", None)
            if meter is not None:
                meter.clear()

    def forward_steps(self, x: Tensor, documents: Tensor | None = None
                      ) -> Generator[Any, None, Tensor | tuple[Tensor, Tensor]]:
        """tokens [B, S] (first stage) or hidden [B, S, H] -> hidden, or logits on the last stage (with MTP in
        training: logits and the hidden state before the final norm, for loss); pauses while an MoE layer's
        communication is in flight (pipeline.overlap). documents: the micro-batch's moe.documents.document_ids
        [B, S] (every stage gets them: data.document_mask), to attend and count positions inside each document."""
        if self.first:
            x = self.embed(x if self.cp is None else self.cp.shard(x))
        cos, sin = position_tables(self.cfg, x.shape[1], x.device, self.tp, self.cp, documents)
        mask = None if documents is None else document_attention_mask(documents)
        for i, block in self.blocks.items():
            mark(f"layer {i}", LAYER)
            x, stats = yield from block.forward_steps(x, cos, sin, mask)
            if stats is not None:
                self.tallies[int(i)].add(stats, self.loss_scale)
                x = AuxLossGrad.apply(x, stats.aux_loss * self.loss_scale)
        if self.lm_head is not None:
            hidden, x = x, head_logits(self.lm_head, self.norm(x), self.cfg.vocab_size, self.tp)
            if self.mtp is not None and self.training:
                return x, hidden
        return x

    def forward(self, x: Tensor, documents: Tensor | None = None) -> Tensor:
        """forward_steps run without pausing."""
        return complete(self.forward_steps(x, documents))

    def loss(self, logits: Tensor, *hidden_and_labels: Tensor) -> tuple[Tensor, Tensor]:
        """The last stage's loss of one micro-batch from its output and the labels [B, S], and its LM part:
        lm_loss, and with the hidden state (MTP in training) the MTP term (moe.mtp.mtp_loss) and the MTP blocks'
        router losses, all times loss_scale; each depth's loss and the routing statistics tallied."""
        *hidden, labels = hidden_and_labels
        loss = lm_loss(logits, labels, self.loss_scale, self.tp, self.cp)
        if not hidden:
            return loss, loss
        cos, sin = position_tables(self.cfg, hidden[0].shape[1], hidden[0].device, self.tp, self.cp)
        losses, stats = complete(mtp_steps(self.mtp, hidden[0], labels, self.embed, self.lm_head,
                                           lambda x, y: token_cross_entropy(x, y, self.tp), cos, sin, self.tp,
                                           self.cfg.vocab_size))
        self.mtp_tally += torch.stack(losses).detach().double() * self.loss_scale
        extra = mtp_loss(losses, self.cfg)
        for k, layer_stats in enumerate(stats):  # the depths' MoE layers, numbered after the model's
            self.tallies[self.cfg.num_layers + k].add(layer_stats, self.loss_scale)
            extra = extra + layer_stats.aux_loss
        return loss + extra * self.loss_scale, loss


def lm_loss(logits: Tensor, labels: Tensor, scale: float, tp: TPRegion | None = None,
            cp: CPRegion | None = None) -> Tensor:
    """Mean next-token cross-entropy of one micro-batch times its share of the step's loss; under TP
    logits are this rank's vocab block and the loss is the same scalar on every TP rank; under CP labels are
    whole sequences, logits this rank's zig-zag share, and the loss is this share's mean over cp (the CP
    ranks' losses add up to the micro-batch's)."""
    if cp is not None:
        labels, scale = cp.shard(labels), scale / cp.size
    return token_cross_entropy(logits.flatten(0, 1), labels.flatten(), tp) * scale


def token_cross_entropy(logits: Tensor, labels: Tensor, tp: TPRegion | None = None) -> Tensor:
    """Mean cross-entropy of logits [N, vocab] (under TP this rank's vocab block) against labels [N], in >= float32,
    over the labels that are not moe.mtp.IGNORE."""
    if tp is not None:
        return vocab_parallel_cross_entropy(logits, labels, tp.group)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels)


def stage_ranges(cfg: ModelConfig, seq_len: int, num_stages: int) -> list[range]:
    """The layers of each stage, balanced by forward FLOPs per token (launch.metrics.flops: the model's one count,
    causal attention; the LM head and the MTP depths counted in the last stage)."""
    costs = [f.total for f in model_layer_flops(cfg, seq_len)]
    return split_layers(costs, num_stages, head_cost=head_flops(cfg) + mtp_flops(cfg, seq_len))


def build_stages(model: MoETransformer, seq_len: int, num_stages: int, stage_ids: list[int]) -> list[Stage]:
    """The Stage modules stage_ids (positions along the pipeline) of model split into num_stages."""
    ranges = stage_ranges(model.cfg, seq_len, num_stages)
    return [Stage(model, ranges[s], s == 0, s == num_stages - 1) for s in stage_ids]
