"""Model configuration with field-level validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from dispatch.choices import check_choice

ScoreFunc = Literal["softmax", "sigmoid"]
DropPolicy = Literal["probs", "position"]
ExpertPrecision = Literal["native", "fp8"]
Attention = Literal["gqa", "mla"]
MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # each >= 1 with MLA


def check_positive(name: str, value: object, minimum: int = 1) -> None:
    """Raise ValueError naming the field unless value is an int >= minimum."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} = {value!r} must be an integer >= {minimum}")


def check_router_settings(num_experts: int, top_k: int, score_func: ScoreFunc, num_groups: int,
                          topk_groups: int, capacity_factor: float | None, drop_policy: DropPolicy) -> None:
    """Validate the router's settings, naming the offending field and the allowed values."""
    check_positive("num_experts", num_experts)
    check_positive("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k = {top_k} must be <= num_experts = {num_experts}")
    check_choice("score_func", score_func, ScoreFunc)
    check_positive("num_groups", num_groups)
    check_positive("topk_groups", topk_groups)
    if num_experts % num_groups:
        raise ValueError(f"num_experts = {num_experts} must be divisible by num_groups = {num_groups}")
    if topk_groups > num_groups:
        raise ValueError(f"topk_groups = {topk_groups} must be <= num_groups = {num_groups}")
    if topk_groups * (num_experts // num_groups) < top_k:
        raise ValueError(f"topk_groups = {topk_groups} groups of {num_experts // num_groups} experts "
                         f"cannot hold top_k = {top_k} experts")
    if capacity_factor is not None and (isinstance(capacity_factor, bool)
                                        or not isinstance(capacity_factor, (int, float))
                                        or not 0 < capacity_factor < math.inf):
        raise ValueError(f"capacity_factor = {capacity_factor!r} must be > 0 and finite, or None for dropless")
    check_choice("drop_policy", drop_policy, DropPolicy)


@dataclass
class ModelConfig:
    """Shape of a DeepSeek-style MoE decoder and its router and expert settings (parallel layout: launch.config.run)."""

    vocab_size: int = 256
    vocab_multiple: int = 1  # the embedding and LM head hold vocab_size rounded up to a multiple of this (moe.vocab)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA only
    head_dim: int = 0  # GQA: width of one attention head; 0: hidden_size / num_heads (Qwen3: 128 with 64 heads of hidden 4096)
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    attention: Attention = "gqa"    # "gqa": moe.model.Attention; "mla": multi-head latent attention (moe.mla.MLA)
    q_lora_rank: int | None = 0  # MLA: query latent width; 0 or None: a plain query projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0     # MLA: width of the joint key/value latent
    qk_nope_head_dim: int = 0  # MLA: per-head query/key width without RoPE
    qk_rope_head_dim: int = 0  # MLA: per-head query width with RoPE, and of the one RoPE key all heads share
    v_head_dim: int = 0       # MLA: per-head value width
    norm_eps: float = 1e-6
    first_k_dense: int = 1
    dense_ffn_size: int = 384
    num_experts: int = 8
    num_shared_experts: int = 1
    expert_ffn_size: int = 96
    top_k: int = 2
    score_func: ScoreFunc = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    capacity_factor: float | None = None
    drop_policy: DropPolicy = "probs"
    norm_topk: bool = True
    route_scale: float = 1.0
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    bias_update_rate: float = 0.0
    expert_precision: ExpertPrecision = "native"
    init_std: float = 0.02
    mtp_depth: int = 0        # multi-token prediction modules (moe.mtp, DeepSeek-V3: 1); 0: off
    mtp_loss_coeff: float = 0.3  # weight of the MTP losses' mean over depths (V3: 0.3, later 0.1)
    init_from: str = ""  # a Hugging Face DeepSeek-V3 folder whose weights start the run (launch.checkpoint.hf); "": seeded

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_seq_len", "dense_ffn_size", "expert_ffn_size"):
            check_positive(name, getattr(self, name))
        check_positive("vocab_multiple", self.vocab_multiple)
        check_positive("first_k_dense", self.first_k_dense, minimum=0)
        check_positive("num_shared_experts", self.num_shared_experts, minimum=0)
        check_positive("head_dim", self.head_dim, minimum=0)
        check_choice("attention", self.attention, Attention)
        if self.q_lora_rank is None:  # Hugging Face's spelling of "no query latent"
            self.q_lora_rank = 0
        if self.attention == "mla":
            self._check_mla()
        else:
            self._check_gqa()
        if self.first_k_dense > self.num_layers:
            raise ValueError(f"first_k_dense = {self.first_k_dense} must be <= num_layers = {self.num_layers}")
        check_router_settings(self.num_experts, self.top_k, self.score_func, self.num_groups,
                              self.topk_groups, self.capacity_factor, self.drop_policy)
        check_choice("expert_precision", self.expert_precision, ExpertPrecision)
        check_positive("mtp_depth", self.mtp_depth, minimum=0)
        if self.mtp_depth and (isinstance(self.mtp_loss_coeff, bool) or not isinstance(self.mtp_loss_coeff, (int, float))
                               or not 0 < self.mtp_loss_coeff < math.inf):
            raise ValueError(f"mtp_loss_coeff = {self.mtp_loss_coeff!r} must be a finite number > 0 with mtp_depth = "
                             f"{self.mtp_depth} (DeepSeek-V3: 0.3, then 0.1)")

    def _check_gqa(self) -> None:
        """Heads split hidden_size evenly into even (RoPE) widths and share KV heads evenly; no MLA widths set."""
        for name in ("q_lora_rank", *MLA_DIMS):
            if getattr(self, name):
                raise ValueError(f"{name} = {getattr(self, name)!r} is an MLA width: set attention = 'mla', "
                                 f"or leave {name} out (0) with attention = 'gqa'")
        if not self.head_dim and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size = {self.hidden_size} must be divisible by num_heads = {self.num_heads} "
                             f"(or set head_dim)")
        if self.attention_head_dim % 2:
            raise ValueError(f"head size (head_dim, or hidden_size/num_heads) = {self.attention_head_dim} must be even "
                             f"for RoPE")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads = {self.num_heads} must be divisible by num_kv_heads = {self.num_kv_heads}")

    def _check_mla(self) -> None:
        """Every MLA width given (q_lora_rank may be 0), the RoPE width even; no GQA-only head_dim."""
        if self.head_dim:
            raise ValueError(f"head_dim = {self.head_dim} is a GQA width: with attention = 'mla' the head widths are "
                             f"qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
        check_positive("q_lora_rank", self.q_lora_rank, minimum=0)
        for name in MLA_DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} = {value!r} must be an integer >= 1 with attention = 'mla' "
                                 f"(DeepSeek-V3: kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, "
                                 f"v_head_dim 128)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim = {self.qk_rope_head_dim} must be even (RoPE rotates pairs of dims)")

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the LM head: vocab_size rounded up to a multiple of vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def rope_dim(self) -> int:
        """Per-head width RoPE rotates: MLA's qk_rope_head_dim, or GQA's whole head (attention_head_dim)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.attention_head_dim

    @property
    def attention_head_dim(self) -> int:
        """Width of one attention head: head_dim, or hidden_size / num_heads when head_dim is 0."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def num_moe_layers(self) -> int:
        """Number of MoE layers (the layers after the first_k_dense dense ones)."""
        return self.num_layers - self.first_k_dense

    @property
    def num_routed_layers(self) -> int:
        """MoE layers counted in the routing statistics: the model's, then each MTP depth's block when it is an MoE
        block (as the model's layers after the dense ones are)."""
        return self.num_moe_layers + (self.mtp_depth if self.num_moe_layers else 0)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of all fields, for config-file validation."""
        return tuple(f.name for f in fields(cls))
