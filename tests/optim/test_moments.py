"""AdamW's moments stored in bfloat16 (ZeroOptimizer(state_dtype=torch.bfloat16), the trainer's optim.moment_dtype):
each step widens them to fp32, updates them and the fp32 masters in fp32 arithmetic and rounds the moments once.

Checked per element against a float64 AdamW step from the same stored moments, grads and masters, in a 1-rank fake
world (ZeRO-1, ZeRO-2, offloaded to the host). Bounds, derived:
- a stored moment is the fp32 update (a few fp32 operations: relative error <= 4 x 2^-24) rounded once to bfloat16
  (8 significant bits, round to nearest: relative 2^-8), so |stored - exact| <= (2^-8 + 2^-21) |exact|; rounding twice
  (an intermediate bfloat16 result) reaches up to ~2 x 2^-8;
- a master's update is fp32 arithmetic on the fp32 moments before their rounding: three roundings on the master's scale
  (the decay factor 1 - lr x wd as an fp32 scalar, the decayed master, the sum) and about 8 fp32 operations in step = lr / bc1 x m / (sqrt(v) / sqrt(bc2) + eps), so
  |got - exact| <= 2^-22 |master| + 2^-20 |step| (4/3x and 2x margins); an update from bfloat16 moments or in bfloat16 arithmetic errs by ~2^-8 |step|.
Measured over seeds 0-4 x ATEN_CPU_CAPABILITY=default|avx2|native (the three cases each): largest moment error
0.995 x 2^-8 relative (all capabilities alike), largest master error 0.51 of its bound. Planted bugs caught: exp_avg
rounded to bfloat16 between its decay and its add (a second rounding per step: moment error 773 x 2^-8, where the
decay and the add nearly cancel); the master updated from the bfloat16-rounded moments (master error 4.7e3 x its
bound).
"""

from __future__ import annotations

import math

import pytest
import torch

from optim import ZeroOptimizer

SHAPES = [(64, 48), (500,), (7, 9)]
LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.1
STEPS = 4


def reference_step(master, grad, m, v, step):
    """One AdamW step in float64 from the given (float64) values: (master, m, v) after it."""
    b1, b2 = BETAS
    master = master * (1 - LR * DECAY)
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    denom = v.sqrt() / math.sqrt(1 - b2 ** step) + EPS
    return master - LR / (1 - b1 ** step) * m / denom, m, v, LR / (1 - b1 ** step) * m / denom


def errors(stage: int, offload: str | None, seed: int) -> tuple[float, float]:
    """(largest moment error / 2^-8 relative, largest master error / its bound) over STEPS steps; checks dtypes."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = ZeroOptimizer(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, stage=stage, offload=offload,
                        state_dtype=torch.bfloat16)
    shard = opt._shards[0]
    moment_err = master_err = 0.0
    for step in range(1, STEPS + 1):
        pieces = opt.pieces()
        before = {k: torch.cat([p.state[k] for p in pieces]).double() for k in ("master", "exp_avg", "exp_avg_sq")
                  if k in pieces[0].state}
        grads = [torch.randn(s) * 10.0 ** torch.randint(-3, 1, ()).item() for s in SHAPES]
        opt.zero_grad()
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        pieces = opt.pieces()
        got = {k: torch.cat([p.state[k] for p in pieces]) for k in ("master", "exp_avg", "exp_avg_sq")}
        assert got["exp_avg"].dtype == got["exp_avg_sq"].dtype == torch.bfloat16
        assert got["master"].dtype == torch.float32
        grad = torch.cat([g.reshape(-1) for g in grads]).double()
        zeros = torch.zeros_like(grad)
        master, m, v, update = reference_step(before["master"], grad, before.get("exp_avg", zeros),
                                              before.get("exp_avg_sq", zeros), step)
        for want, have in ((m, got["exp_avg"]), (v, got["exp_avg_sq"])):
            rel = ((have.double() - want).abs() / want.abs().clamp(min=1e-30)).max().item()
            moment_err = max(moment_err, rel / 2**-8)
        bound = 2**-22 * master.abs() + 2**-20 * update.abs()
        master_err = max(master_err, ((got["master"].double() - master).abs() / bound).max().item())
    assert sum(t.nbytes for t in got.values()) == 8 * shard.layout.shard_numel  # 4 master + 2 + 2 moments
    return moment_err, master_err


@pytest.mark.parametrize("stage, offload", [(1, None), (2, None), (1, "cpu")])
def test_bf16_moments_are_rounded_once_from_an_fp32_update(one_rank, stage, offload):
    moment_err, master_err = errors(stage, offload, seed=0)
    assert moment_err <= 1 + 2**-13, moment_err
    assert master_err <= 1.0, master_err
