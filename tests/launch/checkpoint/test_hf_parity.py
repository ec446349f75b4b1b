"""Logits parity with transformers' DeepseekV3ForCausalLM (eager attention), both directions: a trained run's
checkpoint exported (ours -> Hugging Face), and a transformers random init saved with save_pretrained and read by
model.init_from (Hugging Face -> ours). In float64 (transformers' float32 upcasts patched to float64) to 1e-10; in
float32, unpatched, with the same top-k expert choices in every MoE layer and logits within 1e-5."""

from __future__ import annotations

import json

import pytest
import torch

from launch.checkpoint.checkpointer import checkpoint_folder, consolidate
from launch.checkpoint.hf.config import hub_config
from launch.checkpoint.hf.export import export_hub
from launch.train.materialize import fill_initial
from moe.config import ModelConfig
from moe.model import MoETransformer
from tests.launch.hf_helpers import (MODEL, hub_in_float64, hub_logits, load_hub, our_logits, ours_from_hub, tokens,
                                     trained_run)

pytest.importorskip("transformers")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A float64 run with MTP depth 1, trained 2 steps (router biases moved off zero), and its checkpoint."""
    return trained_run(tmp_path_factory.mktemp("hf_run"), "mla", steps=2)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """The run's checkpoint exported as a Hugging Face folder, in small shards."""
    return export_hub(checkpoint_folder(run[1]), tmp_path_factory.mktemp("hf_out") / "model", 40_000)


def _ours_from_checkpoint(cfg: ModelConfig, checkpoint, dtype: torch.dtype) -> MoETransformer:
    model = MoETransformer(cfg).to(dtype)
    model.load_state_dict(consolidate(checkpoint))
    return model.eval()


def _check_parity(ours, theirs, ids, dtype) -> None:
    want, want_choices = our_logits(ours, ids)
    got, got_choices = hub_logits(theirs, ids)
    assert got.dtype == dtype and len(got_choices) == len(want_choices) == 3
    for layer, (a, b) in enumerate(zip(got_choices, want_choices)):
        assert torch.equal(a, b), f"MoE layer {layer}: transformers routes to other experts"
    assert (got - want).abs().max().item() < TOLERANCE[dtype]
    assert want.abs().max().item() > 1e-3  # the logits are not trivially small


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_exported_run_has_the_same_logits_in_transformers(run, exported, dtype, monkeypatch):
    cfg, checkpoint = run
    if dtype == torch.float64:
        hub_in_float64(monkeypatch)
    ours = _ours_from_checkpoint(cfg.model, checkpoint, dtype)
    theirs = load_hub(exported, dtype)
    biases = [layer.mlp.gate.e_score_correction_bias for layer in theirs.model.layers[1:]]
    assert all(b.abs().sum() > 0 for b in biases)  # the trained router biases arrived
    assert theirs.config.routed_scaling_factor == 2.5 and theirs.config.n_group == 2
    _check_parity(ours, theirs, tokens(cfg.model), dtype)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """transformers' random init of the V3-shaped model (nonzero router biases), saved with save_pretrained in
    float64 and in float32."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = ModelConfig(**MODEL)
    hub = {k: v for k, v in hub_config(cfg, "float64").items() if k not in ("architectures", "dtype", "torch_dtype")}
    torch.manual_seed(1)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**hub)).double()
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
            for norm in (layer.input_layernorm, layer.self_attn.kv_a_layernorm):
                norm.weight.uniform_(0.5, 1.5)  # norms away from their ones init: a swapped name would show
    folders = {}
    for dtype in (torch.float64, torch.float32):
        folders[dtype] = tmp_path_factory.mktemp("hf_saved") / str(dtype)
        model.to(dtype).save_pretrained(folders[dtype])
    return cfg, folders


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_transformers_weights_start_our_model_with_its_logits(saved, dtype, monkeypatch):
    cfg, folders = saved
    assert json.loads((folders[dtype] / "config.json").read_text())["model_type"] == "deepseek_v3"
    if dtype == torch.float64:
        hub_in_float64(monkeypatch)
    theirs = load_hub(folders[dtype], dtype)
    ours = ours_from_hub(cfg, folders[dtype], dtype)
    _check_parity(ours, theirs, tokens(cfg, seed=1), dtype)


def test_mtp_depths_the_folder_lacks_start_from_the_seeded_values(saved):
    """save_pretrained writes no MTP weights: a run with MTP depth 1 reads the rest and draws those (moe.init)."""
    cfg, folders = saved
    with_mtp = ModelConfig(**{**cfg.__dict__, "mtp_depth": 1})
    got = ours_from_hub(with_mtp, folders[torch.float64], torch.float64).state_dict()
    seeded = MoETransformer(with_mtp).double()
    fill_initial(seeded, with_mtp, seed=0)
    plain = ours_from_hub(cfg, folders[torch.float64], torch.float64).state_dict()
    assert any(key.startswith("mtp.0.block.ffn.experts") for key in got)
    for key, value in seeded.state_dict().items():
        assert torch.equal(got[key], value if key.startswith("mtp.") else plain[key]), key


def test_a_padded_vocab_reads_and_writes_the_hub_s_vocab_size_rows(saved, monkeypatch):
    # model.vocab_multiple pads our embedding and head to 320 rows; the Hub's tensors keep the 256 real ones: import
    # fills those (padded rows zero), our logits equal transformers' on them (padded ids at -inf), and export writes
    # 256-row tensors transformers loads back
    from launch.checkpoint.hf.export import hub_tensors

    cfg, folders = saved
    hub_in_float64(monkeypatch)
    padded = ModelConfig(**{**cfg.__dict__, "vocab_multiple": 64 + 16})
    assert padded.padded_vocab_size == 320
    ours = ours_from_hub(padded, folders[torch.float64], torch.float64)
    assert ours.embed.weight.shape[0] == 320 and not ours.embed.weight[256:].any()
    ids = tokens(cfg, seed=2)
    want = load_hub(folders[torch.float64], torch.float64)(ids).logits
    got = ours(ids).logits
    assert torch.isinf(got[..., 256:]).all() and (got[..., :256] - want).abs().max().item() < 1e-10
    written = dict(hub_tensors(padded, "lm_head.weight", ours.lm_head.weight.detach()))
    assert written["lm_head.weight"].shape == (256, cfg.hidden_size)
    assert torch.equal(written["lm_head.weight"], ours.lm_head.weight[:256])
