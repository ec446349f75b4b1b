"""The model's FLOP count, the one source of it: per layer forward FLOPs per token (which price the pipeline
stages in launch.parallel.stages and the step time in launch.plan), training FLOPs per token (the MFU numerator of the
trainer's metrics and of moe-plan) and the peak FLOP/s MFU divides by when the experts run in FP8.

Convention (stated once, here):

- A matmul's multiply-add counts 2 FLOPs; norms, softmax, RoPE, activations, the router's top-k and the
  embedding lookup count nothing. Every weight matrix a token passes through counts: attention projections
  (GQA or MLA, as the config's model.attention builds them: moe.model, moe.mla), the dense FFN or the
  shared experts, the router's gate and top_k routed experts; the LM head once, on the last stage.
- Attention is causal: query i attends keys 0..i, so QK^T and AV use on average seq_len / 2 keys per query,
  half the work of full attention: forward 2 x heads x (qk_head_dim + v_head_dim) x seq_len / 2 per token and
  layer (2 x seq_len x hidden for this project's GQA). This is Megatron-LM's `num_floating_point_operations`
  ("causal mask (only half of the mask is non-zero)", seq_length / 2 for QK^T and for (QK^T)V, MLA with its
  qk (nope + rope) and v head widths). PaLM (appendix B: 6N + 12 L H Q T) and torchtitan
  (`get_num_flop_per_token`: 6N + 12 l h q t, "we follow the convention and do not account for sparsity in
  causal attention") count full attention instead, twice our attention-core term. We follow Megatron because
  the count is also the stage cost the pipeline split and moe-plan's step time use, where only work a causal
  kernel does belongs (flash attention skips the masked blocks), and because counting the masked half would
  flatter MFU by an amount growing with seq_len (DeepSeek-V3 with MLA at 4096 tokens: 12% more FLOPs per
  token). seq_len / 2 rather than the exact (seq_len + 1) / 2 keys:
  Megatron's figure, 1 / seq_len apart. causal=False gives the full-attention count, to compare with an MFU
  taken by PaLM's or torchtitan's convention (scale ours by full / causal); nothing here uses it otherwise.
- Training = 3 x forward: the backward computes input and weight gradients of every matmul (attention core:
  dQ, dK, dV and dP against QK^T and AV). Model FLOPs, not hardware FLOPs: recomputation (moe-plan's
  recompute modes, flash attention's backward) is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe.config import ModelConfig


@dataclass(frozen=True)
class AttentionShape:
    """What one attention layer counts: its weights and the per-head widths of its core."""

    sharded: int     # weights split over TP (GQA's q/k/v/out; MLA's query and kv up-projections and out)
    replicated: int  # weights each TP rank holds whole (MLA's q and kv down-projections)
    norms: int       # RMSNorm scales inside attention (MLA's latent norms), replicated; no matmul
    heads: int
    qk_head_dim: int
    v_head_dim: int
    kind: str        # model.attention: "gqa" or "mla"
    latent: int = 0  # MLA: latent widths per token (q_lora_rank + kv_lora_rank + qk_rope_head_dim)
    up: int = 0      # MLA: weights of the query and kv up-projections (what selective recompute redoes)


def attention_shape(cfg: ModelConfig) -> AttentionShape:
    """The attention cfg.attention builds: GQA (moe.model.Attention) or MLA (moe.mla.MLA: q/kv down-projections
    replicated over TP; without a query latent, q_lora_rank = 0, the query projection reads the hidden state)."""
    h, heads = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "gqa":
        head = cfg.attention_head_dim
        qkv = h * (heads + 2 * cfg.num_kv_heads) * head
        return AttentionShape(qkv + heads * head * h, 0, 0, heads, head, head, "gqa")
    nope, rope, v, q_rank, kv_rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank,
                                      cfg.kv_lora_rank)
    up = (q_rank or h) * heads * (nope + rope) + kv_rank * heads * (nope + v)
    down = h * q_rank + h * (kv_rank + rope)
    return AttentionShape(up + heads * v * h, down, q_rank + kv_rank, heads, nope + rope, v, "mla",
                          q_rank + kv_rank + rope, up)


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs per token of one layer: dense matmuls (attention projections, dense FFN or shared
    experts, router), attention core (QK^T and AV, causal) and routed experts (top_k of them)."""

    dense: float
    core: float
    expert: float

    @property
    def total(self) -> float:
        """All forward FLOPs per token."""
        return self.dense + self.core + self.expert


