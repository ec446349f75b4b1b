"""DeepSeek-V3's multi-token prediction (arXiv 2412.19437 sec. 2.2): sequential modules predicting tokens further ahead.

Depth k (1..D) takes the previous depth's hidden state h^(k-1) (depth 1: the main model's last residual stream,
before its final norm) and the embedding of the token k positions ahead, RMSNorms each (hnorm, enorm), projects
their concatenation [2H] to H (eh_proj), runs one transformer block (the model's MoE block kind) and its own output
norm (head_norm), and predicts the token k + 1 positions ahead through the model's output head; the embedding and
the head are the model's own tensors.

Shapes stay the main model's [B, S]: with labels[i] = token i + 1, depth k's input at position i is token i + k
(labels[i + k - 1]) and its target token i + k + 1 (labels[i + k]). The last k positions have no target inside the
sequence: their loss terms are dropped (as V3 drops them) and their inputs padded with the sequence's last token.
Causal attention keeps every other position exactly what V3's shortened sequence gives; the padded tail is still
routed by the MTP block's MoE layer, so it counts in that layer's loads and balance losses. Keeping the shapes
lets TP's sequence shards line up with the main model's.
"""

from __future__ import annotations

from typing import Any, Callable, Generator

import torch
from torch import Tensor, nn

from moe.config import ModelConfig
from moe.layer import MoEStats
from moe.linear import make_linear
from moe.norm import RMSNorm
from moe.tp import TPRegion
from moe.tp.layout import mark_replicated
from moe.vocab import head_logits

IGNORE = -100  # the cross-entropy's ignore_index: a position without a target


class MTPDepth(nn.Module):
    """One MTP depth: hnorm and enorm, eh_proj [2H -> H], a transformer block, head_norm (V3's shared_head.norm)."""

    def __init__(self, cfg: ModelConfig, block: nn.Module) -> None:
        super().__init__()
        self.hnorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.enorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.eh_proj = make_linear(2 * cfg.hidden_size, cfg.hidden_size, cfg.linear_precision, cfg.init_std)
        self.block = block
        self.head_norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward_steps(self, hidden: Tensor, embedded: Tensor, cos: Tensor, sin: Tensor
                      ) -> Generator[Any, None, tuple[Tensor, Tensor, MoEStats | None]]:
        """(h^(k-1), embeddings of the tokens k ahead), both [B, S, H] -> (h^k, head_norm(h^k), the block's MoE stats
        or None); pauses while the block's MoE communication is in flight (pipeline.overlap)."""
        x = self.eh_proj(torch.cat((self.hnorm(hidden), self.enorm(embedded)), dim=-1))
        x, stats = yield from self.block.forward_steps(x, cos, sin)
        return x, self.head_norm(x), stats


def mtp_tokens(labels: Tensor, depth: int) -> tuple[Tensor, Tensor]:
    """labels [B, S] (labels[i] = token i + 1) -> depth's inputs (token i + depth, the tail padded with the last
    label) and targets (token i + depth + 1, IGNORE for the last depth positions), both [B, S]."""
    batch = labels.shape[0]
    inputs = torch.cat((labels[:, depth - 1:], labels[:, -1:].expand(batch, depth - 1)), dim=1)
    targets = torch.cat((labels[:, depth:], labels.new_full((batch, depth), IGNORE)), dim=1)
    return inputs, targets


def mtp_steps(depths: nn.ModuleList, hidden: Tensor, labels: Tensor, embed: nn.Module, lm_head: nn.Linear,
              cross_entropy: Callable[[Tensor, Tensor], Tensor], cos: Tensor, sin: Tensor, tp: TPRegion | None,
              vocab_size: int) -> Generator[Any, None, tuple[list[Tensor], list[MoEStats]]]:
    """Run every depth on the main model's hidden [B, S, H] (under TP+SP its sequence shard) and whole-sequence
    labels [B, S]: (each depth's mean cross-entropy over its positions with a target, the MoE stats of the depths'
    blocks). cross_entropy(logits [N, vocab(/tp)], targets [N]) skips IGNORE targets; vocab_size: the ids past it are
    padding (moe.vocab)."""
    losses, stats = [], []
    for k, depth in enumerate(depths, start=1):
        inputs, targets = mtp_tokens(labels, k)
        hidden, normed, layer_stats = yield from depth.forward_steps(hidden, embed(inputs), cos, sin)
        logits = head_logits(lm_head, normed, vocab_size, tp)
        losses.append(cross_entropy(logits.flatten(0, 1), targets.flatten()))
        if layer_stats is not None:
            stats.append(layer_stats)
    return losses, stats


def mtp_loss(losses: list[Tensor], cfg: ModelConfig) -> Tensor:
    """The MTP term of the training loss: mtp_loss_coeff times the mean of the depths' losses."""
    return cfg.mtp_loss_coeff / cfg.mtp_depth * sum(losses[1:], losses[0])


def parallelize_mtp(depth: MTPDepth, sequence_parallel: bool) -> None:
    """Mark a depth's norms and eh_proj as held whole on every TP rank: each rank applies them to its sequence
    shard with SP (grads 'partial'), to the whole replicated sequence without (grads 'identical'). Its block is
    converted as the model's (moe.tp.parallelize_block)."""
    for module in (depth.hnorm, depth.enorm, depth.eh_proj, depth.head_norm):
        mark_replicated(module, "partial" if sequence_parallel else "identical")
