"""torchtitan's Qwen3 MoE model as the trainer rows' peer (launch.bench.peers.torchtitan_model), on the CPU at a tiny
shape of configs/gpu-1x.toml's model kind: it builds, trains (step-0 loss at random init's value, the loss falls on the
repeated batch), counts exactly QK-norm's parameters more than ours, reads the trainer rows' tokens, and takes its
FLOPs and MFU from our trainer's functions."""

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan.models.qwen3")

from launch.bench.peers import torchtitan_model as tt  # noqa: E402
from launch.config.run import load_config  # noqa: E402
from launch.metrics.flops import model_flops_per_token  # noqa: E402
from launch.metrics.records import mfu_peak, throughput_metrics  # noqa: E402
from launch.plan.params import count_params  # noqa: E402
from launch.plan.rehearse import RandomFeed  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
CPU = torch.device("cpu")
# gpu-1x's model kind (GQA, every layer MoE, softmax top-k renormalised, no shared experts) at 2 layers of 64
TINY = ["model.vocab_size=512", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.head_dim=16", "model.max_seq_len=32", "model.num_experts=8",
        "model.expert_ffn_size=32", "model.top_k=2", "train.seq_len=32", "train.micro_batch_size=2",
        "train.peak_tflops_per_gpu=1.0"]  # a peak on the CPU, so that MFU is a number to compare
STEPS = 10
LM_HEAD_STD = 0.02  # torchtitan.models.qwen3's _LINEAR_INIT, the LM head's init
# Step-0 loss of a random init: the final RMSNorm makes |h|^2 = hidden for every token, so each logit w_v . h is
# N(0, sigma^2) with sigma^2 = LM_HEAD_STD^2 x hidden, independent of the random label: E[loss] = E[logsumexp] =
# ln(vocab) + sigma^2 / 2 (the log of the mean of vocab lognormals; its own spread sqrt((e^sigma^2 - 1) / vocab)
# < 0.01), and the mean of the labels' logits over the N tokens spreads sigma / sqrt(N): 4 of those, plus 0.01 (that
# spread and the bf16 logits' rounding, 2^-8 x sigma per logit).
SIGMA = LM_HEAD_STD * math.sqrt(64)
TOKENS = 2 * 32
INIT_BOUND = 4 * SIGMA / math.sqrt(TOKENS) + 0.01
# Ten AdamW steps at gpu-1x's lr (3e-3) on the one repeated batch: measured a fall of 2.55 to 2.60 (5 seeds of the
# weights and tokens x ATEN_CPU_CAPABILITY default, avx2, native; the step-0 loss's distance from ln(vocab) +
# sigma^2 / 2 measured -0.012 to 0.034 there, INIT_BOUND 0.09); a loop that does not train falls by 0
FALL = 1.0


def tiny(*overrides: str):
    return load_config(CONFIGS / "gpu-1x.toml", [*TINY, *overrides])


@pytest.fixture(scope="module")
def measured():
    cfg = tiny()
    return cfg, tt.measure(cfg, CPU, warmup=1, timed=STEPS - 1)


def test_measure_trains_on_the_cpu_and_says_what_it_runs(measured):
    cfg, result = measured
    assert result["repeats"] == STEPS - 1 and len(result["losses"]) == STEPS
    assert all(math.isfinite(loss) for loss in result["losses"]) and result["last_loss"] == result["losses"][-1]
    assert result["tokens_per_step"] == TOKENS and result["peak_memory_gib"] is None  # no CUDA figure on the CPU
    assert result["tokens_per_s"] == pytest.approx(TOKENS / (result["step_ms"] / 1e3))
    assert "torch.compile off, activation checkpointing off, fp32 params + bf16 autocast, foreach AdamW" in \
        result["settings"]
    assert result["library"] == "torchtitan 0.3.0" and "is_causal=True" in result["attention"]
    assert result["router_losses"] == "ours: Switch balance 0.001; torchtitan's Qwen3: none"


def test_step_zero_loss_is_a_random_inits(measured):
    _, result = measured
    assert abs(result["losses"][0] - (math.log(512) + SIGMA ** 2 / 2)) < INIT_BOUND


def test_the_loop_trains(measured):
    _, result = measured
    assert result["losses"][0] - result["losses"][-1] > FALL


def test_flops_and_mfu_are_our_trainers(measured):
    cfg, result = measured
    flops = model_flops_per_token(cfg.model, cfg.train.seq_len)
    peak = mfu_peak(cfg.model, cfg.train.seq_len, CPU, cfg.train.peak_tflops_per_gpu)
    ours = throughput_metrics(TOKENS, result["step_ms"] / 1e3, flops, peak)
    assert result["model_flops_per_token"] == flops != model_flops_per_token(cfg.model, cfg.train.seq_len, causal=False)
    assert result["mfu"] == pytest.approx(ours["mfu"], rel=1e-12) and result["mfu"] > 0


def test_params_differ_from_ours_by_exactly_qk_norm(measured):
    cfg, result = measured
    model = tt.build(cfg, torch.device("meta"), 0)
    qk_norm = sum(p.numel() for name, p in model.named_parameters()
                  if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")))
    assert result["params"]["ours"] == count_params(cfg.model).total.total
    assert result["params"]["torchtitan"] == sum(p.numel() for p in model.parameters())
    assert result["params"]["torchtitan_extra"] == {"qk_norm": qk_norm} == {"qk_norm": 2 * 16 * 2}
    assert result["params"]["torchtitan"] - result["params"]["ours"] == qk_norm


def test_it_trains_on_the_trainer_rows_tokens():
    cfg = tiny()
    default = tt.train(tt.build(cfg, CPU, 0), cfg, CPU, warmup=0, timed=1)
    rows = tt.train(tt.build(cfg, CPU, 0), cfg, CPU, warmup=0, timed=1, feed=RandomFeed(cfg, CPU))
    assert default["losses"] == rows["losses"]


def test_build_is_seeded_and_leaves_the_global_rng_alone():
    cfg = tiny()
    state = torch.random.get_rng_state()
    first, again, other = (dict(tt.build(cfg, CPU, seed).named_parameters()) for seed in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])


def test_shapes_torchtitans_qwen3_cannot_build_are_refused():
    with pytest.raises(ValueError, match=r"model.first_k_dense = 1: .* allowed: 0"):
        tt.build(load_config(CONFIGS / "tiny-1proc.toml"), CPU, 0)  # a dense first layer, shared experts
    with pytest.raises(ValueError, match=r"model.expert_precision = 'fp8': .* allowed: 'native'"):
        tt.build(tiny("model.expert_precision='fp8'"), CPU, 0)
