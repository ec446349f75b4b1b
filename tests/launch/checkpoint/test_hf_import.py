"""model.init_from = HF_FOLDER: refusals before any process starts (each naming its field), and every layout starting
from the folder's weights as the single process does (each rank reading only its pieces)."""

from __future__ import annotations

import json

import pytest

from launch.parallel.spawn import run_processes
from launch.checkpoint.checkpointer import checkpoint_folder, consolidate
from launch.config.run import build_config
from launch.checkpoint.hf.config import hub_config
from launch.checkpoint.hf.export import INDEX, export_hub
from launch.train.loop import train
from launch.train_cli import main
from launch.train.preflight import check_run
from moe.config import ModelConfig
from tests.launch.hf_helpers import MODEL
from tests.launch.train.test_equivalence import calc_diff, raw_config

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_import") / "text.txt"
    path.write_text("".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(800)))
    return str(path)


def _raw(run_dir, corpus: str, init_from: str, parallel: dict | None = None, steps: int = 1) -> dict:
    raw = raw_config(str(run_dir), corpus, parallel or {}, None, "mla", mtp_depth=1)
    raw["model"].update(MODEL, init_from=init_from)
    raw["train"].update(steps=steps, checkpoint_every=steps, grad_accum_steps=4)  # DualPipeV pp2: 4 chunks or more
    return raw


def _folder(tmp_path, **changes) -> str:
    """A folder whose config.json is the test model's, changed; its index names every tensor (no weights needed
    for the checks before spawning)."""
    cfg = ModelConfig(**MODEL, mtp_depth=1)
    hub = {**hub_config(cfg, "float64"), **changes}
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hub))
    return str(folder)


REFUSED = {  # config.json change -> what the error names
    "rope_scaling": ({"rope_scaling": {"type": "yarn", "factor": 40.0}}, "rope_scaling = "),
    "rope_parameters yarn": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
                             "rope_parameters = "),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
    "topk_method": ({"topk_method": "greedy"}, "topk_method = 'greedy' is not supported"),
    "tie_word_embeddings": ({"tie_word_embeddings": True}, "tie_word_embeddings = True is not supported"),
    "attention_bias": ({"attention_bias": True}, "attention_bias = True is not supported"),
    "scoring_func": ({"scoring_func": "softmax"}, "scoring_func = 'softmax' is not supported"),
    "rope_interleave": ({"rope_interleave": False}, "rope_interleave = False is not supported"),
    "rms_norm_eps": ({"rms_norm_eps": 1e-5}, "rms_norm_eps = 1e-05 is not supported"),
    "kv heads": ({"num_key_value_heads": 2}, "num_key_value_heads = 2 must equal num_attention_heads"),
    "shape": ({"hidden_size": 64}, "model.hidden_size = 32 differs from"),
    "experts": ({"n_routed_experts": 16}, "model.num_experts = 8 differs from"),
    "scaling factor": ({"routed_scaling_factor": 1.0}, "model.route_scale = 2.5 differs from"),
    "architecture": ({"model_type": "qwen3_moe"}, "model_type = 'qwen3_moe' is not supported"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_hub_config_is_refused_naming_the_field(case, corpus, tmp_path):
    changes, message = REFUSED[case]
    cfg = build_config(_raw(tmp_path / "run", corpus, _folder(tmp_path, **changes)))
    with pytest.raises(ValueError, match="config.json|model\\.") as error:
        check_run(cfg)
    assert message in str(error.value)


def test_cli_check_refuses_rope_scaling(corpus, tmp_path, capsys):
    folder = _folder(tmp_path, rope_scaling={"type": "yarn", "factor": 40.0})
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\ninit_from = "hf"\n[data]\ncorpus = "{corpus}"\n')  # relative to the config file
    assert main(["--config", str(config), "--check"]) == 2
    err = capsys.readouterr().err
    assert f"{folder}/config.json: rope_scaling = " in err and "allowed: null or rope_type 'default'" in err


def test_missing_folder_and_missing_tensor_are_refused(corpus, tmp_path):
    cfg = build_config(_raw(tmp_path / "run", corpus, str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="model.init_from = .*nowhere.*no config.json"):
        check_run(cfg)
    folder = _folder(tmp_path)
    (tmp_path / "hf" / INDEX).write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "a.safetensors"}}))
    lacking = "lacks tensor 'model.layers.0.input_layernorm.weight' \\(model tensor 'blocks.0.attn_norm.weight'\\)"
    with pytest.raises(ValueError, match=lacking):
        check_run(build_config(_raw(tmp_path / "run", corpus, folder)))


@pytest.mark.parametrize("field", ["n_group", "model_type"])
def test_config_without_a_needed_field_is_refused(field, corpus, tmp_path):
    folder = _folder(tmp_path)
    hub = json.loads((tmp_path / "hf" / "config.json").read_text())
    del hub[field]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hub))
    message = "config.json has no n_group" if field == "n_group" else "model_type = None is not supported"
    with pytest.raises(ValueError, match=message):
        check_run(build_config(_raw(tmp_path / "run", corpus, folder)))


def test_gqa_model_cannot_start_from_a_v3_folder(corpus, tmp_path):
    raw = raw_config(str(tmp_path / "run"), corpus, {}, None, "gqa")
    raw["model"].update(score_func="sigmoid", init_from=_folder(tmp_path))
    with pytest.raises(ValueError, match="model.attention = 'gqa'"):
        check_run(build_config(raw))


LAYOUTS = {"tp2 ep2 sp": {"tp": 2, "ep": 2, "sequence_parallel": True},
           "pp2 dualpipev": {"pp": 2, "schedule": "dualpipev"}}


def _train_all(rank: int, world: int, raws: list[dict]) -> list[list[dict]]:
    return [train(build_config(raw), progress=False) for raw in raws]


def test_layouts_start_from_the_folder_as_one_process(corpus, tmp_path):
    """A run's export starts new runs (MTP weights included): 2-rank TP x EP and DualPipeV layouts, each rank
    reading its TP shards, experts and stages, train as the single process does (first-step loss, which the
    initial weights alone decide, and losses and parameters after 2 steps); the seeded start differs."""
    source = build_config(_raw(tmp_path / "source", corpus, ""))
    train(source, progress=False)
    folder = str(export_hub(checkpoint_folder(tmp_path / "source" / "checkpoint"), tmp_path / "hf", 50_000))
    one = build_config(_raw(tmp_path / "one", corpus, folder, steps=2))
    check_run(one)  # the folder is accepted before spawning
    want = train(one, progress=False)
    seeded = train(build_config(_raw(tmp_path / "seeded", corpus, "", steps=1)), progress=False)
    assert abs(seeded[0]["loss"] - want[0]["loss"]) > 1e-3
    raws = [_raw(tmp_path / name.replace(" ", "_"), corpus, folder, parallel, steps=2)
            for name, parallel in LAYOUTS.items()]
    results = run_processes(_train_all, 2, raws, timeout_s=300)[0]
    want_state = consolidate(tmp_path / "one" / "checkpoint")
    for name, raw, records in zip(LAYOUTS, raws, results):
        for got, expected in zip(records, want):
            for key in ("loss", "lm_loss", "mtp_loss_1"):
                assert got[key] == pytest.approx(expected[key], rel=1e-10), (name, got["step"], key)
        state = consolidate(f"{raw['train']['run_dir']}/checkpoint")
        assert set(state) == set(want_state)
        for key, value in want_state.items():
            if value.is_floating_point() and value.abs().sum() > 0:
                assert calc_diff(state[key], value) < 1e-12, (name, key)
