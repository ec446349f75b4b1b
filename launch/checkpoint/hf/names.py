"""Our single-process tensor keys <-> the Hugging Face Hub's DeepSeek-V3 safetensors names.

A key (launch.parallel.placement: a MoETransformer state-dict name, '.E' appended for routed expert E) maps to Parts: blocks
of our tensor along one dim, each a block of one Hub tensor. Most keys are one whole Hub tensor; a fused SwiGLU
gate_up is the Hub's gate_proj then up_proj rows; MTP's eh_proj takes [hnorm(h), enorm(emb)] here and
[enorm(emb), hnorm(h)] in V3's released weights (as vLLM's DeepSeek MTP reads them), so its column halves swap.
MTP depth d (mtp.{d-1}) is Hub layer num_layers + d - 1; V3 stores the shared embedding and head there too
(embed_tokens, shared_head.head), which export writes as extra copies and import does not read.
No rows are permuted for RoPE: both sides rotate interleaved pairs of the rope dims (config.json rope_interleave
true); transformers' V3 leaves the rotated dims of queries and keys alike de-interleaved, which keeps every score.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moe.config import ModelConfig


@dataclass(frozen=True)
class Part:
    """Our tensor's rows [start, start + length) along dim are rows [hub_start, ...) along dim of Hub tensor name."""

    name: str
    dim: int = 0
    start: int = 0
    length: int | None = None  # None: the whole tensor along dim
    hub_start: int = 0


BLOCK = {  # our block-local name -> the Hub's decoder-layer-local name(s), fused rows in order
    "attn_norm.weight": ("input_layernorm.weight",),
    "ffn_norm.weight": ("post_attention_layernorm.weight",),
    "attn.q.weight": ("self_attn.q_proj.weight",),
    "attn.q_a.weight": ("self_attn.q_a_proj.weight",),
    "attn.q_a_norm.weight": ("self_attn.q_a_layernorm.weight",),
    "attn.q_b.weight": ("self_attn.q_b_proj.weight",),
    "attn.kv_a.weight": ("self_attn.kv_a_proj_with_mqa.weight",),
    "attn.kv_a_norm.weight": ("self_attn.kv_a_layernorm.weight",),
    "attn.kv_b.weight": ("self_attn.kv_b_proj.weight",),
    "attn.out.weight": ("self_attn.o_proj.weight",),
    "ffn.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "ffn.down.weight": ("mlp.down_proj.weight",),
    "ffn.router.weight": ("mlp.gate.weight",),
    "ffn.router.expert_bias": ("mlp.gate.e_score_correction_bias",),
    "ffn.shared.gate_up.weight": ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
    "ffn.shared.down.weight": ("mlp.shared_experts.down_proj.weight",),
}
EXPERT = {"w_gate_up": ("gate_proj.weight", "up_proj.weight"), "w_down": ("down_proj.weight",)}
MTP_OWN = {"hnorm.weight": "hnorm.weight", "enorm.weight": "enorm.weight",
           "head_norm.weight": "shared_head.norm.weight"}
EXPERT_NAME = re.compile(r"^ffn\.experts\.(w_gate_up|w_down)\.(\d+)$")


def _rows(names: tuple[str, ...], rows: int) -> list[Part]:
    """Parts of a tensor of `rows` rows fused from equal row blocks of the Hub tensors names."""
    if len(names) == 1:
        return [Part(names[0])]
    size = rows // len(names)
    return [Part(name, 0, i * size, size) for i, name in enumerate(names)]


def _block_parts(prefix: str, local: str, rows: int) -> list[Part]:
    """Parts of block-local key local in Hub decoder layer prefix ('model.layers.N.')."""
    match = EXPERT_NAME.match(local)
    if match:
        return _rows(tuple(f"{prefix}mlp.experts.{match.group(2)}.{n}" for n in EXPERT[match.group(1)]), rows)
    if local not in BLOCK:
        raise KeyError(local)
    return _rows(tuple(prefix + n for n in BLOCK[local]), rows)


def _vocab_part(cfg: ModelConfig, key: str, name: str) -> Part:
    """The whole Hub tensor name, or for the embedding and head of a padded vocab (model.vocab_multiple) their
    first vocab_size rows: the Hub's tensors hold vocab_size rows (moe.vocab)."""
    padded = key in ("embed.weight", "lm_head.weight") and cfg.padded_vocab_size != cfg.vocab_size
    return Part(name, 0, 0, cfg.vocab_size) if padded else Part(name)


def hub_parts(cfg: ModelConfig, key: str, rows: int) -> list[Part]:
    """Where our key (a tensor of `rows` rows along dim 0) is stored in the Hub's layout (import reads these)."""
    try:
        return _hub_parts(cfg, key, rows)
    except KeyError:
        raise ValueError(f"model tensor {key!r} has no DeepSeek-V3 (Hugging Face) name") from None


def _hub_parts(cfg: ModelConfig, key: str, rows: int) -> list[Part]:
    top = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
    if key in top:
        return [_vocab_part(cfg, key, top[key])]
    head, _, rest = key.partition(".")
    index, _, local = rest.partition(".")
    if head == "blocks" and index.isdigit():
        return _block_parts(f"model.layers.{index}.", local, rows)
    if head != "mtp" or not index.isdigit():
        raise KeyError(key)
    prefix = f"model.layers.{cfg.num_layers + int(index)}."
    if local in MTP_OWN:
        return [Part(prefix + MTP_OWN[local])]
    if local == "eh_proj.weight":
        hidden = cfg.hidden_size
        name = prefix + "eh_proj.weight"
        return [Part(name, 1, 0, hidden, hidden), Part(name, 1, hidden, hidden, 0)]
    if local.startswith("block."):
        return _block_parts(prefix, local.removeprefix("block."), rows)
    raise KeyError(key)


def hub_names(cfg: ModelConfig, key: str) -> list[str]:
    """The Hub tensors our key is read from."""
    return [part.name for part in hub_parts(cfg, key, 0)]


def export_parts(cfg: ModelConfig, key: str, rows: int) -> list[Part]:
    """hub_parts plus the copies V3's checkpoint keeps in each MTP layer (its embedding and output head)."""
    copies = {"embed.weight": "embed_tokens.weight", "lm_head.weight": "shared_head.head.weight"}
    extra = ([_vocab_part(cfg, key, f"model.layers.{cfg.num_layers + d}.{copies[key]}") for d in range(cfg.mtp_depth)]
             if key in copies else [])
    return hub_parts(cfg, key, rows) + extra
