"""Vocab padding (model.vocab_multiple): padded rows never predicted, the loss of the unpadded model; shapes by hand."""

from __future__ import annotations

import math

import pytest
import torch

from launch.plan.params import count_params
from moe.config import ModelConfig
from moe.model import MoETransformer

SHAPE = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, max_seq_len=16, dense_ffn_size=48,
             num_experts=4, expert_ffn_size=16, top_k=2, score_func="sigmoid", mtp_depth=1)


def test_padded_vocab_rounds_up():
    assert ModelConfig(vocab_size=500, vocab_multiple=64).padded_vocab_size == 512
    assert ModelConfig(vocab_size=512, vocab_multiple=64).padded_vocab_size == 512
    assert ModelConfig(vocab_size=500).padded_vocab_size == 500  # the default multiple 1 pads nothing
    with pytest.raises(ValueError, match="vocab_multiple = 0 must be an integer >= 1"):
        ModelConfig(vocab_multiple=0)


def test_padded_model_equals_unpadded_model():
    """vocab 500 padded to 512: with the unpadded model's weights (the padded rows random), logits of the 500 ids,
    the LM and MTP losses and the grads of the shared weights equal the unpadded model's; padded logits are -inf and
    their head rows get zero grads."""
    torch.manual_seed(0)
    plain = MoETransformer(ModelConfig(vocab_size=500, **SHAPE)).double()
    padded = MoETransformer(ModelConfig(vocab_size=500, vocab_multiple=64, **SHAPE)).double()
    assert padded.embed.weight.shape == (512, 32) and padded.lm_head.weight.shape == (512, 32)
    state = plain.state_dict()
    for key in ("embed.weight", "lm_head.weight"):
        state[key] = torch.cat((state[key], padded.state_dict()[key][500:]))
    padded.load_state_dict(state)
    tokens = torch.randint(0, 500, (2, 17), generator=torch.Generator().manual_seed(1))
    want = plain(tokens[:, :-1], tokens[:, 1:])
    got = padded(tokens[:, :-1], tokens[:, 1:])
    assert got.logits.shape == (2, 16, 512)
    torch.testing.assert_close(got.logits[..., :500], want.logits, rtol=0, atol=1e-14)  # GEMM blocking may differ
    assert (got.logits[..., 500:] == -math.inf).all()
    assert got.lm_loss.item() == pytest.approx(want.lm_loss.item(), rel=1e-12)
    assert got.mtp_losses[0].item() == pytest.approx(want.mtp_losses[0].item(), rel=1e-12)
    want.loss.backward()
    got.loss.backward()
    grads = dict(plain.named_parameters())
    for name, param in padded.named_parameters():
        if name in ("embed.weight", "lm_head.weight"):
            torch.testing.assert_close(param.grad[:500], grads[name].grad, rtol=0, atol=1e-13)
            assert not param.grad[500:].any(), name
        else:
            torch.testing.assert_close(param.grad, grads[name].grad, rtol=0, atol=1e-13)


def test_planner_counts_the_padded_vocab():
    plain = count_params(ModelConfig(vocab_size=500, **SHAPE))
    padded = count_params(ModelConfig(vocab_size=500, vocab_multiple=64, **SHAPE))
    assert padded.total.total - plain.total.total == 2 * 12 * 32  # 12 padded rows in the embedding and the head
    assert padded.embedding - plain.embedding == 12 * 32
