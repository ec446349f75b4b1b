"""BF16 AdamW moments (optim.moment_dtype = "bfloat16") against FP32 moments on configs/tiny-1proc.toml shrunk to run
fast (SMALL: byte tokens, 2 x 2 sequences of 64 tokens per step), the same seed: the same initial weights and batches.

(module doc: derivation and measurement to come)
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from launch.checkpoint.checkpointer import consolidate
from launch.config.run import load_config
from launch.train.loop import train

pytestmark = pytest.mark.slow  # trains for seconds

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny-1proc.toml"
SMALL = ("train.eval_every=0", "train.eval_batches=0", "data.max_bytes=300000", "data.tokenizer='bytes'",
         "model.vocab_size=256", "train.grad_accum_steps=2", "train.micro_batch_size=2", "train.seq_len=64")
MOMENTS = ("float32", "bfloat16")
CHEAP = ("train.grad_accum_steps=1", "train.seq_len=32")  # the suite's runs: 2 sequences of 32 tokens per step
STEPS = 3


def run(run_dir: Path, seed: int, steps: int, moment_dtype: str, *overrides: str) -> list[float]:
    """lm losses of the shrunk tiny-1proc run from seed for steps steps with AdamW's moments in moment_dtype."""
    return [r["lm_loss"] for r in train(load_config(CONFIG, [
        *SMALL, f"train.seed={seed}", f"train.steps={steps}", f"optim.moment_dtype={moment_dtype!r}",
        f"train.run_dir={str(run_dir)!r}", *overrides]), progress=False)]


def moment_runs(root: Path, seed: int, steps: int) -> dict[str, list[float]]:
    """moment dtype -> lm losses of run(seed, steps) with it (the measurement behind the module doc's figures)."""
    return {dtype: run(root / dtype, seed, steps, dtype) for dtype in MOMENTS}


@contextlib.contextmanager
def moments_rounded_after_each_step():
    """Every torch optimizer's AdamW moments rounded to bfloat16 (in place, kept in float32) after each step: float32
    moments stored as a bfloat16 store rounds them, once per step, outside the optimizer under test. Yields a list
    of (moment elements the rounding changed, moment elements rounded), per moment of an inner optimizer's step."""
    changed: list[tuple[int, int]] = []

    def rounded(optimizer: torch.optim.Optimizer, *_) -> None:
        for entry in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if isinstance(entry, dict) and isinstance(entry.get(key), torch.Tensor):
                    value = entry[key].to(torch.bfloat16)
                    changed.append((int((value != entry[key]).sum()), value.numel()))
                    entry[key].copy_(value)
    handle = register_optimizer_step_post_hook(rounded)
    try:
        yield changed
    finally:
        handle.remove()


def test_bf16_moments_are_fp32_moments_rounded_once_per_step(tmp_path):
    """The trainer's bfloat16 moments (optim.shard widens them, AdamW updates them in fp32, they are rounded once)
    give bit for bit the run whose fp32 moments are rounded to bfloat16 after each step, and both track the fp32 run
    over the first STEPS steps within BOUND."""
    got = run(tmp_path / "bfloat16", 0, STEPS, "bfloat16", *CHEAP)
    with moments_rounded_after_each_step() as changed:
        emulated = run(tmp_path / "emulated", 0, STEPS, "float32", *CHEAP)
    assert sum(n for n, _ in changed) > 0.5 * sum(total for _, total in changed), "the emulation rounded nothing"
    assert got == emulated
    want, have = (consolidate(tmp_path / name / "checkpoint") for name in ("emulated", "bfloat16"))
    assert set(want) == set(have) and all(torch.equal(want[k], have[k]) for k in want)


if __name__ == "__main__":  # the measurement: python tests/launch/train/test_bf16_moments.py SEED STEPS ROOT
    print(json.dumps(moment_runs(Path(sys.argv[3]), int(sys.argv[1]), int(sys.argv[2]))), flush=True)