def layer_flops(cfg: ModelConfig, index: int, seq_len: int, causal: bool = True) -> LayerFlops:
    """Forward FLOPs per token of transformer block `index` (dense before first_k_dense, MoE after) over
    sequences of seq_len tokens; causal=False counts full attention (PaLM's and torchtitan's convention, for
    comparison only). The module docstring says what is counted and why."""
    attention = attention_shape(cfg)
    h = cfg.hidden_size
    swiglu = 3 * h * (cfg.dense_ffn_size if index < cfg.first_k_dense else cfg.expert_ffn_size)
    if index < cfg.first_k_dense:
        ffn, routed = swiglu, 0
    else:
        ffn, routed = cfg.num_shared_experts * swiglu + h * cfg.num_experts, cfg.top_k * swiglu
    keys = seq_len / 2 if causal else seq_len  # keys each query attends, on average
    core = 2 * attention.heads * (attention.qk_head_dim + attention.v_head_dim) * keys
    return LayerFlops(2.0 * (attention.sharded + attention.replicated + ffn), float(core), 2.0 * routed)


def model_layer_flops(cfg: ModelConfig, seq_len: int, causal: bool = True) -> list[LayerFlops]:
    """layer_flops of every layer, in order."""
    return [layer_flops(cfg, i, seq_len, causal) for i in range(cfg.num_layers)]


def head_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the LM head (the final norm is free)."""
    return 2.0 * cfg.padded_vocab_size * cfg.hidden_size


def mtp_flops(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Forward FLOPs per token of the MTP depths (moe.mtp): each one's eh_proj, block (the model's MoE kind) and
    output head; 0 without MTP."""
    block = layer_flops(cfg, cfg.num_layers if cfg.num_moe_layers else 0, seq_len, causal).total
    return cfg.mtp_depth * (block + 4.0 * cfg.hidden_size ** 2 + head_flops(cfg))


def flops_by_precision(cfg: ModelConfig, seq_len: int, causal: bool = True) -> tuple[float, float]:
    """Training FLOPs per token as (BF16, FP8): the routed experts' GEMMs run in FP8 (forward, dgrad and
    wgrad, kernels.fp8_grouped_linear) when cfg.expert_precision is "fp8"; everything else is BF16 math."""
    total = model_flops_per_token(cfg, seq_len, causal)
    if cfg.expert_precision != "fp8":
        return total, 0.0
    fp8 = 3.0 * sum(f.expert for f in model_layer_flops(cfg, seq_len, causal))
    return total - fp8, fp8


def expert_row_flops(cfg: ModelConfig) -> float:
    """Training FLOPs of one routed row through one expert (SwiGLU's three GEMMs: forward, dgrad and wgrad)."""
    return 3.0 * 2.0 * 3 * cfg.hidden_size * cfg.expert_ffn_size


def model_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs per token, the MFU numerator: 3 x (the layers' forward FLOPs + the LM head's)."""
    return 3.0 * (sum(f.total for f in model_layer_flops(cfg, seq_len, causal)) + head_flops(cfg))


def mixed_peak(cfg: ModelConfig, seq_len: int, bf16_peak: float, fp8_peak: float) -> float:
    """The peak FLOP/s per GPU MFU divides by: the rate at which a GPU running every GEMM at its precision's
    peak would do a token's training FLOPs, F / (F_bf16 / bf16_peak + F_fp8 / fp8_peak) (a time-weighted,
    harmonic mean of the two peaks). BF16 experts: bf16_peak itself."""
    bf16, fp8 = flops_by_precision(cfg, seq_len)
    return (bf16 + fp8) / (bf16 / bf16_peak + (fp8 / fp8_peak if fp8 else 0.0))
