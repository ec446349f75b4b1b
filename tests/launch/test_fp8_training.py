"""The tiny model trains with FP8 experts (CPU reference path) as well as with native-precision experts."""

from pathlib import Path

import pytest

from launch.config import load_config
from launch.train import train

ROOT = Path(__file__).resolve().parents[2]


def run_tiny(tmp_path: Path, precision: str) -> list[dict]:
    cfg = load_config(ROOT / "configs" / "tiny-1proc.toml", [
        f"model.expert_precision={precision!r}", "train.steps=50", "train.eval_every=0",
        f"train.run_dir={str(tmp_path / precision)!r}"])
    return train(cfg, progress=False)


def test_fp8_experts_lm_loss_within_2_percent_after_50_steps(tmp_path):
    native, fp8 = run_tiny(tmp_path, "native"), run_tiny(tmp_path, "fp8")
    assert native[-1]["lm_loss"] < 0.75 * native[0]["lm_loss"]
    assert fp8[0]["lm_loss"] == pytest.approx(native[0]["lm_loss"], rel=1e-3)
    assert fp8[-1]["eval_lm_loss"] == pytest.approx(native[-1]["eval_lm_loss"], rel=0.02)
    assert fp8[-1]["lm_loss"] == pytest.approx(native[-1]["lm_loss"], rel=0.02)
