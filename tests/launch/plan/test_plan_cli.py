"""moe-plan command line: bad input is a clear error naming the field; a search ranks the layouts that fit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from launch.config.run import load_config
from launch.plan.cli import main
from launch.plan.efficiency import ATTENTION_SUSTAINED_CLOCK, SLOT_SECONDS, SUSTAINED_CLOCK
from launch.plan.planner import Machine, make_plan
from launch.plan.presets import GPUS
from launch.plan.search import search
from launch.plan.timing import StageCost, action_seconds
from pipeline.schedules import Action, Op

TINY = str(Path(__file__).resolve().parents[3] / "configs" / "tiny.toml")


@pytest.mark.parametrize("argv, message", [
    (["--set", "parallel.pp=8", "--set", "parallel.dp=1", "--set", "parallel.ep=1", "--set",
      "train.grad_accum_steps=16"], "model.num_layers = 4 is fewer than the 16 pipeline stages"),
    (["--set", "parallel.ep=3"], "parallel.ep = 3 must divide dp x cp x tp"),
    (["--set", "parallel.cp=2", "--set", "parallel.dp=1", "--set", "train.seq_len=34"],
     "train.seq_len = 34 must be divisible by 2 x parallel.cp = 4"),
    (["--gpu", "a100"], "--gpu 'a100' is not a known GPU; choose one of h800, h100, h200, b200, gb200"),
    (["--peak-tflops", "100"], "--memory-gb, --intra-node-gbps, --inter-node-gbps must be given"),
    (["--gpu", "h100", "--inter-node-gbps", "0"], "--inter-node-gbps = 0.0 must be > 0"),
    (["--gpu", "h100", "--exchange-latency-us", "-1"], "--exchange-latency-us = -1.0 must be > 0 or 0"),
    (["--memory-gb", "inf"], "--memory-gb = inf must be a finite number"),
    (["--slot-ns", "nan"], "--slot-ns = nan must be a finite number"),
    (["--gpus-per-node", "0"], "--gpus-per-node = 0 must be >= 1"),
    (["--gpus", "8"], "--gpus 8 differs from the config's layout pp x dp x cp x tp = 4"),
    (["--search"], "--search needs --gpus N"),
    (["--measure", "--steps", "0"], "--steps = 0 must be >= 1"),
    (["--comm-sm-share", "1"], "--comm-sm-share = 1.0 must be in [0, 1)"),
    (["--slot-ns", "-1"], "--slot-ns = -1.0 must be >= 0"),
    (["--pair-hidden", "1.5"], "--pair-hidden = 1.5 must be in [0, 1]"),
    (["--clock", "0"], "--clock = 0.0 must be in (0, 1]"),
    (["--attention-clock", "1.5"], "--attention-clock = 1.5 must be in (0, 1]"),
    (["--virtual-stages", "2"], "virtual stages apply to parallel.schedule = '1f1b' only (this config: 'dualpipev')"),
    (["--paired-1f1b"], "paired 1F1B applies to parallel.schedule = '1f1b' or 'none'"),
    (["--virtual-stages", "0", "--set", 'parallel.schedule="1f1b"', "--set", "parallel.num_chunks=0"],
     "virtual stages = 0 must be >= 1"),
])
def test_bad_input_is_a_clear_error(argv, message, capsys):
    assert main([TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_search_ranks_fitting_layouts_by_step_time_and_gives_reasons_for_the_rest():
    config = load_config(TINY, ["train.grad_accum_steps=8"])
    tight = Machine(GPUS["h100"], 4)
    result = search(config, 4, tight)
    times = [p.step_seconds for p in result.ranked]
    assert times == sorted(times) and len(times) > 3
    assert {(p.config.parallel.pp, p.config.parallel.dp) for p in result.ranked} >= {(1, 4), (2, 2), (4, 1)}
    assert all(p.fits for p in result.ranked)
    assert any(p.config.parallel.tp > 1 for p in result.ranked)  # the trainer runs TP layouts
    assert any(p.config.parallel.cp > 1 for p in result.ranked)  # and CP layouts
    assert any("model.num_layers" in why for _, why in result.cut)  # dualpipev pp=4 needs 8 stages: cut, named
    # without a pipeline the chunk count changes nothing: one row per layout, not one per count
    flat = [(p.config.parallel.dp, p.config.parallel.cp, p.config.parallel.tp, p.config.parallel.ep)
            for p in result.ranked if p.config.parallel.pp == 1]
    assert flat and len(flat) == len(set(flat))


def test_exchange_latency_prices_three_exchanges_forward_and_two_backward_per_moe_layer():
    config = load_config(TINY)  # pp=2 DualPipeV: 4 stages of one layer each, layers 1-3 are MoE, EP over 2 nodes
    plain = make_plan(config, Machine(GPUS["h100"], 1))
    slow = make_plan(config, Machine(replace(GPUS["h100"], exchange_latency_us=100.0), 1))
    for stage, (a, b) in enumerate(zip(plain.stage_costs, slow.stage_costs)):
        moe = stage > 0
        assert b.comm_f - a.comm_f == pytest.approx(3 * 100e-6 * moe)
        assert b.comm_b - a.comm_b == pytest.approx(2 * 100e-6 * moe)
        assert (b.f, b.b, b.w) == (a.f, a.b, a.w)


@pytest.mark.parametrize("comm, seconds", [(0.5, 3.0 + 0.25 * 0.5), (2.0, 3.0 + 0.25 * 2.0), (4.0, 4.0)])
def test_communication_beside_a_pair_takes_its_share_of_the_sms(comm, seconds):
    # an F&B pair of 3 s compute with `comm` s of EP/TP exchanges beside it, a quarter of the SMs held while they
    # run: the compute finishes comm / 4 later, unless the exchanges outlast it (then they set the time)
    stage = StageCost(f=1.0, b=2.0, w=0.5, comm_f=comm / 2, comm_b=comm / 2)
    pair = Action(Op.FB, 0, 1, backward=Action(Op.B, 1, 0))
    assert action_seconds(pair, [stage, stage], lambda phase: phase, True, comm_share=0.25) == pytest.approx(seconds)
    assert action_seconds(pair, [stage, stage], lambda phase: phase, True) == pytest.approx(max(3.0, comm))


def test_a_measured_clock_reaches_the_plan_and_prices_gemms_and_attention(tmp_path):
    # the factors `moe-bench clock` measures on another GPU: the boost clock throughout (1) is faster than the
    # default H100-measured factors; the JSON names what was priced
    plans = {}
    for name, argv in {"default": [], "boost": ["--clock", "1", "--attention-clock", "1"]}.items():
        path = tmp_path / f"{name}.json"
        assert main([TINY, "--gpu", "h100", *argv, "--json", str(path)]) == 0
        plans[name] = json.loads(path.read_text())
    assert plans["boost"]["machine"]["clock"] == 1.0 and plans["default"]["machine"]["clock"] == SUSTAINED_CLOCK
    assert plans["default"]["machine"]["attention_clock"] == ATTENTION_SUSTAINED_CLOCK
    assert plans["boost"]["time"]["step_s"] < plans["default"]["time"]["step_s"]


def test_moe_handling_picks_its_fitted_slot_cost_and_slot_ns_overrides_it(tmp_path):
    """--moe-handling captured plans the captured stacks' routed-slot cost, synced (the default, this project's
    runtime) the synced one; --slot-ns overrides either; a captured plan is faster (fewer seconds a slot)."""
    seconds = {}
    for name, argv in (("default", []), ("captured", ["--moe-handling", "captured"]),
                       ("override", ["--moe-handling", "captured", "--slot-ns", "500"])):
        out = tmp_path / f"{name}.json"
        assert main([TINY, "--gpu", "h100", "--json", str(out), *argv]) == 0
        plan = json.loads(out.read_text())
        seconds[name] = (plan["machine"]["slot_seconds"], plan["time"]["step_s"])
    assert seconds["default"][0] == SLOT_SECONDS["synced"] and seconds["captured"][0] == SLOT_SECONDS["captured"]
    assert seconds["override"][0] == pytest.approx(500e-9)
    assert seconds["captured"][1] < seconds["default"][1] < seconds["override"][1]


def test_cuda_graphs_plan_the_captured_slot_cost_unless_a_flag_says_otherwise(tmp_path):
    """A config with train.cuda_graphs = true (issue 48; the padded exchange over its EP ranks) is planned as a
    captured runtime: the captured stacks' routed-slot cost, a faster step than the same config eager; an explicit
    --moe-handling still wins."""
    graphed = ["--set", "parallel.dispatch_exchange=padded", "--set", "train.cuda_graphs=true"]
    plans = {}
    for name, argv in (("eager", ["--set", "parallel.dispatch_exchange=padded"]), ("graphed", graphed),
                       ("flag", [*graphed, "--moe-handling", "synced"])):
        out = tmp_path / f"{name}.json"
        assert main([TINY, "--gpu", "h100", "--json", str(out), *argv]) == 0
        plans[name] = json.loads(out.read_text())
    slots = {name: plan["machine"]["slot_seconds"] for name, plan in plans.items()}
    assert slots == {"eager": SLOT_SECONDS["synced"], "graphed": SLOT_SECONDS["captured"], "flag": SLOT_SECONDS["synced"]}
    assert plans["graphed"]["time"]["step_s"] < plans["eager"]["time"]["step_s"]
