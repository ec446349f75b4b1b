"""Multi-head latent attention as DeepSeek-V3 builds it (arXiv 2412.19437, section 2.1.1).

Queries come from a low-rank latent (q_a, RMSNorm, q_b; or one plain projection `q` when q_lora_rank = 0,
as in DeepSeek-V2-Lite). Keys and values come from one joint latent of width kv_lora_rank (kv_a, RMSNorm,
kv_b), whose up-projection gives every head its qk_nope_head_dim key and v_head_dim value. kv_a also
yields one qk_rope_head_dim key that carries RoPE and is shared by all heads; each head's query has its
own RoPE part. RoPE rotates interleaved pairs (moe.rope), DeepSeek's layout. Scores are scaled by
1/sqrt(qk_nope_head_dim + qk_rope_head_dim), V3's scale without YaRN (ModelConfig has no RoPE scaling,
so there is no YaRN mscale to apply). The latent norms use model.norm_eps, as the block norms (DeepSeek-V3: 1e-6
everywhere; transformers' DeepseekV3Attention fixes its latent norms at 1e-6).

Every weight is an nn.Linear (the pipeline runtime defers their weight grads: pipeline.wgrad; with
model.linear_precision = "fp8" a kernels.FP8Linear, which defers its own, and the latent norms' outputs reach q_b and
kv_b as e4m3 rows, moe.linear.fp8_norm_output) or an RMSNorm scale. Under TP (moe.tp.parallelize_mla) heads split: q/q_b, kv_b (column-parallel) and out (row-parallel)
keep this rank's heads; the down-projections q_a and kv_a and the latent norms are held whole by every TP
rank, their grads partial sums over the heads of each rank (summed over TP by the trainer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.config import ModelConfig
from moe.linear import detached, make_linear, normed_input, project_heads, quantised_once, rows_of, takes_rows
from moe.norm import RMSNorm
from moe.recompute import Rebuild
from moe.rope import apply_rope

if TYPE_CHECKING:
    from kernels import FP8Rows
    from moe.cp import CPRegion
    from moe.tp.comm import TPRegion


class MLA(nn.Module):
    """Causal multi-head latent attention: [B, S, H] -> [B, S, H] (with TP+SP: sequence shards in and out)."""

    def __init__(self, cfg: ModelConfig, out_std: float) -> None:
        super().__init__()
        h, std = cfg.hidden_size, cfg.init_std
        self.num_heads = cfg.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.softmax_scale = self.qk_head_dim ** -0.5
        query = cfg.num_heads * self.qk_head_dim

        def _linear(width_in: int, width_out: int, std: float) -> nn.Linear:
            return make_linear(width_in, width_out, cfg.linear_precision, std)

        if cfg.q_lora_rank:
            self.q_a = _linear(h, cfg.q_lora_rank, std)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.q_b = _linear(cfg.q_lora_rank, query, std)
        else:
            self.q = _linear(h, query, std)
        self.kv_a = _linear(h, cfg.kv_lora_rank + self.rope_dim, std)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, eps=cfg.norm_eps)
        self.kv_b = _linear(cfg.kv_lora_rank, cfg.num_heads * (self.nope_dim + self.v_dim), std)
        self.out = _linear(cfg.num_heads * self.v_dim, h, out_std)
        self.tp: TPRegion | None = None
        self.cp: CPRegion | None = None  # context parallelism: x holds this rank's zig-zag share of each sequence
        self.recompute = "none"  # "selective": q, k, v and the latent norms' outputs rebuilt in backward

    def query_projection(self) -> nn.Linear:
        """The linear whose rows are the heads' queries (q_b, or q without a query latent)."""
        return self.q_b if self.q_lora_rank else self.q

    def down_projections(self) -> list[nn.Module]:
        """The modules before the head split: latent down-projections and their norms."""
        query = [self.q_a, self.q_a_norm] if self.q_lora_rank else []
        return [*query, self.kv_a, self.kv_a_norm]

    def takes_rows(self) -> bool:
        """Whether forward takes its input as FP8Rows (the norm before it quantised once for q_a and kv_a, and rebuilds
        them under selective recompute): FP8 linears, a query latent (without one, q's input would be held to rebuild
        the queries), no TP (whose SP gather comes between the norm and the linears; forward then quantises the
        gathered rows once itself)."""
        return takes_rows(self.kv_a) and bool(self.q_lora_rank) and self.tp is None

    def forward(self, x: Tensor | FP8Rows, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        """x [B, S, H] (FP8Rows when takes_rows()) -> [B, S, H]; cos, sin: rope_tables of qk_rope_head_dim; mask: a
        boolean [B, 1, S, S] in place of the causal mask (moe.documents.document_attention_mask)."""
        if self.tp is not None:
            x = self.tp.enter(x)
        x = quantised_once(x, self.kv_a)
        q_latent = self.q_a(x) if self.q_lora_rank else x
        latent, k_rope = self.kv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.recompute == "selective":
            attn = self._attend_rebuilt(q_latent, latent, k_rope, cos, sin, mask)
        else:
            attn = self._attend(self._query(q_latent, cos, sin), *self._key_value(latent, k_rope, cos, sin), mask)
        out = project_heads(self.out, attn, core_keeps=self.cp is None)
        return out if self.tp is None else self.tp.leave(out)

    def _query(self, q_latent: Tensor | FP8Rows, cos: Tensor, sin: Tensor, rebuild: Rebuild | None = None) -> Tensor:
        """Queries [B, heads, S, qk_head_dim] (RoPE applied) from the query latent (x itself without one)."""
        batch, seq, _ = rows_of(q_latent).shape
        if self.q_lora_rank:
            q = self.q_b(normed_input(rebuild, self.q_a_norm, q_latent, takes_rows(self.q_b)))
        else:
            q = self.q(q_latent)
        q_nope, q_rope = q.view(batch, seq, -1, self.qk_head_dim).transpose(1, 2).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        return torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)

    def _key_value(self, latent: Tensor, k_rope: Tensor, cos: Tensor, sin: Tensor,
                   rebuild: Rebuild | None = None) -> tuple[Tensor, Tensor]:
        """Keys [B, heads, S, qk_head_dim] and values [B, heads, S, v_dim] from the joint latent and the shared
        RoPE key part."""
        batch, seq, _ = latent.shape
        kv = self.kv_b(normed_input(rebuild, self.kv_a_norm, latent, takes_rows(self.kv_b)))
        kv = kv.view(batch, seq, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin).expand(-1, k_nope.shape[1], -1, -1)
        return torch.cat((k_nope, k_rope), dim=-1), v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.cp is not None:
            return self.cp.attend(q, k, v, self.softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale)

    def _attend_rebuilt(self, q_latent: Tensor | FP8Rows, latent: Tensor, k_rope: Tensor, cos: Tensor, sin: Tensor,
                        mask: Tensor | None = None) -> Tensor:
        """_attend under selective recompute: the latent norms' outputs and q, k, v are not kept for backward but
        rebuilt there from the latents (the up-projections run again, once for k and v when k is unpacked first,
        as the attention's backward does)."""
        q_kept, *kv_kept = (detached(t) for t in (q_latent, latent, k_rope))
        values: list[Tensor] = []

        def rebuild_k() -> Tensor:
            k, v = self._key_value(*kv_kept, cos, sin)
            values.append(v)
            return k

        with Rebuild() as rebuild:
            q = rebuild.drop(self._query(q_latent, cos, sin, rebuild), lambda: self._query(q_kept, cos, sin))
            k, v = self._key_value(latent, k_rope, cos, sin, rebuild)
            rebuild.drop(k, rebuild_k)
            rebuild.drop(v, lambda: values.pop() if values else self._key_value(*kv_kept, cos, sin)[1])
            return self._attend(q, k, v, mask)
