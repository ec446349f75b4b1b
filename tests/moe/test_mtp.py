"""Multi-token prediction against a hand-written computation of DeepSeek-V3's MTP from the model's own parameters.

The reference shortens depth k's sequence to S - k positions (as V3 does); the model keeps S positions and drops the
last k positions' loss terms. Dropless routing with no balance losses: the MoE output of a token does not depend on
the others, so both give the same losses. The trainer's path (a Stage and its loss) is checked against the same
reference; mtp_depth = 0 leaves the model and its losses as they were.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from launch.parallel.stages import build_stages
from moe.config import ModelConfig
from moe.model import MoETransformer
from moe.rope import rope_tables

MLA = {"attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 8}


def model_of(depth: int, attention: dict, **extra) -> MoETransformer:
    """A float64 3-layer model (1 dense, 2 MoE) with mtp_depth depth, same seed for every depth."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1, max_seq_len=16,
                      dense_ffn_size=48, num_experts=4, expert_ffn_size=16, top_k=2, score_func="sigmoid",
                      mtp_depth=depth, mtp_loss_coeff=0.3, init_std=0.1, **(attention | extra))
    return MoETransformer(cfg).double()


def tokens_of(batch: int = 2, seq: int = 12) -> torch.Tensor:
    """Random token ids [batch, seq + 1]: inputs are [:, :-1], labels [:, 1:]."""
    return torch.randint(0, 64, (batch, seq + 1), generator=torch.Generator().manual_seed(3))


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_mtp_losses(model: MoETransformer, tokens: torch.Tensor) -> list[torch.Tensor]:
    """V3's MTP written out: depth k on positions 0..S-k-1 predicts token i + k + 1 from h^(k-1)_i and token i + k."""
    cfg, seq = model.cfg, tokens.shape[1] - 1
    cos, sin = rope_tables(seq, cfg.rope_dim, cfg.rope_theta, tokens.device)
    hidden = model.embed.weight[tokens[:, :seq]]
    for block in model.blocks:
        hidden, _ = block(hidden, cos, sin)
    losses = []
    for k, depth in enumerate(model.mtp, start=1):
        n = seq - k
        ahead = model.embed.weight[tokens[:, k:k + n]]
        joined = torch.cat((rms(hidden[:, :n], depth.hnorm.weight, cfg.norm_eps),
                            rms(ahead, depth.enorm.weight, cfg.norm_eps)), dim=-1)
        hidden, _ = depth.block(joined @ depth.eh_proj.weight.T, cos[:n], sin[:n])
        logits = rms(hidden, depth.head_norm.weight, cfg.norm_eps) @ model.lm_head.weight.T
        losses.append(F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1:k + 1 + n].flatten()))
    return losses


@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_losses_equal_the_reference(depth, attention):
    model = model_of(depth, MLA if attention == "mla" else {})
    tokens = tokens_of()
    want = reference_mtp_losses(model, tokens)
    out = model(tokens[:, :-1], tokens[:, 1:])
    assert len(out.mtp_losses) == depth
    for got, ref in zip(out.mtp_losses, want):
        assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    assert out.aux_loss.item() == 0  # no balance losses: the total is LM + 0.3 x the mean over depths
    assert out.loss.item() == pytest.approx(out.lm_loss.item() + 0.3 / depth * sum(r.item() for r in want), rel=1e-12)
    assert len(out.moe_stats) == 2 + depth  # the depths' MoE layers count after the model's

    stage = build_stages(model, tokens.shape[1] - 1, 1, [0])[0]  # the trainer's path: one stage, its criterion
    stage.reset_tallies()
    stage.loss_scale = 0.5
    logits, hidden = stage(tokens[:, :-1])
    loss, lm = stage.loss(logits, hidden, tokens[:, 1:])
    assert lm.item() == pytest.approx(0.5 * out.lm_loss.item(), rel=1e-12)
    assert loss.item() == pytest.approx(0.5 * out.loss.item(), rel=1e-12)
    assert stage.mtp_tally.tolist() == pytest.approx([0.5 * r.item() for r in want], rel=1e-12)
    assert sorted(stage.tallies) == [1, 2, *(3 + k for k in range(depth))]


def test_mtp_grads_reach_the_shared_embedding_and_head():
    """The MTP losses alone give the embedding, the output head and every MTP weight a grad."""
    model = model_of(1, MLA)
    tokens = tokens_of()
    out = model(tokens[:, :-1], tokens[:, 1:])
    out.mtp_losses[0].backward()
    for name, param in model.named_parameters():
        reached = param.grad is not None and param.grad.abs().sum() > 0
        assert reached == (name.startswith(("mtp.", "embed.", "lm_head.", "blocks."))
                           and not name.endswith("expert_bias") and name != "norm.weight"), name


def test_depth_zero_leaves_the_model_unchanged():
    """mtp_depth = 0: no MTP parameters, the stage returns logits only, and the main model's parameters and losses
    are bitwise those of the model whose MTP is on (MTP adds to the main path, never changes it)."""
    plain, with_mtp = model_of(0, MLA), model_of(2, MLA)
    assert plain.mtp is None and not any(name.startswith("mtp.") for name in plain.state_dict())
    main = {k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")}
    assert main.keys() == plain.state_dict().keys()
    assert all(torch.equal(v, main[k]) for k, v in plain.state_dict().items())
    tokens = tokens_of()
    a, b = plain(tokens[:, :-1], tokens[:, 1:]), with_mtp(tokens[:, :-1], tokens[:, 1:])
    assert torch.equal(a.logits, b.logits) and torch.equal(a.lm_loss, b.lm_loss)
    assert a.mtp_losses == [] and torch.equal(a.loss, a.lm_loss + a.aux_loss)
    stage = build_stages(plain, tokens.shape[1] - 1, 1, [0])[0]
    stage.reset_tallies()
    logits = stage(tokens[:, :-1])
    assert isinstance(logits, torch.Tensor) and torch.equal(logits, a.logits)
    loss, lm = stage.loss(logits, tokens[:, 1:])
    assert loss is lm and torch.equal(lm, a.lm_loss)


@pytest.mark.parametrize("fields, match", [({"mtp_depth": -1}, "mtp_depth = -1"),
                                           ({"mtp_depth": 1.5}, "mtp_depth = 1.5"),
                                           ({"mtp_depth": 1, "mtp_loss_coeff": 0.0}, "mtp_loss_coeff = 0.0"),
                                           ({"mtp_depth": 1, "mtp_loss_coeff": -0.3}, "mtp_loss_coeff = -0.3")])
def test_bad_mtp_fields_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**fields)
