"""FP8 experts (the CPU reference path) against native-precision experts, compared where the comparison
means the same on every CPU (issue 31).

This file used to bound the FP8-vs-native gap after 50 training steps of configs/tiny-1proc.toml by 2%.
That gap is chaos, not FP8. Measured (eval loss after 50 steps, seeds 0-4 x ATEN_CPU_CAPABILITY
default/avx2/avx512): FP8 minus native from -3.7% to +4.4%; FP8 runs alone, differing only in kernel
dispatch, 0.8%-5.4% apart for one seed (one ulp moved flips an e4m3 rounding, a 6% step of that element),
and 1.4% apart with 1 thread instead of 2 (native: identical); native runs 0.02%-0.3% apart across
dispatch, 11% across seeds. The old 2% bound passed with a planted quantiser bug (saturating at 240
instead of 448) and correct code breaks it for 3 of those 5 seeds. Any perturbation grows ~2x per step once the warmup's
learning rate is up: native runs that differ only in dispatch agree to <= 5e-8 (train loss) over steps
0-13, then are 1e-6..3e-4 apart at step 25 and 2e-4..5e-3 at step 49.

So these tests compare from identical weights on identical data, where dispatch moves the figures by
~1e-8..1e-7 and FP8 by 1e-5..1e-3:
- one forward/backward: the loss and every gradient (each expert weight's gradient goes through 2-3 FP8
  GEMMs of ~7e-4 calc_diff from the fp32 product, derived in tests/kernels/test_fp8_quality.py);
- the first FIRST_STEPS training steps: the per-step loss, which also catches what one backward cannot
  (FP8 state that outlives an optimizer step).
The GEMMs themselves, against float64 on the same inputs, are tests/kernels/test_fp8_quality.py.
Figures: 2-core AMD EPYC (AVX-512 with bf16), torch 2.13 CPU; each bound's own figures are in its test.
"""

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from kernels import calc_diff
from launch.config.run import load_config
from launch.train.loop import train
from moe.model import MoETransformer

pytestmark = pytest.mark.slow  # trains for seconds

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "tiny-1proc.toml"


def run_tiny(tmp_path: Path, precision: str, steps: int, *overrides: str) -> list[dict]:
    cfg = load_config(CONFIG, [f"model.expert_precision={precision!r}", f"train.steps={steps}", "train.eval_every=0",
                               f"train.run_dir={str(tmp_path / precision)!r}", *overrides])
    return train(cfg, progress=False)


