"""MoETransformer on a tiny config: loss at init, loss composition, gradients everywhere."""

from __future__ import annotations

import math

import torch

from moe.config import ModelConfig
from moe.model import MoETransformer


def tiny_model(**overrides) -> MoETransformer:
    """Two layers (one dense, one MoE) by default, with every router loss switched on."""
    torch.manual_seed(0)
    settings = dict(num_layers=2, aux_loss_coeff=0.01, seq_aux_loss_coeff=0.001, z_loss_coeff=0.001) | overrides
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, max_seq_len=16,
                      dense_ffn_size=48, num_experts=4, expert_ffn_size=16, top_k=2, score_func="sigmoid",
                      num_groups=2, topk_groups=1, **settings)
    return MoETransformer(cfg)


def test_forward_backward_at_init():
    model = tiny_model()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    out = model(tokens, labels=tokens.roll(-1, dims=1))
    assert out.logits.shape == (2, 16, 64)
    assert abs(out.lm_loss.item() - math.log(64)) < 0.05
    assert out.aux_loss.item() > 0
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss, atol=0, rtol=0)
    stats = out.moe_stats
    assert len(stats) == 1 and stats[0].tokens_per_expert.sum().item() == 2 * 16 * 2
    expected_aux = sum(c * stats[0].losses[n] for n, c in
                       (("load_balance", 0.01), ("seq_balance", 0.001), ("z", 0.001)))
    torch.testing.assert_close(out.aux_loss, expected_aux)
    out.loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_update_expert_bias_steps_each_moe_layer_with_its_own_load():
    model = tiny_model(num_layers=3, bias_update_rate=0.5)
    model.update_expert_bias([torch.tensor([6, 2, 0, 0]), torch.tensor([0, 0, 1, 7])])
    biases = [layer.router.expert_bias.tolist() for layer in model.moe_layers()]
    assert biases == [[-0.5, 0.0, 0.5, 0.5], [0.5, 0.5, 0.5, -0.5]]
