"""[model]: the model's settings, each documented where it is defined, with field-level validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from dispatch.choices import check_choice

ScoreFunc = Literal["softmax", "sigmoid"]
DropPolicy = Literal["probs", "position"]
ExpertPrecision = Literal["native", "fp8"]
ActivationCache = Literal["native", "fp8"]
LinearPrecision = Literal["native", "fp8"]
Attention = Literal["gqa", "mla"]
MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # each >= 1 with MLA
SPLIT_HIDDEN = 0  # head_dim: hidden_size / num_heads
NO_QUERY_LATENT = 0  # q_lora_rank: queries projected directly, without a latent
UNSET = 0  # an MLA width a GQA model leaves out
SEEDED = ""  # init_from: no checkpoint, weights drawn from the seed


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
    """[model]: shape of a DeepSeek-style MoE decoder and its router and expert settings (the parallel layout:
    launch.config.sections)."""

    vocab_size: int = 256
    """Token ids the model reads and predicts: at least the tokenizer's vocabulary (data.tokenizer)."""
    vocab_multiple: int = 1
    """The embedding and the LM head hold vocab_size rounded up to a multiple of this, so TP ranks split them
    evenly; the padded rows' logits are masked (moe.vocab)."""
    hidden_size: int = 128
    """Width of the residual stream (the model dimension)."""
    num_layers: int = 4
    """Transformer blocks: first_k_dense dense ones, then MoE ones (MTP blocks not counted)."""
    num_heads: int = 4
    """Attention (query) heads of each block."""
    num_kv_heads: int = 2
    """GQA: key/value heads each group of num_heads / num_kv_heads query heads shares (MLA ignores it)."""
    head_dim: int = SPLIT_HIDDEN
    """GQA: width of one attention head; `SPLIT_HIDDEN`: hidden_size / num_heads (Qwen3: 128 with 64 heads of a
    4096-wide model). Must stay `SPLIT_HIDDEN` with MLA, whose head widths are the qk_* and v_head_dim keys."""
    max_seq_len: int = 256
    """Longest sequence the model takes, in tokens (train.seq_len may not exceed it)."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding's frequencies."""
    attention: Attention = "gqa"
    """Attention kind: "gqa" is grouped-query attention (moe.model.Attention), "mla" DeepSeek's multi-head latent
    attention (moe.mla.MLA)."""
    q_lora_rank: int | None = NO_QUERY_LATENT
    """MLA: width of the query latent; `NO_QUERY_LATENT` (or None, Hugging Face's spelling) projects the queries
    directly (DeepSeek-V2-Lite). Left out with GQA."""
    kv_lora_rank: int = UNSET
    """MLA: width of the joint key/value latent (DeepSeek-V3: 512); `UNSET` with GQA."""
    qk_nope_head_dim: int = UNSET
    """MLA: per-head query/key width without RoPE (DeepSeek-V3: 128); `UNSET` with GQA."""
    qk_rope_head_dim: int = UNSET
    """MLA: per-head query width with RoPE, and the width of the one RoPE key all heads share (DeepSeek-V3: 64;
    even); `UNSET` with GQA."""
    v_head_dim: int = UNSET
    """MLA: per-head value width (DeepSeek-V3: 128); `UNSET` with GQA."""
    norm_eps: float = 1e-6
    """Epsilon added to the mean square in every RMSNorm (block, final and MLA latent norms)."""
    first_k_dense: int = 1
    """Leading blocks with a dense SwiGLU FFN instead of experts (DeepSeek-V3: 3); at most num_layers."""
    dense_ffn_size: int = 384
    """Hidden width of the dense blocks' SwiGLU FFN."""
    num_experts: int = 8
    """Routed experts in each MoE block."""
    num_shared_experts: int = 1
    """Experts every token passes through besides its routed ones (one SwiGLU of num_shared_experts x
    expert_ffn_size); 0 for none."""
    expert_ffn_size: int = 96
    """Hidden width of one expert's SwiGLU FFN (routed and shared)."""
    top_k: int = 2
    """Routed experts each token is sent to (at most num_experts)."""
    score_func: ScoreFunc = "softmax"
    """How the router turns its logits into expert scores: "softmax" over the experts, or one "sigmoid" per expert
    (DeepSeek-V3)."""
    num_groups: int = 1
    """Groups the experts are split into for group-limited routing (must divide num_experts); 1: no groups."""
    topk_groups: int = 1
    """Groups each token may pick its experts from (the groups with the best sum of their top-2 scores); equal to
    num_groups for unlimited routing. With an EP group over several nodes, one group per node limits the nodes a
    token reaches (DeepSeek-V3: 8 groups, 4 kept)."""
    capacity_factor: float | None = None
    """Slots each expert keeps per batch, as a multiple of its fair share (tokens x top_k / num_experts, rounded
    up); the rest are dropped (drop_policy). None (leave the key out): dropless, every slot kept."""
    drop_policy: DropPolicy = "probs"
    """Which slots an expert over capacity keeps: "probs" the highest-scored, "position" the earliest tokens."""
    force_balance: bool = False
    """For measuring only (as Megatron-Core's --moe-router-force-load-balancing): token t's k slots go to experts
    (t x k + j) mod num_experts, a perfectly balanced routing, with their scores as weights; what a run with it
    gains over the real router is what balance would recover. false: the router chooses."""
    norm_topk: bool = True
    """Divide each token's top_k weights by their sum (DeepSeek-V3: true)."""
    route_scale: float = 1.0
    """Factor on the combine weights after norm_topk (DeepSeek-V3: 2.5)."""
    aux_loss_coeff: float = 0.0
    """Weight of the Switch load-balance loss over the batch; 0.0 leaves it out of the loss."""
    seq_aux_loss_coeff: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss (per sequence, then averaged); 0.0 leaves it out."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss (mean squared log-sum-exp of the logits); 0.0 leaves it out."""
    bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3: 0.001): after each step every expert's routing bias moves by this
    much against the sign of its load's excess over the mean; 0.0: the bias stays zero."""
    expert_precision: ExpertPrecision = "native"
    """The routed experts' GEMMs: "native" in the run's dtype (train.dtype), "fp8" as e4m3 with 1x128 activation
    and 128x128 weight scales (Triton kernels on GPUs with FP8 tensor cores, a torch reference on CPU)."""
    activation_cache: ActivationCache = "native"
    """How the SwiGLUs (routed, shared and dense) keep their activations for backward: "native" as autograd does,
    in the run's dtype, with each token's routing weights applied in combine; "fp8" DeepSeek-V3's low-precision
    storage (report section 3.3.2): a SwiGLU keeps only its input gate|up, as e4m3 in 1x128 tiles with fp32 scales,
    and rebuilds silu(gate) * up (and the down projection's input) from it in backward, and an expert row's routing
    weight scales that product before the down projection, so combine is a plain sum that keeps no expert output.
    Meaningful with either expert_precision and any train.dtype (the cache rounds to e4m3 whatever the GEMMs use)."""
    linear_precision: LinearPrecision = "native"
    """Every other linear's GEMMs (MLA's q_a, q_b or q, kv_a, kv_b and out; GQA's qkv and out; the dense and shared
    experts' SwiGLU; MTP's eh_proj; not the embedding, the LM head, the router's gate, the norms or the attention
    core): "native" in the run's dtype, "fp8" with Fprop, Dgrad and Wgrad as e4m3 in the experts' 1x128 activation
    tiles and 128x128 weight blocks (kernels.FP8Linear), each linear keeping its input's e4m3 tiles for backward.
    Independent of expert_precision."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation (output projections: init_std / sqrt(2 x num_layers))."""
    mtp_depth: int = 0
    """Multi-token prediction modules, each predicting one token further ahead (moe.mtp; DeepSeek-V3: 1); 0: none."""
    mtp_loss_coeff: float = 0.3
    """Weight of the MTP losses' mean over the depths in the loss (DeepSeek-V3: 0.3, later 0.1); > 0 with
    mtp_depth."""
    init_from: str = SEEDED
    """A Hugging Face DeepSeek-V3 folder of this very model whose weights start the run (launch.checkpoint.hf;
    relative to the config file); `SEEDED`: every weight drawn from train.seed."""

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
            self.q_lora_rank = NO_QUERY_LATENT
        if self.attention == "mla":
            self._check_mla()
        else:
            self._check_gqa()
        if self.first_k_dense > self.num_layers:
            raise ValueError(f"first_k_dense = {self.first_k_dense} must be <= num_layers = {self.num_layers}")
        check_router_settings(self.num_experts, self.top_k, self.score_func, self.num_groups,
                              self.topk_groups, self.capacity_factor, self.drop_policy)
        check_choice("expert_precision", self.expert_precision, ExpertPrecision)
        check_choice("activation_cache", self.activation_cache, ActivationCache)
        check_choice("linear_precision", self.linear_precision, LinearPrecision)
        check_positive("mtp_depth", self.mtp_depth, minimum=0)
        if self.mtp_depth and (isinstance(self.mtp_loss_coeff, bool) or not isinstance(self.mtp_loss_coeff, (int, float))
                               or not 0 < self.mtp_loss_coeff < math.inf):
            raise ValueError(f"mtp_loss_coeff = {self.mtp_loss_coeff!r} must be a finite number > 0 with mtp_depth = "
                             f"{self.mtp_depth} (DeepSeek-V3: 0.3, then 0.1)")

    def _check_gqa(self) -> None:
        """Heads split hidden_size evenly into even (RoPE) widths and share KV heads evenly; no MLA widths set."""
        for name, unset in {"q_lora_rank": NO_QUERY_LATENT, **dict.fromkeys(MLA_DIMS, UNSET)}.items():
            if getattr(self, name) != unset:
                raise ValueError(f"{name} = {getattr(self, name)!r} is an MLA width: set attention = 'mla', "
                                 f"or leave {name} out ({unset}) with attention = 'gqa'")
        if self.head_dim == SPLIT_HIDDEN and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size = {self.hidden_size} must be divisible by num_heads = {self.num_heads} "
                             f"(or set head_dim)")
        if self.attention_head_dim % 2:
            raise ValueError(f"head size (head_dim, or hidden_size/num_heads) = {self.attention_head_dim} must be even "
                             f"for RoPE")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads = {self.num_heads} must be divisible by num_kv_heads = {self.num_kv_heads}")

    def _check_mla(self) -> None:
        """Every MLA width given (q_lora_rank may be 0), the RoPE width even; no GQA-only head_dim."""
        if self.head_dim != SPLIT_HIDDEN:
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
        """Width of one attention head: head_dim, or hidden_size / num_heads when head_dim is SPLIT_HIDDEN."""
        return self.hidden_size // self.num_heads if self.head_dim == SPLIT_HIDDEN else self.head_dim

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
