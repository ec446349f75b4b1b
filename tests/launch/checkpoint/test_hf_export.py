"""`moe-train export ... --format hf`: the folder's files and names, streaming (memory about one shard), the round trip
back through model.init_from (MTP included), tokenizer files, and refusals before anything is written."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from safetensors import safe_open

import launch.checkpoint.hf.export as hf_export
from launch.checkpoint.checkpointer import checkpoint_folder, consolidate
from launch.checkpoint.hf.config import hub_config
from launch.checkpoint.hf.export import INDEX, copy_tokenizer, export_hub
from launch.train_cli import main
from moe.config import ModelConfig
from tests.launch.hf_helpers import MODEL, ours_from_hub, trained_run

SHARD = 70_000  # bytes: above the largest tensor (the embedding, 64 KiB); the float64 model (~0.95 MB) takes 14+


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 1-step float64 MLA run with MTP depth 1 and its checkpoint."""
    return trained_run(tmp_path_factory.mktemp("hf_export"), "mla")


def test_cli_writes_the_hub_layout(run, tmp_path, capsys):
    cfg, checkpoint = run
    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(out), "--format", "hf", "--max-shard-bytes", str(SHARD)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    hub = json.loads((out / "config.json").read_text())
    want = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 32,
            "intermediate_size": 48, "moe_intermediate_size": 16, "n_routed_experts": 8, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "q_lora_rank": 24, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
            "rms_norm_eps": 1e-6, "vocab_size": 256, "max_position_embeddings": 16, "num_nextn_predict_layers": 1,
            "tie_word_embeddings": False, "num_hidden_layers": 4, "hidden_act": "silu", "eos_token_id": 0,
            "bos_token_id": None}
    assert {k: hub[k] for k in want} == want
    index = json.loads((out / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 5 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, INDEX, "config.json"])  # no tokenizer: bytes
    names = set(index["weight_map"])
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.3.mlp.experts.7.down_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
                 "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                 "model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.hnorm.weight",
                 "model.layers.4.shared_head.norm.weight", "model.layers.4.shared_head.head.weight",
                 "model.layers.4.embed_tokens.weight", "model.layers.4.mlp.experts.0.gate_proj.weight",
                 "model.norm.weight", "lm_head.weight"):
        assert name in names, name
    state = consolidate(checkpoint)
    sizes = 0
    for file in files:
        with safe_open(str(out / file), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                sizes += tensor.numel() * tensor.element_size()
                if name == "model.layers.3.mlp.experts.5.up_proj.weight":
                    assert torch.equal(tensor, state["blocks.3.ffn.experts.w_gate_up"][5, 16:])
                if name == "model.layers.4.embed_tokens.weight":
                    assert torch.equal(tensor, state["embed.weight"])
    assert sizes == index["metadata"]["total_size"]


def test_export_holds_about_one_shard(run, tmp_path, monkeypatch):
    """The tensors read from the checkpoint that are still alive (weak references), and the shards handed to
    safetensors, never exceed one shard plus one tensor, while the model is many shards."""
    cfg, checkpoint = run
    live: dict[int, int] = {}
    peak = [0, 0, 0]  # live bytes, largest shard written, largest tensor read
    read = hf_export.read_tensor

    def tracked(reader, key):
        tensor = read(reader, key)
        size = tensor.numel() * tensor.element_size()
        live[id(tensor)] = size
        weakref.finalize(tensor, live.pop, id(tensor), None)
        peak[0], peak[2] = max(peak[0], sum(live.values())), max(peak[2], size)
        return tensor

    save = hf_export.save_file

    def measured(tensors, path, metadata=None):
        peak[1] = max(peak[1], sum(t.numel() * t.element_size() for t in tensors.values()))
        return save(tensors, path, metadata=metadata)

    monkeypatch.setattr(hf_export, "read_tensor", tracked)
    monkeypatch.setattr(hf_export, "save_file", measured)
    out = export_hub(checkpoint_folder(checkpoint), tmp_path / "hf", SHARD)
    total = json.loads((out / INDEX).read_text())["metadata"]["total_size"]
    assert total > 13 * SHARD
    assert peak[1] <= SHARD
    assert peak[0] <= SHARD + peak[2], (peak, total)


def test_round_trip_through_init_from_is_exact(run, tmp_path):
    """Export, then model.init_from of the folder: every tensor (MTP's included) comes back bitwise."""
    cfg, checkpoint = run
    out = export_hub(checkpoint_folder(checkpoint), tmp_path / "hf", SHARD)
    got = ours_from_hub(cfg.model, out, torch.float64).state_dict()
    want = consolidate(checkpoint)
    assert set(got) == set(want) and any(k.startswith("mtp.0.") for k in want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_mtp_projection_takes_v3_input_order(run, tmp_path):
    """V3's released MTP weights (as vLLM reads them) project [enorm(embedding), hnorm(hidden)]; ours
    [hnorm(hidden), enorm(embedding)]: the exported eh_proj on V3's order equals ours on ours."""
    cfg, checkpoint = run
    out = export_hub(checkpoint_folder(checkpoint), tmp_path / "hf", 10**9)
    with safe_open(str(out / "model-00001-of-00001.safetensors"), framework="pt") as handle:
        theirs = handle.get_tensor("model.layers.4.eh_proj.weight")
    ours = consolidate(checkpoint)["mtp.0.eh_proj.weight"]
    hidden, embedded = torch.randn(5, 32, dtype=torch.float64), torch.randn(5, 32, dtype=torch.float64)
    want = torch.cat((hidden, embedded), -1) @ ours.T
    assert torch.allclose(torch.cat((embedded, hidden), -1) @ theirs.T, want, rtol=0, atol=1e-12)
    assert not torch.allclose(torch.cat((hidden, embedded), -1) @ theirs.T, want, rtol=0, atol=1e-3)


def test_tokenizer_files_are_copied(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"model": 1}')
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    out = tmp_path / "out"
    out.mkdir()
    assert copy_tokenizer(str(folder), out) == ["tokenizer.json", "tokenizer_config.json"]
    assert (out / "tokenizer_config.json").read_text() == '{"eos_token": "<|endoftext|>"}'
    single = tmp_path / "single"
    single.mkdir()
    assert copy_tokenizer(str(folder / "tokenizer.json"), single) == ["tokenizer.json"]
    assert (single / "tokenizer.json").read_text() == '{"model": 1}'
    assert copy_tokenizer("bytes", single) == []


@pytest.mark.parametrize("change, message", [
    ({"attention": "gqa", "q_lora_rank": 0, "kv_lora_rank": 0, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0,
      "v_head_dim": 0}, "model.attention = 'gqa'"),
    ({"score_func": "softmax"}, "model.score_func = 'softmax' is not DeepSeek-V3's router (allowed: 'sigmoid')"),
    ({"capacity_factor": 1.25}, "model.capacity_factor = 1.25: DeepSeek-V3 routes dropless"),
    ({"norm_eps": 1e-5}, "model.norm_eps = 1e-05: transformers' DeepSeek-V3 fixes its latent norms' eps"),
])
def test_models_v3_cannot_describe_are_refused(change, message):
    with pytest.raises(ValueError) as error:
        hub_config(ModelConfig(**{**MODEL, **change}), "float32")
    assert message in str(error.value)


def test_gqa_model_is_refused_before_writing(tmp_path, capsys):
    _, checkpoint = trained_run(tmp_path, "gqa", score_func="sigmoid")
    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(out), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert "model.attention = 'gqa'" in err and "allowed: 'mla'" in err
    assert not out.exists() and not list(tmp_path.glob(".hf.tmp*"))
