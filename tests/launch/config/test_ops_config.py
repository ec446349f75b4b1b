"""Malformed configs are refused before any process starts: `moe-train --check` and a plain `moe-train`
exit 2 with the field in the message, and the trainer is never called."""

from __future__ import annotations

import pytest
import torch

from launch.train_cli import main

MODEL = {"hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "max_seq_len": 16,
         "dense_ffn_size": 48, "num_experts": 8, "expert_ffn_size": 16, "top_k": 2}

# (name, changes as {section: {key: value}} or a raw top-level key, text the error must contain)
CASES = [
    ("unknown section", {"trian": {"steps": 3}}, "[trian]"),
    ("unknown key", {"train": {"stepz": 3}}, "train.stepz"),
    ("unknown ops key", {"ops": {"keep": 2}}, "ops.keep"),
    ("wrong type", {"train": {"steps": "10"}}, "train.steps"),
    ("bool for int", {"parallel": {"dp": True}}, "parallel.dp"),
    ("steps zero", {"train": {"steps": 0}}, "train.steps"),
    ("micro batch zero", {"train": {"micro_batch_size": 0}}, "train.micro_batch_size"),
    ("rank metrics every zero", {"train": {"rank_metrics_every": 0}}, "train.rank_metrics_every"),
    ("negative lr", {"train": {"lr": -1.0}}, "train.lr"),
    ("nan lr", {"train": {"lr": float("nan")}}, "train.lr"),
    ("inf grad clip", {"train": {"grad_clip": float("inf")}}, "train.grad_clip"),
    ("beta1 one", {"train": {"beta1": 1.0}}, "train.beta1"),
    ("beta2 negative", {"train": {"beta2": -0.1}}, "train.beta2"),
    ("weight decay negative", {"train": {"weight_decay": -0.1}}, "train.weight_decay"),
    ("dtype", {"train": {"dtype": "float16"}}, "train.dtype"),
    ("min lr ratio", {"train": {"min_lr_ratio": 2.0}}, "train.min_lr_ratio"),
    ("seq_len over max", {"train": {"seq_len": 64}}, "train.seq_len"),
    ("accum not multiple of dp", {"train": {"grad_accum_steps": 3}, "parallel": {"dp": 2}},
     "train.grad_accum_steps"),
    ("run dir is a file", {"train": {"run_dir": "{tmp}/corpus.txt"}}, "train.run_dir"),
    ("run dir under a file", {"train": {"run_dir": "{tmp}/corpus.txt/run"}}, "train.run_dir"),
    ("missing corpus", {"data": {"corpus": "{tmp}/nowhere"}}, "data.corpus"),
    ("corpus folder without text", {"data": {"corpus": "{tmp}/empty"}}, "data.corpus"),
    ("corpus smaller than a batch", {"data": {"corpus": "{tmp}/small.txt"}}, "data.corpus"),
    ("eval fraction", {"data": {"eval_fraction": 0.7}}, "data.eval_fraction"),
    ("max bytes", {"data": {"max_bytes": 0}}, "data.max_bytes"),
    ("pp without schedule", {"parallel": {"pp": 2}}, "parallel.schedule"),
    ("unknown schedule", {"parallel": {"pp": 2, "schedule": "gpipe"}}, "parallel.schedule"),
    ("dualpipe odd pp", {"parallel": {"pp": 3, "schedule": "dualpipe"}}, "parallel.pp"),
    ("ep not dividing dp", {"parallel": {"dp": 2, "ep": 3}}, "parallel.ep"),
    ("ep not dividing experts", {"model": {"num_experts": 6, "num_groups": 1, "topk_groups": 1},
                                 "parallel": {"dp": 4, "ep": 4}, "train": {"grad_accum_steps": 4}}, "parallel.ep"),
    ("gpus per node", {"parallel": {"dp": 4, "gpus_per_node": 3}, "train": {"grad_accum_steps": 4}},
     "parallel.gpus_per_node"),
    ("tensor parallel shapes", {"parallel": {"tp": 3}}, "parallel.tp"),
    ("num chunks", {"parallel": {"pp": 2, "schedule": "1f1b", "num_chunks": 3}}, "parallel.num_chunks"),
    ("cp with mtp", {"parallel": {"cp": 2}, "model": {"mtp_depth": 1}}, "model.mtp_depth"),  # cp x tp runs since 52738b0
    ("cp with document mask", {"parallel": {"cp": 2}, "data": {"document_mask": True}}, "data.document_mask"),
    ("cp method", {"parallel": {"cp": 2, "cp_method": "ulysses"}}, "parallel.cp_method"),
    ("cp chunks", {"parallel": {"cp": 3}, "train": {"seq_len": 64}}, "train.seq_len"),
    ("afab chunks", {"parallel": {"pp": 4, "schedule": "afab", "num_chunks": 2}, "model": {"num_layers": 8}},
     "parallel.num_chunks"),
    ("too few layers", {"parallel": {"pp": 4, "schedule": "dualpipev"}, "train": {"grad_accum_steps": 8}},
     "model.num_layers"),
    ("dispatch backend", {"parallel": {"dispatch_backend": "nvshmem"}}, "parallel.dispatch_backend"),
    ("dispatch payload", {"parallel": {"dispatch_payload": "fp4"}}, "parallel.dispatch_payload"),
    ("heads", {"model": {"num_heads": 5}}, "hidden_size"),
    ("top_k", {"model": {"top_k": 9}}, "top_k"),
    ("keep checkpoints", {"ops": {"keep_checkpoints": 0}}, "ops.keep_checkpoints"),
    ("spike policy", {"ops": {"spike_policy": "restart"}}, "ops.spike_policy"),
    ("spike zscore", {"ops": {"spike_zscore": -1.0}}, "ops.spike_zscore"),
    ("spike window", {"ops": {"spike_window": 2}}, "ops.spike_window"),
    ("heartbeat", {"ops": {"heartbeat_timeout_s": 1.0}}, "ops.heartbeat_timeout_s"),
    ("drill steps", {"ops": {"inject_nan_steps": [-1]}}, "ops.inject_nan_steps"),
    ("max restarts", {"ops": {"max_restarts": -1}}, "ops.max_restarts"),
    ("long phase timeout", {"ops": {"heartbeat_timeout_s": 60.0, "long_phase_timeout_s": 30.0}},
     "ops.long_phase_timeout_s"),
    ("hang drill fields", {"ops": {"inject_hang": {"rank": 1, "step": 2}}}, "ops.inject_hang"),
    ("hang drill kind", {"ops": {"inject_hang": {"rank": 1, "step": 2, "kind": "freeze"}}}, "ops.inject_hang.kind"),
    ("hang drill rank", {"ops": {"inject_hang": {"rank": 4, "step": 2, "kind": "spin"}}}, "ops.inject_hang.rank"),
]
if not torch.cuda.is_available():
    CASES.append(("nccl without GPUs", {"parallel": {"comm_backend": "nccl"}}, "parallel.comm_backend"))


