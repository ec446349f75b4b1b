"""moe-plan parameter counts: against the model the trainer builds, DeepSeek-V3's published figures, stage splits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch.config.run import load_config
from launch.plan.params import count_params
from launch.plan.planner import Machine, make_plan
from launch.plan.presets import GPUS
from launch.metrics.records import model_flops_per_token as dashboard_flops_per_token
from moe.layer import MoELayer
from launch.parallel.stages import build_stages
from moe.model import MoETransformer

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


MLA = ["model.attention=mla", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
       "model.v_head_dim=16"]


@pytest.mark.parametrize("overrides", [[], [*MLA, "model.q_lora_rank=48"], MLA],
                         ids=["gqa", "mla", "mla without query latent"])
def test_counts_equal_the_parameters_of_the_model_the_trainer_builds(overrides):
    cfg = load_config(CONFIGS / "tiny.toml", overrides).model
    with torch.device("meta"):
        model = MoETransformer(cfg)
    counts = count_params(cfg, [range(0, 2), range(2, 4)])
    assert counts.total.total == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for layer in model.moe_layers() for p in layer.experts.parameters())
    assert counts.total.expert == experts
    first = model.embed.weight.numel() + sum(p.numel() for b in model.blocks[:2] for p in b.parameters())
    assert counts.stages[0].total == first


def test_activated_counts_top_k_of_the_routed_experts_only():
    cfg = load_config(CONFIGS / "tiny.toml").model
    with torch.device("meta"):
        layer = MoELayer(cfg)
    counts = count_params(cfg)
    per_expert = layer.experts.w_gate_up[0].numel() + layer.experts.w_down[0].numel()
    idle = (cfg.num_experts - cfg.top_k) * per_expert * cfg.num_moe_layers
    assert counts.activated == counts.total.total - idle - cfg.vocab_size * cfg.hidden_size


def test_deepseek_v3_has_671b_params_and_37b_activated():
    cfg = load_config(CONFIGS / "deepseek-v3.toml").model
    with torch.device("meta"):  # the model the config builds: 671B parameters without storage
        model = MoETransformer(cfg)
    counts = count_params(cfg)
    assert counts.total.total == sum(p.numel() for name, p in model.named_parameters() if not name.startswith("mtp."))
    assert counts.mtp.total == sum(p.numel() for name, p in model.named_parameters() if name.startswith("mtp."))
    assert counts.total.total == pytest.approx(671e9, rel=0.01)
    # the MTP module's own weights (its embedding and head are the model's): V3's 14B of MTP weights less the
    # 0.9B embedding and 0.9B head it shares, ~11.5B (an MoE layer, MLA, 3 norms and a 14336 x 7168 projection)
    assert counts.mtp.total == pytest.approx(11.5e9, rel=0.02)
    # README_WEIGHTS.md of DeepSeek-V3: 36.7B activated in the main model; the report rounds it to 37B
    assert counts.activated == pytest.approx(36.7e9, rel=0.01)
    assert round(counts.activated / 1e9) == 37
    # the MoE part alone: 58 layers x (256 routed + 1 shared experts of 3 x 7168 x 2048) + routers
    assert counts.total.expert == 58 * 256 * 3 * 7168 * 2048


def test_deepseek_v3_counted_as_gqa_overcounts_attention():
    mla = load_config(CONFIGS / "deepseek-v3.toml")
    mha = load_config(CONFIGS / "deepseek-v3.toml", ["model.attention=gqa", "model.num_kv_heads=128",
                                                      *(f"model.{name}=0" for name in ("q_lora_rank", "kv_lora_rank",
                                                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))])
    # 128 heads of 56 (MHA, q/k/v/out 7168 x 7168 each) against MLA's 187_107_328 weights and latent norm scales
    assert count_params(mha.model).total.total - count_params(mla.model).total.total == \
        61 * (4 * 7168 * 7168 - 187_107_328)


def test_flops_per_token_match_the_dashboard_for_gqa():
    config = load_config(CONFIGS / "tiny.toml")
    plan = make_plan(config, Machine(GPUS["h100"], 8), timed=False)
    assert plan.flops_per_token == dashboard_flops_per_token(config.model, config.train.seq_len)


@pytest.mark.parametrize("pp, schedule", [(2, "1f1b"), (3, "1f1b"), (2, "dualpipev"), (4, "dualpipe")])
def test_each_rank_holds_the_params_of_the_stages_the_trainer_builds(pp, schedule):
    config = load_config(CONFIGS / "tiny.toml", [f"parallel.pp={pp}", "parallel.dp=1", "parallel.ep=1",
                                                  f'parallel.schedule="{schedule}"', "train.grad_accum_steps=8"])
    plan = make_plan(config, Machine(GPUS["h100"], 8), timed=False)
    with torch.device("meta"):
        model = MoETransformer(config.model)
    num_stages = config.parallel.num_stages
    for rank in plan.ranks:
        stages = build_stages(model, config.train.seq_len, num_stages, rank.stages)
        named = [(n, p) for stage in stages for n, p in stage.named_parameters()]
        assert rank.expert_params == sum(p.numel() for n, p in named if ".experts." in n)
        assert rank.dense_params == sum(p.numel() for n, p in named if ".experts." not in n)


def test_a_head_width_apart_from_hidden_over_heads_is_built_and_counted():
    cfg = load_config(CONFIGS / "tiny.toml", ["model.head_dim=48"]).model  # 4 heads x 48 = 192 wide, hidden 128
    model = MoETransformer(cfg)
    assert model.blocks[0].attn.qkv.weight.shape == (8 * 48, 128) and model.blocks[0].attn.out.weight.shape == (128, 192)
    assert count_params(cfg).total.total == sum(p.numel() for p in model.parameters())
    logits = model(torch.randint(0, cfg.vocab_size, (2, 16))).logits
    assert logits.shape == (2, 16, cfg.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="head size .* = 7 must be even"):
        load_config(CONFIGS / "tiny.toml", ["model.head_dim=7"])


@pytest.mark.parametrize("config, total, activated", [
    ("qwen3-235b-a22b.toml", 235e9, 22e9),  # Qwen3 technical report: 235B total, 22B activated
    ("mixtral-8x22b.toml", 141e9, 39e9),    # Mistral's announcement: 141B total, 39B active
    ("qwen3-30b-a3b.toml", 30.5e9, 3.3e9),  # Qwen3 model card: 30.5B total, 3.3B activated
])
def test_calibration_models_have_their_published_sizes(config, total, activated):
    counts = count_params(load_config(CONFIGS / config).model)
    assert counts.total.total == pytest.approx(total, rel=0.01)
    assert counts.activated_with_embedding == pytest.approx(activated, rel=0.03)
