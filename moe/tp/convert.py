"""In-place conversion of a single-process block to this TP rank's shard (attention, dense FFN, MoE, norms).

A converted Block takes and returns the residual stream as [B, S, H] replicated over the TP group
without SP, and as this rank's sequence shard [B, S/tp, H] (contiguous, rank order) with SP. Use
`scatter_sequence` / `gather_sequence` (moe.tp.comm) at stage boundaries that change layout.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.experts import SwiGLU
from moe.layer import MoELayer
from moe.local_dispatch import LocalDispatcher
from moe.mla import MLA
from moe.router import TopKRouter
from moe.tp.comm import Group, TPRegion, reduce_from_region
from moe.tp.layout import check_divisible, check_kv_heads, mark_replicated, shard_param


def head_rows(heads: Tensor, head_dim: int, offset: int = 0) -> Tensor:
    """Row positions of the given heads in a projection whose head blocks start at row offset."""
    return (offset + heads.unsqueeze(-1) * head_dim + torch.arange(head_dim)).flatten()


def parallelize_attention(attn: nn.Module, region: TPRegion) -> None:
    """Keep this rank's query heads (and its KV heads, or all KV heads replicated when num_kv_heads < tp)."""
    size, rank = region.size, region.rank
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    check_divisible("model.num_heads", heads, size)
    check_kv_heads(kv_heads, size)
    q_heads = list(torch.arange(heads).chunk(size))
    q_rows = [head_rows(h, dim) for h in q_heads]
    if kv_heads % size == 0:
        kv = list(torch.arange(kv_heads).chunk(size))
        rows = [torch.cat((q, head_rows(h, dim, heads * dim), head_rows(h, dim, (heads + kv_heads) * dim)))
                for q, h in zip(q_rows, kv)]
        shard_param(attn.qkv, "weight", rows, rank)
        attn.num_kv_heads = kv_heads // size
    else:  # every rank holds all KV heads (few, small) and uses the one its query heads share
        kv_rows = torch.arange(heads * dim, (heads + 2 * kv_heads) * dim)
        attn.kv = type(attn.qkv)(attn.qkv.in_features, kv_rows.numel(), bias=False,  # nn.Linear or FP8Linear
                                 device=attn.qkv.weight.device, dtype=attn.qkv.weight.dtype)
        attn.kv.weight = attn.qkv.weight
        shard_param(attn.kv, "weight", [kv_rows] * size, rank, grads="partial", source="qkv.weight")
        shard_param(attn.qkv, "weight", q_rows, rank)
        attn.kv_head = rank // (size // kv_heads)
    attn.qkv.out_features = attn.qkv.weight.shape[0]
    shard_param(attn.out, "weight", q_rows, rank, dim=1)
    attn.out.in_features = attn.out.weight.shape[1]
    attn.num_heads = heads // size
    attn.tp = region


def parallelize_mla(attn: MLA, region: TPRegion) -> None:
    """Keep this rank's heads of the query (q or q_b) and kv_b rows (column-parallel) and of out's columns
    (row-parallel); the latent down-projections and norms stay whole, their grads partial over TP."""
    size, rank = region.size, region.rank
    check_divisible("model.num_heads", attn.num_heads, size)
    heads = list(torch.arange(attn.num_heads).chunk(size))
    for linear, head_dim in ((attn.query_projection(), attn.qk_head_dim), (attn.kv_b, attn.nope_dim + attn.v_dim)):
        shard_param(linear, "weight", [head_rows(h, head_dim) for h in heads], rank)
        linear.out_features = linear.weight.shape[0]
    shard_param(attn.out, "weight", [head_rows(h, attn.v_dim) for h in heads], rank, dim=1)
    attn.out.in_features = attn.out.weight.shape[1]
    for module in attn.down_projections():
        mark_replicated(module, "partial")
    attn.num_heads //= size
    attn.tp = region


def parallelize_swiglu(mlp: SwiGLU, region: TPRegion) -> None:
    """Column-parallel gate/up (this rank's ffn/tp columns of each) and row-parallel down projection."""
    size, rank = region.size, region.rank
    ffn = mlp.down.in_features
    check_divisible("FFN width (model.dense_ffn_size, or num_shared_experts * expert_ffn_size)", ffn, size)
    cols = list(torch.arange(ffn).chunk(size))
    shard_param(mlp.gate_up, "weight", [torch.cat((c, ffn + c)) for c in cols], rank)
    shard_param(mlp.down, "weight", cols, rank, dim=1)
    mlp.gate_up.out_features, mlp.down.in_features = 2 * cols[rank].numel(), cols[rank].numel()
    mlp.tp = region


