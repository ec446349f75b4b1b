"""Parameter counts of a ModelConfig (GQA or MLA attention, as model.attention builds it): per layer, per stage,
per rank, activated."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from launch.metrics.flops import AttentionShape, attention_shape
from moe.config import ModelConfig


@dataclass(frozen=True)
class Params:
    """Parameter counts of a part of the model, split by how the layout distributes them."""

    sharded: int = 0     # dense params split over TP (attention/FFN/shared-expert matrices, vocab)
    replicated: int = 0  # dense params each TP rank holds whole (norms, router, MLA down-projections)
    expert: int = 0      # routed-expert params (split over EP)
    activated: int = 0   # params one token's forward uses (top_k of the routed experts; not the embedding lookup)

    def __add__(self, other: Params) -> Params:
        return Params(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __mul__(self, times: int) -> Params:
        return Params(*(getattr(self, f.name) * times for f in fields(self)))

    @property
    def dense(self) -> int:
        """Non-expert params."""
        return self.sharded + self.replicated

    @property
    def total(self) -> int:
        """All params."""
        return self.dense + self.expert

    def on_rank(self, tp: int, ep: int) -> tuple[float, float]:
        """(dense, expert) params one rank holds of this part under TP tp and EP ep."""
        return self.sharded / tp + self.replicated, self.expert / ep


def swiglu(hidden: int, ffn: int) -> int:
    """Weights of a SwiGLU MLP (gate, up, down)."""
    return 3 * hidden * ffn


def layer_params(cfg: ModelConfig, index: int, attention: AttentionShape) -> Params:
    """Params of transformer block `index` (dense before first_k_dense, MoE after)."""
    h = cfg.hidden_size
    norms = attention.norms + 2 * h
    attn = Params(attention.sharded, attention.replicated + norms, 0, attention.sharded + attention.replicated + norms)
    if index < cfg.first_k_dense:
        ffn = swiglu(h, cfg.dense_ffn_size)
        return attn + Params(ffn, 0, 0, ffn)
    expert = swiglu(h, cfg.expert_ffn_size)
    shared = cfg.num_shared_experts * expert
    router = cfg.num_experts * h
    return attn + Params(shared, router, cfg.num_experts * expert, shared + router + cfg.top_k * expert)


def embedding_params(cfg: ModelConfig) -> Params:
    """Input embedding over the padded vocab (model.vocab_multiple): vocab-parallel, a lookup (not activated)."""
    return Params(cfg.padded_vocab_size * cfg.hidden_size)


def head_params(cfg: ModelConfig) -> Params:
    """Final norm and LM head (over the padded vocab: its padded rows are computed too)."""
    head = cfg.padded_vocab_size * cfg.hidden_size
    return Params(head, cfg.hidden_size, 0, head + cfg.hidden_size)


def mtp_params(cfg: ModelConfig, attention: AttentionShape) -> Params:
    """The MTP depths' own params (moe.mtp: hnorm, enorm, eh_proj, a block of the model's MoE kind, head_norm); the
    embedding and output head they use are the model's, counted there."""
    h = cfg.hidden_size
    depth = layer_params(cfg, cfg.num_layers if cfg.num_moe_layers else 0, attention) + Params(0, 3 * h + 2 * h * h)
    return depth * cfg.mtp_depth


@dataclass(frozen=True)
class ModelParams:
    """Counts of the main model (total) and of each pipeline stage (the last holding the MTP depths, mtp)."""

    total: Params
    stages: list[Params]
    embedding: int
    attention: AttentionShape
    mtp: Params = Params()

    @property
    def activated(self) -> int:
        """Params one token's forward uses (input embedding lookup excluded)."""
        return self.total.activated

    @property
    def activated_with_embedding(self) -> int:
        """Activated params with the input embedding table counted too."""
        return self.total.activated + self.embedding


def count_params(cfg: ModelConfig, stages: Sequence[range] | None = None) -> ModelParams:
    """Parameter counts of cfg, whole and per pipeline stage (stages: each one's layers; default one stage)."""
    attention = attention_shape(cfg)
    layers = [layer_params(cfg, i, attention) for i in range(cfg.num_layers)]
    counts = [sum((layers[i] for i in span), Params()) for span in (stages or [range(cfg.num_layers)])]
    counts[0] = counts[0] + embedding_params(cfg)
    counts[-1] = counts[-1] + head_params(cfg)
    mtp = mtp_params(cfg, attention)
    total = sum(counts, Params())
    counts[-1] = counts[-1] + mtp
    return ModelParams(total, counts, cfg.padded_vocab_size * cfg.hidden_size, attention, mtp)
