"""moe-plan's compute model (launch.plan.efficiency): GEMM efficiency by shape and precision, its limits,
the kernel measurements its constants come from, and what the planner's time model makes of it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from launch.config.run import load_config
from launch.metrics.flops import attention_shape
from launch.plan.compute import Precisions, elementwise_seconds, layer_seconds
from launch.plan.efficiency import (BLOCK_SCALING_COST, PRECISIONS, QUANTIZE_BYTES, SUSTAINED_CLOCK, TENSOR_EFFICIENCY,
                                    GemmModel)
from launch.plan.planner import Machine, Options, make_plan
from launch.plan.presets import GPUS
from launch.plan.timing import StageCost, paired

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
H100, H800 = GemmModel(GPUS["h100"]), GemmModel(GPUS["h800"])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_efficiency_rises_with_every_dimension_and_saturates_below_the_tensor_cores(precision):
    sizes = [128, 512, 2048, 8192, 32768, 131072]
    for shape in ((lambda x: (x, 4096, 7168)), (lambda x: (8192, x, 7168)), (lambda x: (8192, 4096, x))):
        eff = [H100.efficiency(*shape(x), precision) for x in sizes]
        assert all(a < b for a, b in zip(eff, eff[1:])), eff
        ceiling = TENSOR_EFFICIENCY * SUSTAINED_CLOCK * (1 - BLOCK_SCALING_COST.get(precision, 0.0))
        assert eff[-1] < ceiling and eff[-1] > 0.8 * ceiling
    grouped = [H100.efficiency(m, 4096, 7168, precision, groups=8) for m in sizes]
    assert all(a < b for a, b in zip(grouped, grouped[1:])) and grouped[-1] < TENSOR_EFFICIENCY * SUSTAINED_CLOCK


def test_fp8_block_scaling_costs_something_against_plain_fp8_and_fp8_beats_bf16_on_large_gemms():
    for shape in ((8192, 8192, 8192), (2048, 4096, 7168), (256, 2048, 7168)):
        tensor, block = H800.gemm(*shape, "fp8-tensor"), H800.gemm(*shape, "fp8-block")
        assert tensor < block  # scales to move and a promotion every 128 of K
        assert block < H800.gemm(*shape, "bf16")  # still faster than BF16


def test_transformer_engine_s_block_scaling_reproduces_its_gemm_profiling_guide():
    """Transformer Engine's GEMM profiling guide (H200 NVL, autocast): a layer's twelve GEMMs at hidden 4096, FFN 16384
    and 15,872 tokens take 32.014 ms in BF16, 20.285 with current scaling and 22.882 with Float8BlockScaling. Priced on
    the H200 preset (ratios only: the guide's card is the 600 W NVL) with every linear's input, output grad and weight
    cast once, fp8-block-te takes the guide's x1.128 over current scaling and stays at least 1.4x faster than BF16
    (the guide: 1.40x); DeepGEMM-style block scaling (fp8-block, no TE measurement) prices below current scaling."""
    model, tokens = GemmModel(GPUS["h200"], clock=1.0), 15872
    shapes = [(4096, 12288), (4096, 4096), (4096, 16384), (16384, 4096)]  # (in, out): QKV, attention out, up, down

    def layer(precision: str) -> float:
        gemms = sum(sum(model.linear(tokens, n, k, precision)) for k, n in shapes)
        return gemms + model.memory(QUANTIZE_BYTES[precision] * sum(tokens * (k + n) + k * n for k, n in shapes))

    assert layer("fp8-block-te") / layer("fp8-tensor") == pytest.approx(22.882 / 20.285, rel=0.01)
    assert layer("fp8-block") < layer("fp8-tensor") < layer("fp8-block-te") < layer("bf16") / 1.4


def test_small_groups_pay_for_their_padding_to_the_tile():
    # 8 groups of 1030 rows run as 8 x 1152 padded rows: more rows, less efficiency; a dense GEMM pads nothing
    assert H100.efficiency(1030, 4096, 7168, "bf16", 8) < 0.95 * H100.efficiency(1024, 4096, 7168, "bf16", 8)
    assert H100.efficiency(1030, 4096, 7168, "bf16") > H100.efficiency(1024, 4096, 7168, "bf16")


@pytest.mark.parametrize("gpu, shape, groups, precision, measured", [
    ("h100", (8192, 8192, 8192), 1, "bf16", 798),             # H100 BF16 8192^3 (ANCHORS.md)
    ("h800", (4096, 7168, 16384), 1, "fp8-block", 1520),      # DeepGEMM dense
    ("h800", (8192, 4096, 7168), 4, "fp8-block", 1346),       # DeepGEMM grouped contiguous
    ("h800", (8192, 7168, 2048), 4, "fp8-block", 1214),
])
def test_the_model_reproduces_the_kernel_measurements_its_constants_come_from(gpu, shape, groups, precision,
                                                                              measured):
    model = GemmModel(GPUS[gpu], clock=1.0, attention_clock=1.0)  # benchmarks: seconds of calls at the boost clock
    tflops = 2 * groups * shape[0] * shape[1] * shape[2] / model.gemm(*shape, precision, groups) / 1e12
    assert tflops == pytest.approx(measured, rel=0.05)


def test_a_training_run_holds_the_sustained_clock_not_the_benchmarks_boost():
    # the H100 lent here: 8192^3 BF16 at 787 TFLOPS over its first calls, a median 672 over 30 s at the 700 W cap
    shape = (8192, 8192, 8192)
    sustained = 2 * 8192 ** 3 / H100.gemm(*shape, "bf16") / 1e12
    burst = 2 * 8192 ** 3 / GemmModel(GPUS["h100"], clock=1.0, attention_clock=1.0).gemm(*shape, "bf16") / 1e12
    assert sustained == pytest.approx(672, rel=0.05) and burst == pytest.approx(787, rel=0.05)
    assert H100.attention(1e12) == pytest.approx(GemmModel(GPUS["h100"], clock=1.0, attention_clock=1.0).attention(1e12) / 0.93)


def test_a_flat_efficiency_prices_flops_only():
    flat = GemmModel(GPUS["h100"], 0.6)
    assert flat.gemm(100, 200, 300, "bf16", 3) == pytest.approx(2 * 3 * 100 * 200 * 300 / (989e12 * 0.6))
    assert flat.memory(1e9) == 0.0
    with pytest.raises(ValueError, match="GEMM precision 'fp4' is not allowed"):
        flat.gemm(1, 1, 1, "fp4")


def test_fp8_linears_and_the_shape_model_change_the_planned_step():
    config = load_config(CONFIGS / "deepseek-v3.toml")  # its linears FP8 (model.linear_precision): fp8-block GEMMs
    machine = Machine(GPUS["h800"], 8)
    options = Options("selective", "fused-fp8", "deepseek-v3", sample_tokens=256)
    plain, fp8 = make_plan(config, machine, replace(options, linears="bf16")), make_plan(config, machine, options)
    assert make_plan(config, machine, replace(options, linears="fp8-block")).stage_costs == fp8.stage_costs
    assert fp8.stage_costs[1].f < plain.stage_costs[1].f  # dense projections at the FP8 peak
    for cost in plain.stage_costs:  # a backward does about twice a forward's work; W is part of it
        assert 1.5 * cost.f < cost.b < 3 * cost.f and 0 < cost.w < cost.b


def test_paired_halves_hide_their_ep_exchanges_behind_each_other_up_to_the_other_half():
    # comm_f = 0.5 s of TP collectives + 1.5 s of EP exchanges, comm_b = 0.5 + 3.0
    cost = StageCost(f=1.0, b=2.0, w=0.5, comm_f=2.0, comm_b=3.5, ep_f=1.5, ep_b=3.0)
    (all_of_it,) = paired([cost], 0.1, 1.0)
    assert all_of_it.ep_f == pytest.approx(0.15)  # 1.5 hides behind the B's 2.0: only its SMs' share
    assert all_of_it.ep_b == pytest.approx(2.0)  # 3.0 behind the F's 1.0: 2.0 left exposed
    assert (all_of_it.comm_f, all_of_it.comm_b) == pytest.approx((0.5 + 0.15, 0.5 + 2.0))  # TP stays exposed
    (half,) = paired([cost], 0.1, 0.5)  # half of what the other half could cover
    assert (half.ep_f, half.ep_b) == pytest.approx((0.15 + 0.5 * 1.35, 2.0 + 0.5 * 1.0))
    (none,) = paired([cost], 0.1, 0.0)
    assert (none.comm_f, none.comm_b) == (cost.comm_f, cost.comm_b)
    assert (half.f, half.b, half.w, half.slots) == (cost.f, cost.b, cost.w, cost.slots)


def test_one_stage_pairs_consecutive_micro_batches_as_megatron_core_s_ep_overlap():
    """Without a pipeline every micro-batch runs its F and B in turn; paired, each pair's halves hide each other's EP
    exchanges (timing.paired), so the step is the micro-batches times a paired F + B, and sharing nothing changes
    nothing."""
    config = load_config(CONFIGS / "qwen3-30b-a3b.toml", ["parallel.pp=1", "parallel.dp=16", "parallel.ep=16",
                                                         "parallel.schedule=none", "train.grad_accum_steps=1024"])
    machine = Machine(GPUS["h100"], 8, pair_hidden=1.0)
    alone, pairs = make_plan(config, machine), make_plan(config, machine, Options(paired=True))
    (cost,) = alone.stage_costs
    (priced,) = paired([cost], machine.comm_sm_share, 1.0)
    assert cost.ep_f > 0 and alone.makespan == pytest.approx(64 * cost.serial)
    assert pairs.makespan == pytest.approx(64 * priced.serial) and pairs.makespan < alone.makespan - 64 * cost.ep_f / 2
    none = make_plan(config, Machine(GPUS["h100"], 8, pair_hidden=0.0), Options(paired=True))
    assert none.makespan == pytest.approx(alone.makespan)


def test_interleaved_stages_shrink_the_bubble_not_the_work():
    config = load_config(CONFIGS / "mixtral-8x22b.toml")
    machine = Machine(GPUS["h100"], 8)
    one, seven = make_plan(config, machine), make_plan(config, machine, Options(virtual_stages=7))
    assert seven.idle_fraction < one.idle_fraction / 3
    assert seven.makespan < one.makespan
    busy = [(1 - i) * one.makespan for i in one.idle_fractions]
    assert [(1 - i) * seven.makespan for i in seven.idle_fractions] == pytest.approx(busy)


def test_memory_bound_ops_grow_with_the_quantisation_fp8_linears_need():
    cfg = load_config(CONFIGS / "qwen3-235b-a22b.toml").model
    attention = attention_shape(cfg)
    seconds = {p: elementwise_seconds(H100, cfg, attention, 5, 4096, 2, True, 2, Precisions(p, p)) for p in PRECISIONS}
    assert seconds["bf16"].f < seconds["fp8-block"].f < seconds["fp8-tensor"].f  # an amax pass more than 1x128 tiles
    assert seconds["bf16"].b == pytest.approx(2 * seconds["bf16"].f) and seconds["bf16"].w == 0
    assert elementwise_seconds(GemmModel(GPUS["h100"], 0.6), cfg, attention, 5, 4096, 2, True, 2,
                               Precisions()).f == 0  # a flat efficiency prices FLOPs only


def test_an_moe_layer_pays_its_routed_slots_half_forward_half_backward_and_a_dense_layer_none():
    """GemmModel.routed_slots: T / tp x top_k slots a layer at slot_seconds each, split evenly between F and B;
    nothing for a dense layer nor under a flat efficiency."""
    cfg = load_config(CONFIGS / "deepseek-v3.toml").model
    att, tokens, tp = attention_shape(cfg), 4096, 2
    args = (cfg, att, cfg.first_k_dense, 4096, tokens, tp, 64, Precisions())
    with_slots, without = (layer_seconds(replace(H100, slot_seconds=s), *args) for s in (1e-6, 0.0))
    handling = tokens / tp * cfg.top_k * 1e-6 / 2
    assert with_slots.f == pytest.approx(without.f + handling) and with_slots.b == pytest.approx(without.b + handling)
    assert with_slots.w == without.w
    dense = (cfg, att, 0, 4096, tokens, tp, 64, Precisions())
    assert layer_seconds(replace(H100, slot_seconds=1e-6), *dense) == layer_seconds(replace(H100, slot_seconds=0.0),
                                                                                   *dense)
    assert GemmModel(GPUS["h100"], flat=0.6, slot_seconds=1e-6).routed_slots(1e6) == 0.0


def test_the_last_stage_carries_the_mtp_depths_time_and_exchanges():
    """model.mtp_depth = 1 adds to the last stage an MoE block, its eh_proj ([2h] -> h) and a second LM head, and
    one MoE layer's EP bytes to the ranks holding it; the other stages are unchanged."""
    machine = Machine(GPUS["h800"], 8)
    plans = [make_plan(load_config(CONFIGS / "deepseek-v3.toml", [f"model.mtp_depth={d}"]), machine, Options())
             for d in (0, 1)]
    (without, with_mtp), cfg = plans, plans[1].config.model
    assert with_mtp.stage_costs[:-1] == without.stage_costs[:-1]
    slot = H800.routed_slots(4096 * cfg.top_k)  # what one MoE layer's slots cost a chunk: the MTP block adds one
    assert with_mtp.stage_costs[-1].slots == pytest.approx(without.stage_costs[-1].slots + slot)
    first_moe_layers = sum(i >= cfg.first_k_dense for i in with_mtp.layers[0])
    assert with_mtp.stage_costs[0].slots == pytest.approx(slot * first_moe_layers)
    tokens, tp = 4096, 1
    block = (layer_seconds(H800, cfg, attention_shape(cfg), cfg.num_layers, 4096, tokens, tp, 64, Precisions.of(cfg))
             + elementwise_seconds(H800, cfg, attention_shape(cfg), cfg.num_layers, tokens, tp, False, 2,
                                   Precisions.of(cfg)))
    eh_proj, head = H800.gemm(tokens, cfg.hidden_size, 2 * cfg.hidden_size, Precisions.of(cfg).dense), H800.gemm(
        tokens, cfg.padded_vocab_size, cfg.hidden_size, "bf16")
    head += H800.memory(2 * 2 * tokens * cfg.padded_vocab_size)  # its loss reads the BF16 logits twice
    assert with_mtp.stage_costs[-1].f - without.stage_costs[-1].f == pytest.approx(block.f + eh_proj + head)
    moe = [sum(i >= cfg.first_k_dense for i in span) for span in with_mtp.layers]
    for rank, before in zip(with_mtp.ranks, without.ranks):  # DualPipe: every rank visits its two stages equally
        extra = 1 if len(with_mtp.layers) - 1 in rank.stages else 0
        calls = sum(moe[s] for s in rank.stages)
        want = before.bytes["ep"].inter_payload * (calls + extra) / calls
        assert rank.bytes["ep"].inter_payload == pytest.approx(want)
