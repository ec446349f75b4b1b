"""Bad data inputs are refused before any process starts (`moe-train --check` and a plain `moe-train` exit 2
naming the field, the trainer is never called, nothing is written): tokenizer vs model.vocab_size, prepared
sources (missing, unfinished, another tokenizer, a corrupted or truncated shard), blend weights, eval sources."""

from __future__ import annotations

import math

import numpy as np
import pytest

from launch.config.run import load_config
from launch.data.shards import MANIFEST
from launch.train_cli import main
from tests.launch.data_helpers import SHIPPED_TOKENIZER, make_source, tagged_source

MODEL = {"vocab_size": 256, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "max_seq_len": 16,
         "dense_ffn_size": 48, "num_experts": 8, "expert_ffn_size": 16, "top_k": 2}


def toml(value: object) -> str:
    """value in TOML syntax (inline tables and arrays included)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, str):
        return '"' + value + '"'
    return repr(value).lower() if isinstance(value, bool) else repr(value)


@pytest.fixture
def folders(tmp_path):
    """{name: path} of prepared sources (byte tokens): a, b, c good; corrupt (a byte flipped), truncated,
    unfinished (manifest says so), empty (no manifest)."""
    paths = {name: tagged_source(tmp_path / name, k % 4, 3000) for k, name in
             enumerate(("a", "b", "c", "corrupt", "truncated", "unfinished"))}
    shard = paths["corrupt"] / "00000.tokens"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    shard = paths["truncated"] / "00000.tokens"
    shard.write_bytes(shard.read_bytes()[:-2])
    manifest = paths["unfinished"] / MANIFEST
    manifest.write_text(manifest.read_text().replace('"complete": true', '"complete": false'))
    (tmp_path / "empty").mkdir()
    paths["empty"] = tmp_path / "empty"
    return {name: str(path) for name, path in paths.items()}


def run_check(tmp_path, model: dict, data: dict, capsys, launch_refuses: bool = True) -> str:
    """moe-train with and without --check on this [model]/[data]: both exit 2; their shared message. Unless
    launch_refuses, only --check refuses (it reads every shard); a launch goes on to the ranks, which check the
    shards they open (tests/launch/data/test_verified_reads.py)."""
    sections = {"model": {**MODEL, **model}, "data": data,
                "train": {"steps": 2, "micro_batch_size": 2, "seq_len": 16, "run_dir": str(tmp_path / "run")}}
    path = tmp_path / "run.toml"
    path.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in values.items())
                            for s, values in sections.items()))
    errors = []
    for flags in (["--check"], []) if launch_refuses else (["--check"],):
        assert main(["--config", str(path), "--no-progress", *flags], trainer=never_called) == 2
        errors.append(capsys.readouterr().err)
    assert errors[0] == errors[-1] and "invalid config" in errors[0]
    assert not (tmp_path / "run").exists()  # nothing written
    if not launch_refuses:
        launched = []
        assert main(["--config", str(path), "--no-progress"], trainer=lambda *a, **k: launched.append(1) or []) == 0
        assert launched
    return errors[0]


def never_called(*args, **kwargs):
    raise AssertionError("the trainer was called for a bad data input")


def sources(*names_weights, folders):
    return [{"path": folders[n], "weight": w} for n, w in names_weights]


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused_naming_both(tmp_path, capsys):
    err = run_check(tmp_path, {"vocab_size": 300}, {"tokenizer": str(SHIPPED_TOKENIZER)}, capsys)
    assert "model.vocab_size = 300" in err and "(512 ids)" in err and "data.tokenizer" in err
    err = run_check(tmp_path, {"vocab_size": 200}, {}, capsys)  # the byte tokenizer needs 256
    assert "model.vocab_size = 200" in err and "(256 ids)" in err and "'bytes'" in err


@pytest.mark.parametrize("name, data, wanted", [
    ("another tokenizer", {"tokenizer": "SHIPPED", "sources": [("a", 1.0)]},
     ["data.sources[0].path", "not by the configured data.tokenizer"]),
    ("weight zero", {"sources": [("a", 1.0), ("b", 0.0)]}, ["data.sources[1].weight = 0.0", "> 0"]),
    ("weight negative", {"sources": [("a", -1)]}, ["data.sources[0].weight = -1"]),
    ("weight nan", {"sources": [("a", float("nan"))]}, ["data.sources[0].weight = nan"]),
    ("weight text", {"sources": [("a", "1")]}, ["data.sources[0].weight = '1'"]),
    ("eval overlaps training", {"sources": [("a", 1.0), ("b", 1.0)], "eval_sources": ["b"]},
     ["data.eval_sources[0].path", "data.sources[1]"]),
    ("eval without sources", {"eval_sources": ["b"]}, ["data.eval_sources needs data.sources"]),
    ("missing path", {"sources": [{"weight": 1.0}]}, ["data.sources[0].path is missing"]),
    ("missing weight", {"sources": [("a", 1.0), {"path": "b"}]}, ["data.sources[1].weight is missing"]),
    ("unknown key", {"sources": [{"path": "a", "weight": 1.0, "wieght": 2.0}]}, ["data.sources[0].wieght"]),
    ("not a table", {"sources": ["a"]}, ["data.sources[0]"]),
    ("no such folder", {"sources": [("nowhere", 1.0)]}, ["data.sources[0].path", "no such folder"]),
    ("no manifest", {"sources": [("empty", 1.0)]}, ["data.sources[0].path", "no prepared dataset"]),
    ("unfinished", {"sources": [("unfinished", 1.0)]}, ["data.sources[0].path", "has not finished"]),
    ("corrupted shard", {"sources": [("a", 1.0)], "eval_sources": ["corrupt"]},
     ["data.eval_sources[0].path", "corrupt/00000.tokens is corrupted"]),
    ("truncated shard", {"sources": [("truncated", 1.0)]}, ["truncated/00000.tokens", "wrong size"]),
    ("missing tokenizer", {"tokenizer": "nowhere.json"}, ["data.tokenizer", "nowhere.json"]),
    ("prefetch", {"prefetch_steps": -1}, ["data.prefetch_steps"]),
], ids=lambda case: case if isinstance(case, str) else "")
def test_bad_data_inputs_are_refused_naming_the_field(name, data, wanted, tmp_path, folders, capsys):
    folders = {**folders, "nowhere": str(tmp_path / "nowhere")}
    resolved = dict(data)
    for key in ("sources", "eval_sources"):
        entries = []
        for entry in data.get(key, []):
            if isinstance(entry, tuple):
                entry = {"path": folders[entry[0]], "weight": entry[1]}
            elif isinstance(entry, dict) and "path" in entry:
                entry = {**entry, "path": folders[entry["path"]]}
            elif key == "eval_sources":
                entry = {"path": folders[entry]}
            entries.append(entry)
        if key in data:
            resolved[key] = entries
    if resolved.get("tokenizer") == "SHIPPED":
        resolved["tokenizer"] = str(SHIPPED_TOKENIZER)
    err = run_check(tmp_path, {"vocab_size": 512} if "tokenizer" in data else {}, resolved, capsys,
                    launch_refuses=name != "corrupted shard")
    for text in wanted:
        assert text in err, err


def test_good_sources_pass_and_paths_are_relative_to_the_config_file(tmp_path, folders, capsys):
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "run.toml"
    path.write_text(f'[model]\nvocab_size = 512\n[train]\nrun_dir = "{tmp_path / "run"}"\n'
                    f'[data]\ntokenizer = "../tok.json"\nsources = [{{path = "../a", weight = 2}}, '
                    f'{{path = "{folders["b"]}", weight = 0.5}}]\neval_sources = [{{path = "../c"}}]\n')
    (tmp_path / "tok.json").write_bytes(SHIPPED_TOKENIZER.read_bytes())
    cfg = load_config(path)
    assert cfg.data.tokenizer == str(tmp_path / "configs" / ".." / "tok.json")
    assert [s["path"] for s in cfg.data.sources] == [str(tmp_path / "configs" / ".." / "a"), folders["b"]]
    assert main(["--config", str(path), "--check"]) == 2  # the sources hold byte tokens, not the BPE's
    assert "data.sources[0].path" in capsys.readouterr().err
    path.write_text(path.read_text().replace('tokenizer = "../tok.json"', 'tokenizer = "bytes"'))
    assert main(["--config", str(path), "--check"]) == 0


def test_a_source_too_small_for_a_row_is_refused(tmp_path, capsys):
    small = make_source(tmp_path / "small", [np.arange(1, 10)])
    err = run_check(tmp_path, {}, {"sources": [{"path": str(small), "weight": 1.0}]}, capsys)
    assert "data.sources[0].path" in err and "fewer than one row" in err