def text_batch(seed: int, sequences: int, seq_len: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequences` windows of real text, bytes as tokens (the tiny model's byte vocabulary): Python's own
    argparse.py, at offsets drawn from seed; (inputs, labels) [sequences, seq_len]."""
    text = torch.tensor(list(Path(argparse.__file__).read_bytes()), dtype=torch.long)
    starts = torch.randint(0, text.numel() - seq_len - 1, (sequences,), generator=torch.Generator().manual_seed(seed))
    rows = torch.stack([text[s:s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def grads_from_identical_weights(seed: int, sequences: int = 8) -> dict:
    """One forward/backward of the tiny model with native and with FP8 experts, the same weights (the FP8
    model loads the native one's state dict) and the same batch of real text: {precision: (lm loss, grads)}."""
    cfg = load_config(CONFIG, []).model
    torch.manual_seed(seed)
    native = MoETransformer(cfg)
    fp8 = MoETransformer(dataclasses.replace(cfg, expert_precision="fp8"))
    fp8.load_state_dict(native.state_dict())
    inputs, labels = text_batch(seed, sequences)
    result = {}
    for name, model in (("native", native), ("fp8", fp8)):
        out = model(inputs, labels)
        out.loss.backward()
        result[name] = out.lm_loss.item(), {n: p.grad.double() for n, p in model.named_parameters()}
    return result


def test_fp8_loss_and_gradients_from_identical_weights_are_within_fp8_rounding_of_native():
    """Measured over seeds 0-9 x ATEN_CPU_CAPABILITY default/avx2/avx512 (the three settings agree to 2-3
    digits on every figure: dispatch moves these by ~1e-7, FP8 by ~1e-3):
    - relative lm-loss difference: |max| 4.8e-5 -> bound 2.5e-4 (FP8 noise in expert outputs that start
      small against the residual stream);
    - calc_diff of each expert weight's gradient: 5.6e-4 (least) to 1.27e-3 (worst) -> bounds 1e-4 < d < 3e-3
      (each is 2-3 chained FP8 GEMMs of ~7e-4, tests/kernels/test_fp8_quality.py; the lower bound fails
      an FP8 path that silently runs in full precision);
    - calc_diff of each router weight's gradient (expert outputs' error through the routing weights, plus
      the odd flipped top-k choice): max 1.36e-2 -> bound 4e-2;
    - calc_diff of all gradients concatenated (mostly dense layers FP8 touches only through the experts):
      max 9.7e-6 -> bound 3e-5.
    Planted bug it catches: a quantiser saturating at 240 (e4m3fnuz's max) with 448 in the scale gives expert
    gradients calc_diff 0.18..0.28, routers 0.13..0.39, all 8.6e-4..1.3e-3 (seeds 0-2)."""
    result = grads_from_identical_weights(seed=0)
    (loss_native, grads_native), (loss_fp8, grads_fp8) = result["native"], result["fp8"]
    experts = {n: calc_diff(grads_fp8[n], g) for n, g in grads_native.items() if ".experts." in n}
    assert len(experts) == 6  # w_gate_up and w_down of the 3 MoE layers
    assert all(1e-4 < d < 3e-3 for d in experts.values()), experts
    routers = {n: calc_diff(grads_fp8[n], g) for n, g in grads_native.items() if n.endswith("router.weight")}
    assert len(routers) == 3 and all(d < 4e-2 for d in routers.values()), routers
    everything = calc_diff(torch.cat([g.flatten() for g in grads_fp8.values()]),
                           torch.cat([g.flatten() for g in grads_native.values()]))
    assert everything < 3e-5, everything
    assert abs(loss_fp8 - loss_native) <= 2.5e-4 * loss_native, (loss_fp8, loss_native)


FIRST_STEPS = 5
# the byte tokens these bounds were measured on (the default config reads a 512-id BPE since issue 26)
SHORT = ("train.eval_batches=0", "data.max_bytes=300000", "data.tokenizer='bytes'", "model.vocab_size=256")


def test_fp8_training_tracks_native_step_by_step_over_the_first_steps(tmp_path):
    """Same seed, so the same initial weights and batches; both runs in this process, so under one dispatch.
    Measured, relative |fp8 - native| lm loss, largest of the 5 steps: 2.9e-5..6.5e-5 over seeds 0-9 with
    this file's 300 kB of text, 2.5e-5..1.1e-4 over seeds 0-4 with the config's 4 MB; avx2 and avx512 give
    the default's figures to 2 digits, and native runs under different dispatch settings differ by <= 5e-8
    over these steps. Bound 3e-4 (2.7x the largest of those 25 seed/data pairs); lower bound 5e-6 on the
    largest gap (5x under the least): with FP8 silently off the runs would agree exactly.
    Planted bugs it catches: quantised weights cached across optimizer steps (largest gap 3.4e-3..3.5e-3),
    a quantiser saturating at 240 instead of 448 (1.2e-3..1.4e-3)."""
    native = run_tiny(tmp_path, "native", FIRST_STEPS, *SHORT)
    fp8 = run_tiny(tmp_path, "fp8", FIRST_STEPS, *SHORT)
    assert len(native) == len(fp8) == FIRST_STEPS
    assert native[-1]["lm_loss"] < 0.9 * native[0]["lm_loss"]  # these steps do train (5.5 -> 4.6)
    gaps = [abs(f["lm_loss"] - n["lm_loss"]) / n["lm_loss"] for f, n in zip(fp8, native)]
    assert 5e-6 < max(gaps) <= 3e-4, gaps
