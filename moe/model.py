"""Decoder-only DeepSeek-style transformer: RMSNorm, RoPE, causal GQA or MLA attention, dense then MoE layers."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dispatch.channel import run_steps
from dispatch.choices import check_choice
from moe.config import ModelConfig
from moe.cp import CPRegion
from moe.documents import document_attention_mask, document_positions
from moe.experts import SwiGLU
from moe.layer import MoELayer, MoEStats
from moe.linear import make_linear, normed_input, project_heads, quantised_once, rows_of, takes_rows
from moe.mla import MLA
from moe.mtp import MTPDepth, mtp_loss, mtp_steps, parallelize_mtp
from moe.norm import RMSNorm
from moe.recompute import Recompute, Rebuild, recomputed
from moe.rope import apply_rope, rope_tables
from moe.tp import (TensorParallelRouter, TPRegion, check_tp_shapes, parallelize_block, parallelize_embedding,
                    parallelize_head, vocab_parallel_cross_entropy)
from moe.tp.comm import Group
from moe.tp.layout import mark_replicated
from moe.vocab import head_logits

if TYPE_CHECKING:
    from kernels import FP8Rows


def position_tables(cfg: ModelConfig, local_len: int, device: torch.device, tp: TPRegion | None = None,
                    cp: CPRegion | None = None, documents: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """RoPE cos and sin rows for a residual stream of local_len positions: the whole sequence's under TP with
    SP (attention gathers it), this rank's zig-zag positions under CP; with documents (moe.documents.document_ids
    [B, S]) each row's positions restart at every document, tables [B, S, rope_dim/2]."""
    seq = local_len * (tp.size if tp is not None and tp.sequence_parallel else 1) * (cp.size if cp is not None else 1)
    cos, sin = rope_tables(seq, cfg.rope_dim, cfg.rope_theta, device)
    if documents is not None:
        if cp is not None:
            raise ValueError("document masking (data.document_mask) does not run under context parallelism")
        rows = document_positions(documents)
        return cos[rows], sin[rows]
    if cp is None:
        return cos, sin
    rows = cp.positions(seq, device)
    return cos[rows], sin[rows]


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings (tensor-parallel after moe.tp.parallelize_attention).

    Under TP, qkv holds this rank's query heads (and its KV heads); when KV heads are fewer than
    TP ranks, qkv holds only query rows and `kv` all KV heads, of which head `kv_head` is used.
    """

    def __init__(self, cfg: ModelConfig, out_std: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.attention_head_dim
        self.qkv = make_linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * self.head_dim,
                               cfg.linear_precision, cfg.init_std)
        self.out = make_linear(cfg.num_heads * self.head_dim, cfg.hidden_size, cfg.linear_precision, out_std)
        self.kv: nn.Linear | None = None
        self.kv_head: int | None = None
        self.tp: TPRegion | None = None
        self.cp: CPRegion | None = None  # context parallelism: x holds this rank's zig-zag share of each sequence

    def takes_rows(self) -> bool:
        """Whether forward takes its input as FP8Rows (quantised by the norm before it, rebuilt under selective
        recompute): an FP8 qkv, no TP (whose SP gather comes between the norm and qkv; forward quantises the gathered
        rows once itself)."""
        return takes_rows(self.qkv) and self.tp is None

    def forward(self, x: Tensor | FP8Rows, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        """x [B, S, H] (FP8Rows when takes_rows()) -> [B, S, H] (under TP with SP: sequence shards [B, S/tp, H] in and
        out; under CP: zig-zag shards, cos and sin their positions' rows); mask: a boolean [B, 1, S, S] replacing the
        causal mask (moe.documents.document_attention_mask)."""
        if self.tp is not None:
            x = self.tp.enter(x)
        batch, seq, _ = rows_of(x).shape
        x = quantised_once(x, self.qkv)  # one set of e4m3 tiles for qkv and kv (KV heads replicated over TP)
        qkv = self.qkv(x) if self.kv is None else torch.cat((self.qkv(x), self.kv(x)), dim=-1)
        q, k, v = qkv.view(batch, seq, -1, self.head_dim).transpose(1, 2).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.kv_head is not None:
            k, v = k[:, self.kv_head:self.kv_head + 1], v[:, self.kv_head:self.kv_head + 1]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.cp is not None:
            attn = self.cp.attend(q, k, v)
        else:
            repeat = self.num_heads // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        out = project_heads(self.out, attn, core_keeps=self.cp is None)
        return out if self.tp is None else self.tp.leave(out)


class Block(nn.Module):
    """Pre-norm transformer block whose FFN is a dense SwiGLU or an MoE layer.

    recompute (moe.recompute.Recompute): "selective" rebuilds the norms' outputs, MLA's q/k/v and the SwiGLU
    products in backward. "full" keeps a dense block's input only and reruns the block in backward; an MoE block
    is rerun in segments that hold no communication: attention with both norms (its input kept), the routed experts
    (their dispatched rows kept) and the shared experts (the FFN norm's output kept); the router, dispatch and
    combine keep what they keep without recompute and never run again, so routing, its statistics and the aux loss
    are those of the forward and no collective is issued in backward. "full" needs a model without TP or CP.
    """

    def __init__(self, cfg: ModelConfig, moe: bool, recompute: str = "none") -> None:
        super().__init__()
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        check_choice("train.recompute", recompute, Recompute)
        self.recompute = recompute
        self.attn_norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = (MLA if cfg.attention == "mla" else Attention)(cfg, out_std)
        self.ffn_norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ffn = (MoELayer(cfg) if moe
                    else SwiGLU(cfg.hidden_size, cfg.dense_ffn_size, init_std=cfg.init_std, out_std=out_std,
                                precision=cfg.linear_precision))
        if isinstance(self.attn, MLA):
            self.attn.recompute = "selective" if recompute == "selective" else "none"
        for mlp in (self.ffn.experts, self.ffn.shared) if moe else (self.ffn,):
            if mlp is not None:
                mlp.recompute = recompute if moe or recompute == "selective" else "none"
        if not moe:
            self.ffn.activation_cache = cfg.activation_cache
        self.moe_tokens: TPRegion | None = None  # TP without SP: the MoE layer routes this rank's S/tp tokens

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None
                ) -> tuple[Tensor, MoEStats | None]:
        """x [B, S, H] -> (x [B, S, H], MoE stats or None for a dense block); with TP+SP x is [B, S/tp, H];
        mask: the attention's boolean mask in place of the causal one (moe.documents)."""
        return run_steps(self.forward_steps(x, cos, sin, mask))

    def forward_steps(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None
                      ) -> Generator[Any, None, tuple[Tensor, MoEStats | None]]:
        """forward as a generator that pauses while the MoE layer's communication is in flight
        (see pipeline.overlap); a dense block never pauses."""
        rebuild = Rebuild() if self.recompute == "selective" else None
        if self.recompute == "full":
            if not isinstance(self.ffn, MoELayer):
                return recomputed(lambda x: (self._dense(x, cos, sin, mask, None),), [x])[0], None
            x, h = recomputed(lambda x: self._attention(x, cos, sin, mask, None), [x])
        elif not isinstance(self.ffn, MoELayer):
            with rebuild or nullcontext():
                return self._dense(x, cos, sin, mask, rebuild), None
        else:
            with rebuild or nullcontext():
                x, h = self._attention(x, cos, sin, mask, rebuild)
        if self.moe_tokens is not None:
            h = self.moe_tokens.scatter(h)
        out, stats = yield from self.ffn.forward_steps(h, seq_len=h.shape[1], saved=rebuild)
        if self.moe_tokens is not None:
            out = self.moe_tokens.gather(out)
        return x + out, stats

    def _attention(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                   rebuild: Rebuild | None) -> tuple[Tensor, Tensor]:
        """The residual stream after attention and the FFN norm's output of it."""
        x = x + self.attn(normed_input(rebuild, self.attn_norm, x, self.attn.takes_rows()), cos, sin, mask)
        fused = not isinstance(self.ffn, MoELayer) and self.ffn.takes_rows()
        return x, normed_input(rebuild, self.ffn_norm, x, fused)

    def _dense(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, rebuild: Rebuild | None) -> Tensor:
        x, h = self._attention(x, cos, sin, mask, rebuild)
        return x + self.ffn(h)


@dataclass
class ModelOutput:
    """Logits (under TP: this rank's vocab block), losses and per-MoE-layer routing statistics of one forward pass."""

    logits: Tensor
    loss: Tensor | None = None
    lm_loss: Tensor | None = None
    aux_loss: Tensor | None = None
    moe_stats: list[MoEStats] = field(default_factory=list)
    mtp_losses: list[Tensor] = field(default_factory=list)  # with labels and model.mtp_depth: each depth's loss


class MoETransformer(nn.Module):
    """Embeddings, first_k_dense dense blocks, MoE blocks, final norm and LM head; mtp_depth MTP modules (moe.mtp);
    every block recomputes activations as `recompute` says (see Block)."""

    def __init__(self, cfg: ModelConfig, recompute: str = "none") -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        nn.init.normal_(self.embed.weight, std=cfg.init_std)
        self.blocks = nn.ModuleList(Block(cfg, moe=i >= cfg.first_k_dense, recompute=recompute)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, std=cfg.init_std)
        self.mtp = nn.ModuleList(MTPDepth(cfg, Block(cfg, moe=cfg.num_moe_layers > 0, recompute=recompute))
                                 for _ in range(cfg.mtp_depth)) if cfg.mtp_depth else None
        self.tp: TPRegion | None = None
        self.cp: CPRegion | None = None

    def to_context_parallel(self, region: CPRegion, sequence_group: Group | None = None,
                            sequence_grad_group: Group | None = None) -> None:
        """Split every sequence over region's ranks (zig-zag): attention attends across them (moe.cp) and each
        MoE router balances with statistics summed over them (as under TP); the caller feeds each rank its
        shard of the tokens and labels (region.shard) and the RoPE rows of its positions.

        After to_tensor_parallel, each TP rank's heads attend over the CP group (SP shards each CP shard) and the
        routers sum over sequence_group, the cp x tp ranks sharing each sequence (with its twin
        sequence_grad_group, see TPRegion); without TP they sum over region's group."""
        if self.cp is not None:
            raise ValueError("context parallelism is applied once")
        if (self.tp is not None) != (sequence_group is not None):
            raise ValueError("sequence_group (the cp x tp ranks sharing each sequence) is given exactly when the "
                             "model is tensor-parallel")
        if self.mtp is not None:
            raise ValueError("multi-token prediction (model.mtp_depth > 0) does not run under context parallelism")
        self.cp = region
        router = (TPRegion(region.group, False, 1, region.grad_group) if sequence_group is None
                  else TPRegion(sequence_group, False, 1, sequence_grad_group))
        for block in self.blocks:
            block.attn.cp = region
            if isinstance(block.ffn, MoELayer):
                block.ffn.router.__class__ = TensorParallelRouter
                block.ffn.router.tp = router

    def to_tensor_parallel(self, tp_group: Group, sequence_parallel: bool, grad_group: Group | None = None) -> None:
        """Keep this TP rank's shard of every layer in place (vocab rows, heads, FFN columns; see moe.tp).

        Load a single-process state dict before converting; moe.tp.gather_full rebuilds it after.
        The loss is then the same on every TP rank and logits are this rank's vocab block.
        grad_group: a second group over tp_group's ranks for backward collectives (see moe.tp.TPRegion).
        """
        if self.tp is not None:
            raise ValueError("the model is already tensor-parallel: convert the full model once")
        check_tp_shapes(self.cfg, None, torch.distributed.get_world_size(tp_group), sequence_parallel)
        self.embed = parallelize_embedding(self.embed, tp_group, sequence_parallel, grad_group)
        for block in self.blocks:
            parallelize_block(block, tp_group, sequence_parallel, grad_group)
        for depth in self.mtp or ():
            parallelize_block(depth.block, tp_group, sequence_parallel, grad_group)
            parallelize_mtp(depth, sequence_parallel)
        mark_replicated(self.norm, "partial" if sequence_parallel else "identical")
        parallelize_head(self.lm_head, tp_group)
        self.tp = TPRegion(tp_group, sequence_parallel, 1, grad_group)

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers in depth order, then the MTP depths' (cfg.num_routed_layers of them)."""
        blocks = [*self.blocks, *(depth.block for depth in self.mtp or ())]
        return [b.ffn for b in blocks if isinstance(b.ffn, MoELayer)]

    def forward(self, tokens: Tensor, labels: Tensor | None = None, documents: Tensor | None = None) -> ModelOutput:
        """tokens [B, S] -> ModelOutput; with labels [B, S], loss = LM cross-entropy + router losses (+ the MTP term,
        moe.mtp.mtp_loss, and the MTP blocks' router losses). documents: moe.documents.document_ids of tokens, to
        attend and count positions inside each document (the caller masks labels: moe.documents.document_labels)."""
        seq = tokens.shape[1]
        if documents is not None and self.mtp is not None:
            raise ValueError("multi-token prediction (model.mtp_depth > 0) does not run with document masking")
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len = {self.cfg.max_seq_len}")
        if self.tp is not None:
            check_tp_shapes(self.cfg, seq, self.tp.size, self.tp.sequence_parallel, 1 if self.cp is None else self.cp.size)
        if self.cp is not None:  # tokens and labels: whole sequences, of which this rank takes its zig-zag shard
            tokens = self.cp.shard(tokens)
            labels = None if labels is None else self.cp.shard(labels)
        cos, sin = position_tables(self.cfg, tokens.shape[1], tokens.device, cp=self.cp, documents=documents)
        mask = None if documents is None else document_attention_mask(documents)
        x = self.embed(tokens)
        stats = []
        for block in self.blocks:
            x, layer_stats = block(x, cos, sin, mask)
            if layer_stats is not None:
                stats.append(layer_stats)
        logits = self.head(x)
        if labels is None:
            return ModelOutput(logits, moe_stats=stats)
        lm_loss = self.cross_entropy(logits.flatten(0, 1), labels.flatten())
        mtp_losses = []
        if self.mtp is not None:
            mtp_losses, mtp_stats = run_steps(mtp_steps(self.mtp, x, labels, self.embed, self.lm_head,
                                                        self.cross_entropy, cos, sin, self.tp, self.cfg.vocab_size))
            stats += mtp_stats
        aux_loss = sum((s.aux_loss for s in stats), lm_loss.new_zeros(()))
        loss = lm_loss + aux_loss if self.mtp is None else lm_loss + aux_loss + mtp_loss(mtp_losses, self.cfg)
        return ModelOutput(logits, loss, lm_loss, aux_loss, stats, mtp_losses)

    def head(self, x: Tensor) -> Tensor:
        """Final norm and LM head on the residual stream x -> logits over the padded vocab, padded ids at -inf (under TP:
        gathered over the group's sequence shards with SP; logits [B, S, padded vocab/tp] are this rank's vocab block)."""
        return head_logits(self.lm_head, self.norm(x), self.cfg.vocab_size, self.tp)

    def sequence_length(self, x: Tensor) -> int:
        """Full sequence length of a residual stream x [B, S, H] (under TP+SP x holds S/tp positions)."""
        return x.shape[1] * (self.tp.size if self.tp is not None and self.tp.sequence_parallel else 1)

    def cross_entropy(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Mean LM loss of logits [N, vocab] (under TP: this rank's vocab block) against labels [N], in >= float32."""
        if self.tp is not None:
            return vocab_parallel_cross_entropy(logits, labels, self.tp.group)
        return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: list[Tensor]) -> None:
        """Aux-loss-free balancing step for every MoE layer from its (globally summed) expert loads."""
        for layer, load in zip(self.moe_layers(), tokens_per_expert):
            layer.router.update_bias(load)
