"""Name-seeded initial values: the rules match the modules' own constructors, draws depend on the key only."""

import math
from dataclasses import replace

import pytest
import torch

from moe.config import ModelConfig
from moe.init import init_rule, initial_value
from moe.model import MoETransformer

CFG = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, first_k_dense=1, dense_ffn_size=128,
                  num_experts=8, expert_ffn_size=64, top_k=2, init_std=0.05)
MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
CONFIGS = {"gqa": CFG, "mla": replace(CFG, **MLA, q_lora_rank=32),
           "mla without query latent": replace(CFG, **MLA, q_lora_rank=None)}


@pytest.mark.parametrize("attention", list(CONFIGS))
def test_rules_give_what_each_constructor_draws(attention):
    torch.manual_seed(0)
    cfg = CONFIGS[attention]
    model = MoETransformer(cfg)
    names = dict(model.named_parameters()) | dict(model.named_buffers())
    assert len(names) > 20
    for name, tensor in names.items():
        kind, std = init_rule(cfg, name)
        if kind == "ones":
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        elif kind == "zeros":
            assert torch.equal(tensor, torch.zeros_like(tensor)), name
        else:  # the constructor's empirical std within 10% of the rule's (every tensor has >= 512 values)
            assert tensor.numel() >= 512 and tensor.std().item() == pytest.approx(std, rel=0.1), name
    out_std = CFG.init_std / math.sqrt(2 * CFG.num_layers)
    assert init_rule(CFG, "blocks.2.ffn.experts.w_down") == ("normal", out_std)
    assert init_rule(CFG, "blocks.2.ffn.router.weight") == ("normal", CFG.init_std)


def test_draws_follow_the_key_alone():
    cpu = torch.device("cpu")
    a = initial_value(CFG, "blocks.1.ffn.experts.w_down", "blocks.1.ffn.experts.w_down.3", (64, 64), 7, cpu)
    again = initial_value(CFG, "blocks.1.ffn.experts.w_down", "blocks.1.ffn.experts.w_down.3", (64, 64), 7, cpu)
    other_expert = initial_value(CFG, "blocks.1.ffn.experts.w_down", "blocks.1.ffn.experts.w_down.4", (64, 64), 7, cpu)
    other_seed = initial_value(CFG, "blocks.1.ffn.experts.w_down", "blocks.1.ffn.experts.w_down.3", (64, 64), 8, cpu)
    assert torch.equal(a, again)
    assert not torch.equal(a, other_expert) and not torch.equal(a, other_seed)


def test_a_tensor_without_a_rule_is_refused():
    with pytest.raises(ValueError, match="no initialisation rule for model tensor 'blocks.0.attn.bias'"):
        init_rule(CFG, "blocks.0.attn.bias")
