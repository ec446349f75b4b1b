"""The training loop learns, logs the promised metrics, and resumes exactly from an atomic checkpoint."""

import numpy as np
import pytest
import torch

from launch.config.run import build_config
from launch.data.feed import ByteTokenizer, DataFeed, corpus_files, prepare_corpus
from launch.metrics.records import read_jsonl
from launch.train.loop import train

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

REQUIRED_KEYS = {"step", "loss", "lm_loss", "aux_loss", "grad_norm", "lr", "tokens_per_s",
                 "expert_load_max_over_mean", "dropped_tokens"}


def small_config(tmp_path, steps, model_overrides=None, **train):
    model = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "dense_ffn_size": 128,
             "num_experts": 4, "expert_ffn_size": 32, "top_k": 2, "max_seq_len": 64,
             "capacity_factor": 1.0, "aux_loss_coeff": 0.01, "bias_update_rate": 0.001,
             **(model_overrides or {})}
    settings = {"steps": steps, "micro_batch_size": 8, "seq_len": 32, "warmup_steps": 5,
                "run_dir": str(tmp_path / "run"), **train}
    return build_config({"model": model, "train": settings, "data": {"max_bytes": 200_000}})


def test_loss_falls_and_metrics_have_the_promised_keys(tmp_path):
    records = train(small_config(tmp_path, 40, lr=0.01), progress=False)
    written = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert written == records and len(records) == 40
    assert REQUIRED_KEYS <= set(records[0])
    assert len(records[0]["expert_load_max_over_mean"]) == 1
    assert records[-1]["lm_loss"] < 0.8 * records[0]["lm_loss"]
    assert any(r["dropped_tokens"] > 0 for r in records)  # capacity_factor 1.0 drops some slots
    assert "eval_lm_loss" in records[-1] and records[-1]["eval_lm_loss"] < records[0]["eval_lm_loss"]


def test_resume_continues_exactly(tmp_path):
    straight = train(small_config(tmp_path / "a", 6), progress=False)
    train(small_config(tmp_path / "b", 3, checkpoint_every=3), progress=False)
    resumed = train(small_config(tmp_path / "b", 6), resume=True, progress=False)
    assert [r["step"] for r in resumed] == [3, 4, 5]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]
    assert not list((tmp_path / "b" / "run").glob(".*tmp*"))


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    per_batch_free = {"capacity_factor": None, "aux_loss_coeff": 0.0}
    big = train(small_config(tmp_path / "big", 3, per_batch_free, micro_batch_size=8), progress=False)
    accum = train(small_config(tmp_path / "acc", 3, per_batch_free, micro_batch_size=4, grad_accum_steps=2),
                  progress=False)
    for key in ("lm_loss", "grad_norm"):
        assert [r[key] for r in accum] == pytest.approx([r[key] for r in big], rel=1e-4)


def test_packing_and_tokenizer_roundtrip(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("héllo wörld\n" * 50)
    (corpus / "b.md").write_text("second document\n" * 50)
    tokenizer = ByteTokenizer()
    cfg = build_config({"train": {"micro_batch_size": 4, "seq_len": 16, "run_dir": str(tmp_path / "run")},
                        "data": {"corpus": str(corpus), "max_bytes": 10_000}})
    prepare_corpus(cfg.data, tmp_path / "run" / "data", tokenizer)
    assert [p.name for p in corpus_files(str(corpus))] == ["a.txt", "b.md"]
    tokens = np.fromfile(tmp_path / "run" / "data" / "00000.tokens", dtype=np.uint16).tolist()
    assert tokenizer.decode(tokens) == "héllo wörld\n" * 50 + "second document\n" * 50
    batch = DataFeed(cfg, 0, torch.device("cpu")).next_step()[0]
    assert batch.inputs.shape == batch.labels.shape == (4, 16)
    assert (batch.inputs[:, 1:] == batch.labels[:, :-1]).all()


def test_empty_corpus_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="holds no"):
        corpus_files(str(tmp_path))


def _train_runs(rank: int, world: int, raws: list[tuple[dict, bool]]) -> list[list[dict]]:
    return [train(build_config(raw), resume=resume, progress=False) for raw, resume in raws]


def test_distributed_resume_continues_exactly(tmp_path):
    """pp=2 DualPipeV x dp=2 x ep=2 (4 processes): 3 steps, save, resume for 3 more == 6 straight steps, bitwise."""
    from launch.parallel.spawn import run_processes

    def raw(run: str, steps: int, every: int = 0) -> dict:
        cfg = small_config(tmp_path / run, steps, {"num_layers": 4, "capacity_factor": None}, micro_batch_size=2,
                           grad_accum_steps=8, checkpoint_every=every, eval_batches=0)
        par = {"pp": 2, "dp": 2, "ep": 2, "schedule": "dualpipev", "gpus_per_node": 1,
               "dispatch_backend": "hierarchical"}
        return {"model": vars(cfg.model), "train": vars(cfg.train), "data": vars(cfg.data), "parallel": par}

    straight, first, resumed = run_processes(
        _train_runs, 4, [(raw("a", 6), False), (raw("b", 3, every=3), False), (raw("b", 6), True)], timeout_s=300)[0]
    assert [r["step"] for r in resumed] == [3, 4, 5] and len(first) == 3
    assert [r["loss"] for r in first + resumed] == [r["loss"] for r in straight]
    assert [r["grad_norm"] for r in first + resumed] == [r["grad_norm"] for r in straight]


def test_tensorboard_events_and_mfu_from_the_configured_peak(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = train(small_config(tmp_path, 3, tensorboard=True, peak_tflops_per_gpu=2e-6), progress=False)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/lm_loss")]
    assert logged == [(r["step"], pytest.approx(r["lm_loss"], rel=1e-6)) for r in records]
    for r in records:  # 2e-6 TFLOP/s = 2e6 FLOP/s on the one GPU-less rank
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["model_flops_per_token"] / 2e6)


def test_negative_peak_flops_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="train.peak_tflops_per_gpu"):
        small_config(tmp_path, 1, peak_tflops_per_gpu=-1.0)
