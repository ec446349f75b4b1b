"""Vocab-parallel embedding, LM head and cross-entropy: each TP rank holds vocab_size/tp rows, none the full logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.wgrad_defer import weight_grad_or_defer
from moe.tp.comm import Group, TPRegion, all_reduce
from moe.tp.layout import check_divisible, shard_param


def vocab_rows(vocab_size: int, tp: int) -> list[Tensor]:
    """Per TP rank, its contiguous block of vocab ids."""
    return list(torch.arange(vocab_size).chunk(tp))


class _EmbeddingRows(torch.autograd.Function):
    """Rows of weight for local ids (zeros where the token lives on another rank); weight grad deferrable."""

    @staticmethod
    def forward(ctx, weight: Tensor, ids: Tensor, outside: Tensor) -> Tensor:  # noqa: D102
        ctx.save_for_backward(ids, outside)
        ctx.weight_shape = weight.shape
        return F.embedding(ids, weight).masked_fill_(outside.unsqueeze(-1), 0.0)

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        ids, outside = ctx.saved_tensors
        rows = dy.masked_fill(outside.unsqueeze(-1), 0.0).reshape(-1, dy.shape[-1])
        flat_ids = ids.reshape(-1)
        grad = weight_grad_or_defer(ctx, 0, lambda: rows.new_zeros(ctx.weight_shape).index_add_(0, flat_ids, rows),
                                    holds=(flat_ids, rows))
        return grad, None, None


class VocabParallelEmbedding(nn.Module):
    """This TP rank's vocab rows of an embedding; output summed over TP (replicated, or sequence shards with SP)."""

    def __init__(self, embed: nn.Embedding, region: TPRegion) -> None:
        super().__init__()
        check_divisible("the padded vocab (model.vocab_size, model.vocab_multiple)", embed.num_embeddings, region.size)
        rows = vocab_rows(embed.num_embeddings, region.size)
        self.vocab_start, self.num_local = int(rows[region.rank][0]), rows[region.rank].numel()
        self.weight = embed.weight
        shard_param(self, "weight", rows, region.rank)
        self.region = region

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [B, S] -> [B, S, H] (no SP) or this rank's sequence shard [B, S/tp, H] (SP)."""
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = _EmbeddingRows.apply(self.weight, local.masked_fill(outside, 0), outside)
        return self.region.leave(out)


def parallelize_embedding(embed: nn.Embedding, tp_group: Group, sequence_parallel: bool,
                          grad_group: Group | None = None) -> VocabParallelEmbedding:
    """A vocab-parallel embedding holding this rank's rows of embed (state key stays `weight`); grad_group: see TPRegion."""
    return VocabParallelEmbedding(embed, TPRegion(tp_group, sequence_parallel, 1, grad_group))


def parallelize_head(lm_head: nn.Linear, tp_group: Group) -> nn.Linear:
    """Keep this rank's vocab rows of the LM head in place (still a plain nn.Linear, so B/W splits defer it).

    Feed it `TPRegion(tp_group, sequence_parallel).enter(final_norm_output)` (the full sequence on
    every rank) and pass its logits shard [..., vocab/tp] to vocab_parallel_cross_entropy.
    """
    size, rank = torch.distributed.get_world_size(tp_group), torch.distributed.get_rank(tp_group)
    check_divisible("the padded vocab (model.vocab_size, model.vocab_multiple)", lm_head.out_features, size)
    shard_param(lm_head, "weight", vocab_rows(lm_head.out_features, size), rank)
    lm_head.out_features //= size
    return lm_head


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, group: Group, ignore_index: int) -> Tensor:  # noqa: D102
        rank, vocab_local = torch.distributed.get_rank(group), logits.shape[-1]
        local = labels - rank * vocab_local
        valid = labels != ignore_index
        inside = valid & (local >= 0) & (local < vocab_local)
        local = local.masked_fill(~inside, 0)
        top = all_reduce(logits.detach().amax(-1), group, "max")
        probs = logits.detach() - top.unsqueeze(-1)  # the one [tokens, vocab/tp] tensor, exp'd in place
        target = probs.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        probs.exp_()
        sums = all_reduce(torch.stack((probs.sum(-1), target)), group)
        count = valid.sum().clamp(min=1)
        loss = ((sums[0].log() - sums[1]) * valid).sum() / count
        probs.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(probs, local, inside, valid, count)
        return loss

    @staticmethod
    def backward(ctx, dloss: Tensor):  # noqa: D102
        probs, local, inside, valid, count = ctx.saved_tensors
        grad = probs  # softmax, turned into the logits grad in place: backward runs once
        grad.scatter_add_(-1, local.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        grad.mul_((valid.to(grad.dtype) * (dloss / count)).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, tp_group: Group, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy over tokens whose label != ignore_index, from vocab-sharded logits.

    logits [N, vocab/tp] (this rank's vocab block, rank order), labels [N] global ids; the result is
    the same scalar on every TP rank. Creates nothing larger than [N, vocab/tp] (one such tensor,
    kept for backward as the softmax and turned into the grad in place: backward runs once).
    Low-precision logits are upcast to float32.
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, vocab/tp] and labels [N], got {list(logits.shape)} and {list(labels.shape)}")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return _VocabParallelCrossEntropy.apply(logits, labels, tp_group, ignore_index)
