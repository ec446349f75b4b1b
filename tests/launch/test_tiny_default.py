"""The shipped default config, run through the CLI as a user would, learns within 200 steps."""

import subprocess
import sys
from pathlib import Path

from launch.manifest import latest_valid, step_folder
from launch.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_config_cuts_lm_loss_by_40_percent_in_200_steps(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "launch.train_cli", "--config", str(ROOT / "configs" / "tiny.toml"),
         "--steps", "200", "--metrics-out", str(metrics), "--run-dir", str(tmp_path / "run"), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == list(range(200))
    assert records[-1]["lm_loss"] <= 0.6 * records[0]["lm_loss"]
    root = tmp_path / "run" / "checkpoint"
    assert latest_valid(root) == step_folder(root, 200)
