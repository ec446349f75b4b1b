"""ModelConfig <-> a Hugging Face DeepseekV3Config (config.json): the fields each side sets, and what is refused.

Refused on export (naming our field): GQA attention (V3 is MLA), softmax scores (V3's router is sigmoid with
"noaux_tc" bias-corrected top-k), a capacity limit (V3 is dropless), norm_eps other than 1e-6 (transformers'
V3 fixes its latent norms' eps at 1e-6). Refused on import (naming the config.json field): anything the model
cannot compute the same way (RoPE scaling, another activation, attention biases, tied embeddings, ...).
"""

from __future__ import annotations

from moe.config import ModelConfig

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3Attention builds q_a_layernorm and kv_a_layernorm with this eps

# config.json field -> our ModelConfig field (the shape fields both sides must agree on)
SHARED = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "dense_ffn_size",
    "moe_intermediate_size": "expert_ffn_size", "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
    "n_routed_experts": "num_experts", "n_shared_experts": "num_shared_experts", "num_experts_per_tok": "top_k",
    "n_group": "num_groups", "topk_group": "topk_groups", "routed_scaling_factor": "route_scale",
    "first_k_dense_replace": "first_k_dense", "norm_topk_prob": "norm_topk", "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank", "qk_rope_head_dim": "qk_rope_head_dim", "qk_nope_head_dim": "qk_nope_head_dim",
    "v_head_dim": "v_head_dim", "rope_theta": "rope_theta", "rms_norm_eps": "norm_eps",
}
# config.json field -> (the only value we can honour, why); each is transformers' default where config.json omits it
FIXED = {
    "model_type": ("deepseek_v3", "the folder must hold a DeepSeek-V3 model"),
    "hidden_act": ("silu", "the experts and MLPs are SwiGLU"),
    "scoring_func": ("sigmoid", "the router scores are sigmoids"),
    "topk_method": ("noaux_tc", "top-k on bias-corrected scores within the best groups"),
    "tie_word_embeddings": (False, "the embedding and LM head are separate tensors"),
    "attention_bias": (False, "the attention projections have no biases"),
    "rope_interleave": (True, "RoPE rotates interleaved pairs (DeepSeek's layout)"),
    "rms_norm_eps": (LATENT_NORM_EPS, "transformers' V3 latent norms use 1e-6, the model one eps for every norm"),
}


def _refuse_export(cfg: ModelConfig) -> None:
    """Raise ValueError naming the model field a DeepSeek-V3 export cannot carry."""
    if cfg.attention != "mla":
        raise ValueError(f"model.attention = {cfg.attention!r} cannot be exported as DeepSeek-V3, whose attention is "
                         f"MLA (allowed: 'mla'); no Hugging Face MoE architecture is chosen for GQA models")
    if cfg.score_func != "sigmoid":
        raise ValueError(f"model.score_func = {cfg.score_func!r} is not DeepSeek-V3's router (allowed: 'sigmoid')")
    if cfg.capacity_factor is not None:
        raise ValueError(f"model.capacity_factor = {cfg.capacity_factor!r}: DeepSeek-V3 routes dropless "
                         f"(allowed: none)")
    if cfg.norm_eps != LATENT_NORM_EPS:
        raise ValueError(f"model.norm_eps = {cfg.norm_eps!r}: transformers' DeepSeek-V3 fixes its latent norms' eps "
                         f"at 1e-6 (allowed: 1e-6)")


def hub_config(cfg: ModelConfig, dtype: str, eos_id: int | None = None) -> dict:
    """config.json of a DeepseekV3ForCausalLM with cfg's shape, weights stored in dtype (e.g. 'float32'), the
    tokenizer's end-of-document id eos_id (None: unknown); the data path adds no BOS token."""
    _refuse_export(cfg)
    out: dict = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    out.update({hub: getattr(cfg, ours) for hub, ours in SHARED.items()})
    out.update({name: value for name, (value, _) in FIXED.items()})
    out.update(q_lora_rank=cfg.q_lora_rank or None, num_key_value_heads=cfg.num_heads,
               max_position_embeddings=cfg.max_seq_len, initializer_range=cfg.init_std,
               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, rope_scaling=None,
               num_nextn_predict_layers=cfg.mtp_depth, dtype=dtype, torch_dtype=dtype, use_cache=True,
               bos_token_id=None, eos_token_id=eos_id)
    return out


def _rope_type(hub: dict) -> object:
    """The RoPE scaling a config.json asks for (rope_scaling, or 5.x's rope_parameters): None or 'default' is plain."""
    for field in ("rope_scaling", "rope_parameters"):
        spec = hub.get(field)
        if isinstance(spec, dict) and spec.get("rope_type", spec.get("type", "default")) not in (None, "default"):
            return field, spec
    return None


def check_hub_config(cfg: ModelConfig, hub: dict, where: str) -> None:
    """Raise ValueError naming the field unless cfg's model is the one config.json `hub` (of folder `where`) describes
    and the model computes it as transformers' DeepseekV3ForCausalLM does."""
    for field, (value, why) in FIXED.items():
        got = hub.get(field) if field == "model_type" else hub.get(field, value)
        if got != value:
            raise ValueError(f"{where}/config.json: {field} = {got!r} is not supported ({why}; allowed: {value!r})")
    scaled = _rope_type(hub)
    if scaled is not None:
        raise ValueError(f"{where}/config.json: {scaled[0]} = {scaled[1]!r} is not supported (the model's RoPE has no "
                         f"scaling; allowed: null or rope_type 'default')")
    kv_heads = hub.get("num_key_value_heads") or hub.get("num_attention_heads")
    if kv_heads != hub.get("num_attention_heads"):
        raise ValueError(f"{where}/config.json: num_key_value_heads = {kv_heads!r} must equal num_attention_heads "
                         f"= {hub.get('num_attention_heads')!r} (MLA gives every head its own key and value)")
    if cfg.attention != "mla":
        raise ValueError(f"model.attention = {cfg.attention!r}: a DeepSeek-V3 folder holds MLA weights "
                         f"(allowed: 'mla')")
    if cfg.score_func != "sigmoid":
        raise ValueError(f"model.score_func = {cfg.score_func!r}: a DeepSeek-V3 router scores with sigmoids "
                         f"(allowed: 'sigmoid')")
    for field, ours in SHARED.items():
        theirs = _hub_value(hub, field, where)
        mine = getattr(cfg, ours)
        if field == "q_lora_rank":
            theirs = theirs or 0
        if theirs != mine:
            raise ValueError(f"model.{ours} = {mine!r} differs from {where}/config.json {field} = {theirs!r} "
                             f"(model.init_from needs the same model)")


def _hub_value(hub: dict, field: str, where: str) -> object:
    """A config.json field's value (rope_theta also from 5.x's rope_parameters); a shape field must be there."""
    if field == "rope_theta" and field not in hub and isinstance(hub.get("rope_parameters"), dict):
        return hub["rope_parameters"].get("rope_theta")
    if field not in hub:
        raise ValueError(f"{where}/config.json has no {field} (model.init_from needs every shape field: "
                         f"{', '.join(SHARED)})")
    return hub[field]