def toml_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value != value:
        return "nan"
    if value == float("inf"):
        return "inf"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, (list, int, float)):
        return repr(value)
    return '"' + value + '"'


def write_config(tmp_path, changes: dict) -> str:
    sections = {"model": dict(MODEL), "train": {"steps": 3, "micro_batch_size": 2, "seq_len": 16,
                                                "run_dir": str(tmp_path / "run")},
                "data": {"corpus": str(tmp_path / "corpus.txt"), "max_bytes": 20_000}}
    for section, values in changes.items():
        sections.setdefault(section, {}).update(values)
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            value = value.replace("{tmp}", str(tmp_path)) if isinstance(value, str) else value
            lines.append(f"{key} = {toml_value(value)}")
    path = tmp_path / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "corpus.txt").write_text("x = 1\n" * 2000)
    (tmp_path / "small.txt").write_text("tiny")
    (tmp_path / "empty").mkdir()
    return tmp_path


def never_called(*args, **kwargs):
    raise AssertionError("the trainer was called for a malformed config")


def test_the_table_is_large_enough():
    assert len(CASES) >= 25


@pytest.mark.parametrize("name, changes, field", CASES, ids=[c[0] for c in CASES])
def test_malformed_config_is_refused_before_spawning(name, changes, field, files, capsys):
    path = write_config(files, changes)
    for flags in (["--check"], []):
        assert main(["--config", path, "--no-progress", *flags], trainer=never_called) == 2, name
        err = capsys.readouterr().err
        section, _, key = field.partition(".")
        assert "invalid config" in err and (field in err or f"[{section}] {key} " in err), err


def test_check_accepts_a_good_config_without_running(files, capsys):
    path = write_config(files, {})
    assert main(["--config", path, "--check"], trainer=never_called) == 0
    out = capsys.readouterr().out
    assert "config OK" in out and "1 process" in out
