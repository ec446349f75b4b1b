"""launch.plan.kinds.step_kinds: moe-plan's step of one rank by kind of work sums to the planner's step of that rank
(configs/gpu-1x.toml on the H100 preset, configs/tiny.toml's pipelined layout on each rank), each kind follows its
own term, and `moe-plan --measure-gpu` prints a trainer row's kinds measured beside moe-plan's and torchtitan's."""

import json
import re

import pytest

from launch.config.run import load_config
from launch.plan.cli import main as moe_plan
from launch.plan.compute import ATTENTION, EXPERT_GEMM, OPTIMIZER, ROUTING, WORK_KINDS
from launch.plan.kinds import PRICED, step_kinds
from launch.plan.planner import Machine, Options, make_plan
from launch.plan.presets import gpu_preset
from launch.plan.profile import Profile, StageSeconds

GPU_1X, TINY = "configs/gpu-1x.toml", "configs/tiny.toml"
H100 = Machine(gpu_preset("h100"), 1)


def _rank_step(plan, rank):
    """The planner's own step of pipeline rank `rank`: its busy time in the simulated pipeline steps (the makespan
    less its idle share) plus the gradient sync and the offloaded optimizer's copies after them."""
    busy = plan.makespan * (1 - plan.idle_fractions[rank])
    return plan.pipeline_steps * busy + plan.dp_sync_seconds + plan.offload_seconds


@pytest.mark.parametrize("options", [Options(), Options(recompute="full"), Options(paired=True)])
def test_gpu_1x_kinds_sum_to_the_plans_step(options):
    plan = make_plan(load_config(GPU_1X), H100, options)
    kinds = step_kinds(plan)
    assert tuple(kinds) == PRICED and OPTIMIZER not in kinds  # moe-plan prices no optimizer step
    assert all(seconds >= 0 for seconds in kinds.values())
    assert sum(kinds.values()) == pytest.approx(plan.step_seconds, rel=1e-9)
    assert kinds[EXPERT_GEMM] > 0 and kinds[ATTENTION] > 0 and kinds[ROUTING] > 0


@pytest.mark.parametrize("recompute", ["none", "full", "layer"])
@pytest.mark.parametrize("rank", [0, 1])
def test_tiny_layouts_kinds_sum_to_each_ranks_step(rank, recompute):
    """DualPipeV over 2 pipeline ranks, F&B pairs overlapped, EP exchanges and the DP sync priced: every rank's kinds
    sum to its busy time in the pipeline plus the sync (the bubble is no kind)."""
    config = load_config(TINY)
    plan = make_plan(config, Machine(gpu_preset("h100"), config.parallel.gpus_per_node), Options(recompute))
    kinds = step_kinds(plan, rank)
    assert sum(kinds.values()) == pytest.approx(_rank_step(plan, rank), rel=1e-9)
    assert kinds["communication"] > plan.dp_sync_seconds > 0  # the exchanges' exposed part and the sync
    assert sum(kinds.values()) < plan.step_seconds  # rank 0 and 1 idle some of the DualPipeV step


def test_a_kind_moves_with_its_own_term():
    """Twice the attention heads doubles flash attention's core and leaves the routed experts' GEMMs alone; twice the
    experts' width does the converse."""
    base = step_kinds(make_plan(load_config(GPU_1X), H100))
    heads = step_kinds(make_plan(load_config(GPU_1X, ["model.num_heads=64"]), H100))
    assert base[ATTENTION] > 0 and heads[ATTENTION] == pytest.approx(2 * base[ATTENTION], rel=1e-12)
    assert heads[EXPERT_GEMM] == base[EXPERT_GEMM] and heads[ROUTING] == base[ROUTING]
    wide = step_kinds(make_plan(load_config(GPU_1X, ["model.expert_ffn_size=1536"]), H100))
    assert wide[EXPERT_GEMM] > 1.5 * base[EXPERT_GEMM] and wide[ATTENTION] == base[ATTENTION]


def test_a_plan_from_a_measured_profile_has_no_kinds():
    config = load_config(GPU_1X)
    plan = make_plan(config, Machine(gpu_preset("h100"), 1, profile=Profile([StageSeconds(1.0, 1.4, 0.6)], 1, 1)))
    with pytest.raises(ValueError, match="measured profile"):
        step_kinds(plan)


def _trainer(name, measured, planned, total):
    return {"row": name, "status": "ok", "step_ms": 80.0, "plan_step_ms": sum(planned.values()), "tokens_per_s": 1.0,
            "breakdown": {"ms": measured, "total_ms": total, "measured": "CUDA kernels' device time"},
            "plan_breakdown": planned}


def test_measure_gpu_prints_each_kind_measured_beside_moe_plan_and_torchtitan(tmp_path, capsys):
    planned = dict.fromkeys(PRICED, 0.0) | {EXPERT_GEMM: 10.0, ATTENTION: 4.0, ROUTING: 20.0, "GEMM": 16.0}
    ours = {EXPERT_GEMM: 15.0, ATTENTION: 5.0, "GEMM": 16.0, ROUTING: 6.0, OPTIMIZER: 3.0, "other": 1.0}
    theirs = {EXPERT_GEMM: 30.0, ATTENTION: 4.0, "GEMM": 12.0, OPTIMIZER: 2.0}
    peer = {"row": "trainer-torchtitan", "status": "ok", "tokens_per_s": 0.5,
            "breakdown": {"ms": theirs, "total_ms": 48.0, "measured": "CUDA kernels' device time"}}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"rows": [_trainer("trainer-eager", ours, planned, 46.0), peer]}))
    got = moe_plan_out(path, capsys)
    assert "trainer-eager: its profiled step by kind of work" in got and "trainer-torchtitan's profiled step" in got
    lines = _cells(got)
    assert lines[EXPERT_GEMM] == ["15.000", "10.000", "1.500", "30.000", "0.500"]
    assert lines["GEMM"] == ["16.000", "16.000", "1.000", "12.000", "1.333"]
    assert lines[ROUTING] == ["6.000", "20.000", "0.300", "-", "-"]
    assert lines[OPTIMIZER] == ["3.000", "-", "-", "2.000", "1.500"]  # no prediction: "-"
    assert lines["other"] == ["1.000", "-", "-", "-", "-"]
    assert lines["total"] == ["46.000", "50.000", "0.920", "48.000", "0.958"]
    assert "FP8 quantise" not in got  # nothing measured, predicted 0


def test_measure_gpu_without_torchtitans_row_prints_no_peer_column(tmp_path, capsys):
    planned = dict.fromkeys(PRICED, 0.0) | {EXPERT_GEMM: 10.0}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"rows": [_trainer("trainer-fp8", {EXPERT_GEMM: 12.0}, planned, 12.0)]}))
    got = moe_plan_out(path, capsys)
    assert "torchtitan" not in got
    assert _cells(got)[EXPERT_GEMM] == ["12.000", "10.000", "1.200"]


def _cells(out):
    """A printed table's rows by their first cell (cells are separated by two spaces or more)."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()]
    return {row[0]: row[1:] for row in rows if row[0] in (*WORK_KINDS, "other", "total")}


def moe_plan_out(path, capsys):
    capsys.readouterr()
    assert moe_plan(["--measure-gpu", str(path)]) == 0
    return capsys.readouterr().out