class TensorParallelRouter(TopKRouter):
    """A TopKRouter over this TP rank's tokens whose balance losses use statistics summed over the TP group.

    Each TP rank routes only its own sequence shard; the load-balance, sequence-wise and z losses
    are computed from per-expert (and per-sequence) sums all-reduced over the TP group in one call,
    so they equal the single-process losses over the full sequences and are the same on every TP
    rank (their backward reaches each rank's own tokens). seq_len passed in is the local shard's.
    tokens_per_expert and dropped stay this rank's: sum them over the TP (and DP) ranks for the
    global load fed to update_bias. With capacity_factor, capacity applies per shard (tokens/tp).
    """

    tp: TPRegion

    def _balance_losses(self, logits: Tensor, scores: Tensor, indices: Tensor,
                        seq_len: int | None) -> dict[str, Tensor]:
        size = self.tp.size
        tokens, experts, k = scores.shape[0] * size, self.num_experts, self.top_k
        probs = scores / scores.sum(-1, keepdim=True)
        chosen = torch.zeros_like(scores).scatter_(1, indices, 1.0)
        parts = [chosen.sum(0), probs.sum(0), torch.logsumexp(logits, -1).square().sum().unsqueeze(0)]
        if self.seq_aux_loss_coeff:
            if seq_len is None or scores.shape[0] % seq_len:
                raise ValueError(f"seq_aux_loss_coeff needs seq_len dividing the {scores.shape[0]} routed tokens, "
                                 f"got {seq_len}")
            parts += [chosen.view(-1, seq_len, experts).sum(1).flatten(), probs.view(-1, seq_len, experts).sum(1).flatten()]
        sizes = [p.numel() for p in parts]
        summed = reduce_from_region(torch.cat(parts), self.tp.group).split(sizes)
        losses = {"load_balance": experts * (summed[0].detach() / (tokens * k) * summed[1] / tokens).sum(),
                  "z": summed[2][0] / tokens}
        if self.seq_aux_loss_coeff:
            full_seq = seq_len * size
            per_seq = summed[3].detach().view(-1, experts) * experts / (k * full_seq)
            losses["seq_balance"] = (per_seq * summed[4].view(-1, experts) / full_seq).sum(-1).mean()
        return losses


def parallelize_moe(layer: MoELayer, region: TPRegion) -> None:
    """Route per TP rank with global balance losses; shared experts split like the dense FFN (on token shards).

    The layer always sees this rank's token shard, so its shared experts gather tokens along dim 0
    (SP collectives). Routed experts are untouched: held whole (local; grads partial over TP) or
    split by `layer.to_expert_parallel(EPDispatcher(..., group=ep_group))`, before or after this.
    """
    layer.router.__class__ = TensorParallelRouter
    layer.router.tp = region
    mark_replicated(layer.router, "partial")
    if isinstance(layer.dispatcher, LocalDispatcher):  # to_expert_parallel later makes fresh, spec-less params
        mark_replicated(layer.experts, "partial")
    if layer.shared is not None:
        parallelize_swiglu(layer.shared, region.along(0))


def parallelize_block(block: nn.Module, tp_group: Group, sequence_parallel: bool,
                      grad_group: Group | None = None) -> None:
    """Convert a moe.model.Block in place to this TP rank's shard.

    Input and output: [B, S, H] replicated over tp_group without SP; the rank's sequence shard
    [B, S/tp, H] with SP. An MoE block routes only this rank's S/tp tokens either way (without SP
    it slices them from the replicated input and all-gathers its output). grad_group: see TPRegion.
    """
    region = TPRegion(tp_group, sequence_parallel, 1, grad_group)
    (parallelize_mla if isinstance(block.attn, MLA) else parallelize_attention)(block.attn, region)
    norms = "partial" if sequence_parallel else "identical"
    mark_replicated(block.attn_norm, norms)
    mark_replicated(block.ffn_norm, norms)
    if isinstance(block.ffn, MoELayer):
        parallelize_moe(block.ffn, region)
        block.moe_tokens = None if sequence_parallel else region
    else:
        parallelize_swiglu(block.ffn, region)



def concurrent_backward(module: nn.Module) -> bool:
    """Whether every TP region inside module runs its backward collectives on a grad_group of its own,
    so that module's backward may run on another thread beside a forward (true without TP regions)."""
    return all(value.concurrent_backward for m in module.modules() for value in vars(m).values()
               if isinstance(value, TPRegion))
