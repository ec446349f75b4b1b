"""moe-plan against measured runs of the trainer's own pieces (model stages, pipeline runtime, EP dispatch,
ZeRO-1) on 4 gloo ranks over 2 simulated nodes: the EPDispatcher counters equal dispatch.predict on the
routings the routers chose, the p2p payload bytes equal the planned ones exactly, parameters and
optimizer bytes per rank are within 1%, the activations saved for backward within 10% (also per train.recompute
mode); the pipeline bubble check on given timings, and this machine's profiled plan and measured idle well formed
(moe-plan --measure compares their values: they follow the machine's load)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from launch.parallel.spawn import run_processes
from launch.config.run import load_config
from launch.plan.measure import IDLE_TOLERANCE, MeasuredFigure, RankMeasure, compare, cpu_machine, measure, measure_rank
from launch.plan.planner import Machine, Options, make_plan
from launch.plan.presets import GPUS
from launch.plan.profile import Profile, StageSeconds
from moe.recompute import RECOMPUTE

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"
# 1F1B over pp=2 x dp=2, EP over the 2 ranks of a stage, nodes of 2: EP inside a node, p2p across nodes
LAYOUT = ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.gpus_per_node=2", 'parallel.schedule="1f1b"',
          'parallel.dispatch_backend="flat"', 'parallel.dispatch_payload="fp8"', "train.seq_len=64",
          "train.grad_accum_steps=8"]


def test_measured_bytes_memory_and_params_match_the_plan():
    config = load_config(TINY, LAYOUT)
    plan = make_plan(config, Machine(GPUS["h800"], config.parallel.gpus_per_node))
    checks = compare(plan, measure(config, steps=1, timeout_s=240))
    assert len(checks) == 4 * 12 + 3
    failed = [c for c in checks if c.ok is False and not c.figure.startswith("pipeline bubble")]
    assert not failed, failed
    crossed = {c.figure for c in checks if c.tolerance == 0 and c.measured > 0}
    assert {"PP p2p bytes inter", "EP bytes intra (routing seen)"} <= crossed


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_measured_cp2_activations_and_bytes_match_the_plan(method):
    # the tiny config's DualPipeV pp2 x ep2 layout with its DP ranks turned into CP ranks: each holds half of every
    # sequence (its routing, hence each rank's expert slots, is deterministic: the figures do not vary run to run)
    config = load_config(TINY, ["parallel.dp=1", "parallel.cp=2", f'parallel.cp_method="{method}"'])
    plan = make_plan(config, Machine(GPUS["h800"], config.parallel.gpus_per_node))
    checks = compare(plan, measure(config, steps=1, timeout_s=240))
    failed = [c for c in checks if c.ok is False and not c.figure.startswith("pipeline bubble")]
    assert not failed, failed
    assert len([c for c in checks if c.figure.startswith("activation peak bytes, max") and c.ok]) == 2


# 1F1B over 2 ranks: the first stage (the embedding and 2 layers) is lighter than the last (2 MoE layers and the head)
PP2_1F1B = ["parallel.pp=2", "parallel.dp=1", "parallel.ep=1", 'parallel.schedule="1f1b"', "train.seq_len=64"]


def _idle_only(rank: int, idle: float) -> RankMeasure:
    """Pipeline rank `rank` of PP2_1F1B having measured `idle`, and no other figure."""
    return RankMeasure(rank, rank, 0, 0, 0, {}, 0, idle, {}, {})


def test_the_bubble_check_compares_the_plans_idle_shares_with_given_timings():
    """What moe-plan --measure computes from the idle it measures, on given timings (wall-clock on a shared machine
    moves with its load: comparing this machine's measured idle with its profiled plan is the command's job, which
    prints it, not a test's): each rank's idle beside the plan's (shown), the bubble as the ranks' mean checked within
    IDLE_TOLERANCE of the plan's. The first stage waits more where it is the lighter: in the FLOPs model of the tiny
    config and in the simulator on a profile saying so."""
    config = load_config(TINY, PP2_1F1B)
    flops = make_plan(config, Machine(GPUS["h800"], 2)).idle_fractions
    assert flops[0] > flops[1] > 0, flops
    light, heavy = StageSeconds(f=1.0, b=1.4, w=0.6), StageSeconds(f=1.5, b=2.1, w=0.9)
    plan = make_plan(config, Machine(GPUS["h800"], 2, profile=Profile([light, heavy], ranks=2, cores=2)))
    idle = plan.idle_fractions
    assert 0 < idle[1] < idle[0] < 1 and plan.idle_fraction == pytest.approx(statistics.mean(idle), abs=1e-12)
    for off, ok in [(0.0, True), (0.049, True), (-0.049, True), (0.051, False), (-0.051, False)]:
        given = [idle[0] + off + 0.02, idle[1] + off - 0.02]  # their mean off the plan's bubble by `off`
        checks = compare(plan, [_idle_only(0, given[0]), _idle_only(1, given[1])])
        ranks = [c for c in checks if c.figure == "pipeline idle fraction"]
        assert [(c.rank, c.predicted, c.measured, c.tolerance) for c in ranks] == [
            (r, idle[r], given[r], None) for r in range(2)]
        bubble, = [c for c in checks if c.figure.startswith("pipeline bubble")]
        assert (bubble.rank, bubble.predicted, bubble.tolerance, bubble.absolute) == (
            -1, plan.idle_fraction, IDLE_TOLERANCE, True)
        assert bubble.measured == pytest.approx(plan.idle_fraction + off, abs=1e-12) and bubble.ok is ok, (off, bubble)


def test_this_machines_profiled_plan_and_measured_idle_are_well_formed():
    """moe-plan --measure's pipeline figures on this machine: stage costs profiled here (cpu_machine), then the
    pipeline run. Their values follow the machine's load (a loaded one has had rank 1 wait more than rank 0), so
    only what holds under any load is checked: the profile's positive seconds give the plan's idle shares, each
    rank measures an idle fraction (1 - its busy time / the step's) in [0, 1), and compare() lines them up."""
    config = load_config(TINY, PP2_1F1B)
    machine = cpu_machine(config, repeats=2)
    stages = machine.profile.stages
    assert len(stages) == 2 and all(s.f > 0 and s.b > 0 and s.w >= 0 for s in stages), stages
    plan = make_plan(config, machine)
    assert all(0 <= idle < 1 for idle in plan.idle_fractions) and 0 <= plan.idle_fraction < 1
    measured = measure(config, steps=3, timeout_s=240)  # the median of steps 2 and 3 (the first warms up)
    assert [m.pp_rank for m in measured] == [0, 1] and all(0 <= m.idle < 1 for m in measured), measured
    checks = compare(plan, measured)
    assert [(c.predicted, c.measured) for c in checks if c.figure == "pipeline idle fraction"] == [
        (plan.idle_fractions[m.pp_rank], m.idle) for m in measured]
    bubble, = [c for c in checks if c.figure.startswith("pipeline bubble")]
    assert bubble.measured == pytest.approx(statistics.mean(m.idle for m in measured)) and bubble.ok is not None


def test_the_bubble_is_checked_as_an_absolute_difference_of_idle_shares():
    # a share of time: 0.129 predicted against 0.158 measured is 0.029 off (18% relative, within 0.05)
    bubble = MeasuredFigure(-1, "pipeline bubble: idle share of all ranks' time", 0.129, 0.158, IDLE_TOLERANCE, absolute=True)
    assert bubble.ok and bubble.describe_error() == "-0.029" and bubble.describe_tolerance() == "±0.05"
    assert not MeasuredFigure(-1, "bubble", 0.10, 0.158, IDLE_TOLERANCE, absolute=True).ok
    relative = MeasuredFigure(0, "activation peak bytes", 105, 100, 0.10)
    assert relative.ok and relative.describe_error() == "+5.0%" and relative.describe_tolerance() == "10%"
    assert not MeasuredFigure(0, "bytes", 101, 100, 0).ok and MeasuredFigure(0, "bytes", 100, 100, 0).describe_tolerance() == "exact"


# MLA with v_head_dim = qk_nope + qk_rope: torch's CPU attention then takes its fused kernel (q, k, v, output and
# log-sum-exp kept, as the plan counts); narrower values take the composite path, which keeps the S x S probabilities
MLA = ['model.attention="mla"', "model.q_lora_rank=32", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16",
       "model.qk_rope_head_dim=8", "model.v_head_dim=24"]
ONE_PROCESS = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", 'parallel.schedule="none"',
               "train.grad_accum_steps=1"]


def _measure_each(rank: int, world: int, configs: list) -> list:
    return [measure_rank(rank, world, config, 1) for config in configs]


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_measured_activation_peak_of_each_recompute_mode_matches_the_plan(attention):
    # the tiny config on one process (1 dense + 3 MoE layers and the head, 2 x 128 tokens): the saved bytes drop from
    # none to selective to full, and moe-plan predicts each within 10%
    configs = [load_config(TINY, ONE_PROCESS + (MLA if attention == "mla" else []) + [f'train.recompute="{mode}"'])
               for mode in RECOMPUTE]
    measured = run_processes(_measure_each, 1, configs, timeout_s=240)[0]
    peaks = []
    for config, m in zip(configs, measured):
        checks = compare(make_plan(config, Machine(GPUS["h800"], 1), Options(config.train.recompute)), [m])
        check = next(c for c in checks if c.figure.startswith("activation peak bytes, max"))
        assert check.ok, (config.train.recompute, check)
        peaks.append(m.activation_peak)
    assert peaks[0] > 1.3 * peaks[1] and peaks[1] > 2 * peaks[2], peaks
