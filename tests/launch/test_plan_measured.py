"""moe-plan against measured runs of the trainer's own pieces (model stages, pipeline runtime, EP dispatch,
ZeRO-1) on 4 gloo ranks over 2 simulated nodes: the EPDispatcher counters equal dispatch.predict on the
routings the routers chose, the p2p payload bytes equal the planned ones exactly, parameters and
optimizer bytes per rank are within 1%, the activations saved for backward within 10%; on a machine profiled
here the predicted pipeline bubble follows the measured idle."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.config import load_config
from launch.plan.measure import compare, cpu_machine, measure
from launch.plan.planner import Machine, make_plan
from launch.plan.presets import GPUS

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
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


def test_predicted_bubble_on_this_machine_tracks_the_measured_idle():
    # 1F1B over 2 ranks on 2 cores: stage costs profiled here, then the pipeline run. moe-plan --measure shows
    # the bubble within 15% (the acceptance); this test allows 35% so a loaded CI machine does not flake it, and
    # still fails on a wrong cost model or schedule (the FLOPs model on this CPU was off by -98% to +370%)
    config = load_config(TINY, ["parallel.pp=2", "parallel.dp=1", "parallel.ep=1", 'parallel.schedule="1f1b"',
                                "train.seq_len=64"])
    plan = make_plan(config, cpu_machine(config, repeats=4))
    checks = compare(plan, measure(config, steps=8, timeout_s=240))
    bubble = next(c for c in checks if c.figure.startswith("pipeline bubble"))
    assert abs(bubble.error) <= 0.35, bubble
    idle = {c.rank: c for c in checks if c.figure == "pipeline idle fraction"}
    # the first stage (the embedding and 2 layers) is lighter than the last (2 MoE layers and the head): it waits more
    assert idle[0].predicted > idle[1].predicted and idle[0].measured > idle[1].measured, idle
