"""The shipped default config, run through the CLI as a user would, learns within 200 steps on BPE tokens
prepared into the run directory."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launch.config.run import load_config
from launch.checkpoint.manifest import latest_valid, step_folder
from launch.metrics.records import read_jsonl
from launch.data.shards import Prepared
from launch.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[3]


def unigram_entropy(folder: Path) -> float:
    """Entropy (nats) of the prepared tokens' unigram distribution: the loss of a model that ignores context."""
    tokens = np.concatenate([np.fromfile(folder / f"{s['name']}.tokens", dtype="<u2")
                             for s in Prepared(folder).manifest["shards"]])
    p = np.bincount(tokens) / tokens.size
    return float(-(p[p > 0] * np.log(p[p > 0])).sum())


def test_tiny_config_cuts_lm_loss_by_40_percent_in_200_steps(tmp_path):
    """From ln(vocab) (6.24 for the shipped 512-id BPE) the mean LM loss of the last 10 of 200 steps falls by
    40% (3.74): over a nat below what the tokens' unigram statistics alone give, so the model uses context."""
    metrics = tmp_path / "metrics.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "launch.train_cli", "--config", str(ROOT / "configs" / "tiny.toml"),
         "--steps", "200", "--metrics-out", str(metrics), "--run-dir", str(tmp_path / "run"), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == list(range(200))
    cfg = load_config(ROOT / "configs" / "tiny.toml")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    assert tokenizer.vocab_size == cfg.model.vocab_size == 512
    data = Prepared(tmp_path / "run" / "data", tokenizer.digest)  # the run read BPE shards of the shipped tokenizer
    assert records[0]["lm_loss"] == pytest.approx(math.log(512), abs=0.1)
    late = float(np.mean([r["lm_loss"] for r in records[-10:]]))
    assert late <= 0.6 * math.log(512) and late <= unigram_entropy(data.folder) - 1
    root = tmp_path / "run" / "checkpoint"
    assert latest_valid(root) == step_folder(root, 200)
