"""launch.metrics.flops, the model's one FLOP count: against hand counts from the shapes (GQA, MLA, DeepSeek-V3), the
model's own weights, its use by the metrics, the stage split and moe-plan, and the FP8/BF16 MFU peak."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from launch.metrics import records as metrics
from launch.config.run import load_config
from launch.metrics.flops import (attention_shape, flops_by_precision, head_flops, layer_flops, mixed_peak, mtp_flops,
                          model_flops_per_token, model_layer_flops)
from launch.plan.efficiency import TENSOR_EFFICIENCY
from launch.plan.planner import Machine, Options, make_plan
from launch.plan.presets import GPUS
from launch.parallel.stages import split_layers, stage_ranges
from moe.config import ModelConfig
from moe.model import MoETransformer

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
# hidden 64, 4 heads of 16 (2 KV heads), 1 dense layer (FFN 128) then 2 MoE layers (4 experts of 32, top-2, 1 shared)
SMALL = ModelConfig(vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=64,
                    first_k_dense=1, dense_ffn_size=128, num_experts=4, num_shared_experts=1, expert_ffn_size=32,
                    top_k=2, num_groups=1, topk_groups=1)
SEQ = 16
MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
MLA_SMALL = replace(SMALL, **MLA, q_lora_rank=32)  # SMALL with MLA: a 32-wide query latent, a 16-wide KV latent
MLA_PLAIN_QUERY = replace(SMALL, **MLA)  # and without the query latent (q_lora_rank = 0, as DeepSeek-V2-Lite)
# forward FLOPs per token, counted by hand (2 per multiply-add):
QKV_OUT = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64)  # q [64->4x16], k and v [64->2x16], out [64->64]: 24576
CORE = 2 * 4 * 16 * 8 + 2 * 4 * 16 * 8  # causal: QK^T and AV, 4 heads x 16 dims x 16/2 keys on average: 2048
DENSE_FFN = 2 * 3 * 64 * 128  # gate, up, down: 49152
SHARED_AND_ROUTER = 2 * (3 * 64 * 32 + 64 * 4)  # one shared expert + the router's [64->4] gate: 12800
ROUTED = 2 * 2 * 3 * 64 * 32  # top-2 routed experts: 24576
HEAD = 2 * 256 * 64  # 32768


def test_a_small_gqa_model_against_a_hand_count():
    layers = model_layer_flops(SMALL, SEQ)
    assert [(f.dense, f.core, f.expert) for f in layers] == [(QKV_OUT + DENSE_FFN, CORE, 0),
                                                             (QKV_OUT + SHARED_AND_ROUTER, CORE, ROUTED),
                                                             (QKV_OUT + SHARED_AND_ROUTER, CORE, ROUTED)]
    assert [f.total for f in layers] == [75776, 64000, 64000]
    assert CORE == 2 * SEQ * SMALL.hidden_size  # causal: half of full attention's 4 x seq x hidden
    assert head_flops(SMALL) == HEAD
    assert model_flops_per_token(SMALL, SEQ) == 3 * (75776 + 2 * 64000 + HEAD) == 709632
    # full attention (PaLM's, torchtitan's count) adds the masked half of the core: 3 x 3 layers x 2048
    assert model_flops_per_token(SMALL, SEQ, causal=False) - model_flops_per_token(SMALL, SEQ) == 3 * 3 * CORE


@pytest.mark.parametrize("cfg", [SMALL, MLA_SMALL, MLA_PLAIN_QUERY], ids=["gqa", "mla", "mla without query latent"])
def test_the_weights_counted_are_the_models_matmul_weights(cfg):
    """6 x the weights a token multiplies by (top_k of the routed experts, no embedding lookup, no norms)
    plus 3 x the causal attention core, from the model the trainer builds."""
    with torch.device("meta"):
        model = MoETransformer(cfg)
    weights = 0.0
    for name, param in model.named_parameters():
        if name.startswith("embed") or param.dim() < 2:
            continue
        weights += param.numel() * (cfg.top_k / cfg.num_experts if ".experts." in name else 1.0)
    core = 2 * cfg.num_heads * (attention_shape(cfg).qk_head_dim + attention_shape(cfg).v_head_dim) * SEQ / 2
    assert model_flops_per_token(cfg, SEQ) == 6 * weights + 3 * cfg.num_layers * core


@pytest.mark.parametrize("cfg, query", [(MLA_SMALL, 64 * 32 + 32 * 4 * 12), (MLA_PLAIN_QUERY, 64 * 4 * 12)],
                         ids=["query latent", "plain query"])
def test_an_mla_layer_against_a_hand_count(cfg, query):
    # query: down [64->32] and up [32 -> 4 heads x (8 nope + 4 rope)], or one [64 -> 4 x 12] projection
    weights = (query
               + 64 * (16 + 4)  # kv down [64 -> 16 latent + 4 shared rope]
               + 16 * 4 * 16    # kv up [16 -> 4 heads x (8 nope k + 8 v)]
               + 4 * 8 * 64)    # out [4 x 8 -> 64]
    assert weights == (7936 if cfg.q_lora_rank else 7424)
    core = 2 * 4 * 12 * 8 + 2 * 4 * 8 * 8  # QK^T over qk 12 wide, AV over v 8 wide, 16/2 keys: 1280
    dense, moe = (layer_flops(cfg, i, SEQ) for i in (0, 1))
    assert (dense.dense, dense.core, dense.expert) == (2 * weights + DENSE_FFN, core, 0)
    assert (moe.dense, moe.core, moe.expert) == (2 * weights + SHARED_AND_ROUTER, core, ROUTED)


def test_deepseek_v3_with_mla_from_its_published_shape():
    cfg = load_config(CONFIGS / "deepseek-v3.toml").model
    attention = (7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * 256 + 128 * 128 * 7168)
    assert attention == 187_105_280  # the 187_107_328 of test_plan_params less the 1536 + 512 latent norm scales
    core = 2 * 128 * (192 + 128) * 4096 / 2  # 128 heads, qk 128 + 64 and v 128 wide, 4096 / 2 keys
    dense_ffn = 3 * 7168 * 18432
    moe_ffn = 7168 * 256 + 3 * 7168 * 2048 * (1 + 8)  # router, 1 shared + 8 routed experts
    forward = 61 * (2 * attention + core) + 3 * 2 * dense_ffn + 58 * 2 * moe_ffn + 2 * 129280 * 7168
    flops = model_flops_per_token(cfg, 4096)
    assert flops == 3 * forward == pytest.approx(250.45e9, rel=1e-4)


def test_the_stage_split_balances_the_same_figures():
    for name in ("tiny.toml", "tiny-1proc.toml", "deepseek-v3.toml"):
        config = load_config(CONFIGS / name)
        cfg, seq = config.model, config.train.seq_len
        costs = [f.total for f in model_layer_flops(cfg, seq)]
        for stages in range(1, cfg.num_layers + 1):
            # the last stage also carries the MTP depths (deepseek-v3.toml: one)
            head = head_flops(cfg) + mtp_flops(cfg, seq)
            assert stage_ranges(cfg, seq, stages) == split_layers(costs, stages, head_cost=head)
    v3 = load_config(CONFIGS / "deepseek-v3.toml")  # the shipped splits (unchanged by the shared count)
    assert stage_ranges(v3.model, 4096, 16) == [range(i, i + 4) for i in range(0, 60, 4)] + [range(60, 61)]
    tiny = load_config(CONFIGS / "tiny.toml")
    assert stage_ranges(tiny.model, 128, 4) == [range(i, i + 1) for i in range(4)]


def test_the_planner_and_the_metrics_use_the_same_count():
    config = load_config(CONFIGS / "tiny.toml", ["parallel.pp=2", "parallel.dp=1", "parallel.ep=1",
                                                  'parallel.schedule="1f1b"', "train.grad_accum_steps=8"])
    cfg, seq = config.model, config.train.seq_len
    machine = Machine(GPUS["h100"], 8, gemm_efficiency=0.6)  # the flat model: every GEMM at one share of peak
    plan = make_plan(config, machine)
    assert plan.flops_per_token == metrics.model_flops_per_token(cfg, seq) == model_flops_per_token(cfg, seq)
    assert plan.layers == stage_ranges(cfg, seq, 2)
    rate = GPUS["h100"].bf16_tflops * 1e12 * machine.gemm_efficiency  # BF16 experts: one rate for all
    tokens = config.train.micro_batch_size * seq
    for s, (span, cost) in enumerate(zip(plan.layers, plan.stage_costs)):
        forward = sum(layer_flops(cfg, i, seq).total for i in span) + (head_flops(cfg) if s == 1 else 0)
        assert cost.f == pytest.approx(tokens * forward / rate, rel=1e-12)


H100_BF16, H100_FP8 = 989e12, 1979e12
FP8_SMALL = replace(SMALL, expert_precision="fp8")


def test_fp8_experts_take_their_share_of_the_flops_at_the_fp8_peak():
    fp8 = 3 * 2 * ROUTED  # the routed experts of the 2 MoE layers, forward + dgrad + wgrad
    bf16 = 709632 - fp8
    assert flops_by_precision(FP8_SMALL, SEQ) == (bf16, fp8)
    assert flops_by_precision(SMALL, SEQ) == (709632, 0)
    peak = 709632 / (bf16 / H100_BF16 + fp8 / H100_FP8)  # the time-weighted (harmonic) mix
    assert H100_BF16 < peak < H100_FP8
    assert mixed_peak(FP8_SMALL, SEQ, H100_BF16, H100_FP8) == pytest.approx(peak, rel=1e-12)
    assert mixed_peak(SMALL, SEQ, H100_BF16, H100_FP8) == H100_BF16
    name = "NVIDIA H100 80GB HBM3"
    assert metrics.gpu_mfu_peak(FP8_SMALL, SEQ, name) == pytest.approx(peak, rel=1e-12)
    assert metrics.gpu_mfu_peak(SMALL, SEQ, name) == H100_BF16
    assert metrics.gpu_mfu_peak(FP8_SMALL, SEQ, "NVIDIA A100-SXM4-80GB") is None  # no FP8 peak known
    assert metrics.gpu_mfu_peak(SMALL, SEQ, "NVIDIA A100-SXM4-80GB") == 312e12


def test_mfu_peak_takes_the_rank_device(monkeypatch):
    asked = []
    name = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or name)
    cuda = torch.device("cuda", 3)
    assert metrics.mfu_peak(FP8_SMALL, SEQ, cuda) == metrics.gpu_mfu_peak(FP8_SMALL, SEQ, name)
    assert asked == [cuda]
    assert metrics.mfu_peak(FP8_SMALL, SEQ, torch.device("cpu")) is None
    assert metrics.mfu_peak(FP8_SMALL, SEQ, torch.device("meta")) is None
    # train.peak_tflops_per_gpu: the configured figure, as given, on any device
    assert metrics.mfu_peak(FP8_SMALL, SEQ, torch.device("cpu"), 2e-6) == 2e6
    assert metrics.mfu_peak(FP8_SMALL, SEQ, cuda, 500.0) == 500e12


def test_deepseek_v3_plan_mfu_is_against_the_fp8_and_bf16_mix():
    config = load_config(CONFIGS / "deepseek-v3.toml")  # expert_precision = "fp8" on H800s
    machine = Machine(GPUS["h800"], 8)
    plan = make_plan(config, machine, Options(sample_tokens=256))
    bf16, fp8 = flops_by_precision(config.model, 4096)
    assert plan.peak_flops == pytest.approx((bf16 + fp8) / (bf16 / 989e12 + fp8 / 1979e12), rel=1e-12)
    assert plan.mfu == pytest.approx(plan.flops_per_token * plan.tokens_per_second / (2048 * plan.peak_flops))
    # no GEMM runs faster than the tensor cores' main loop at its precision's peak, communication and the
    # bubble only add: MFU cannot exceed that share (it read 0.67 > 0.6 against the BF16 peak alone)
    assert plan.mfu < TENSOR_EFFICIENCY
