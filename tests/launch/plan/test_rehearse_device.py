"""moe-train --rehearse --device cpu|cuda: one rank's real stages run a step of N micro-batches under the fake process
group, routed by the rehearsal rule, every fake collective receiving what the rank sends itself; memory by category
and each phase's time beside moe-plan's; moe-plan --measure-gpu reads the report back."""

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.testing._internal.distributed.fake_pg import FakeStore

import launch.parallel.stages
from launch.config.run import load_config
from dispatch.progress import ACTION, EXCHANGE
from launch.plan.cli import main as moe_plan
from launch.plan.phases import phase_rows, planned_comm
from launch.plan.timing import StageCost
from pipeline.schedules import Action, Op
from launch.plan.rehearse import Collectives, RehearsalMode, real_device_config, rehearse
from launch.train_cli import main

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny.toml"
NAN = float("nan")


def test_fake_collectives_receive_what_this_rank_sends_itself():
    """Rank 1 of 3: an all-to-all's every part is the rows it sends itself, an all-gather's every part its own
    tensor, a reduce-scatter its own share, a pipeline receive zeros; no receive buffer keeps its NaNs."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    try:
        rows = torch.arange(6.0).view(6, 1)
        exchanged, gathered, reduced, received = (torch.full(shape, NAN) for shape in ((6, 1), (3, 2), (2,), (4,)))
        with RehearsalMode(torch.device("cpu"), Collectives()):
            dist.all_to_all_single(exchanged, rows, output_split_sizes=[2, 2, 2], input_split_sizes=[1, 2, 3])
            dist.all_gather_into_tensor(gathered, torch.tensor([7.0, 8.0]))
            dist.reduce_scatter_tensor(reduced, torch.arange(6.0))
            dist.recv(received, 0)
    finally:
        dist.destroy_process_group()
    assert exchanged.flatten().tolist() == [1.0, 2.0] * 3  # rank 1's own part, rows 1 and 2
    assert gathered.tolist() == [[7.0, 8.0]] * 3
    assert reduced.tolist() == [2.0, 3.0]
    assert received.tolist() == [0.0] * 4


def test_each_action_is_priced_as_moe_plan_prices_it():
    """F: f; a split B: b - w; a W merging 2 chunks: 2 w; an F&B pair: its F's f plus its B's b; the MoE forward's
    parts sit inside their F; communication: comm_f per forward half, comm_b per backward half."""
    costs = [StageCost(f=1.0, b=3.0, w=1.0, comm_f=0.5, comm_b=0.25), StageCost(2.0, 6.0, 2.0, 1.0, 0.125)]
    actions = [Action(Op.F, 0, 0), Action(Op.B, 1, 0, split=True), Action(Op.W, 1, 0, merged=(1,)),
               Action(Op.FB, 0, 1, backward=Action(Op.B, 1, 1))]
    intervals = [("F of stage 0 chunk 0", ACTION, 0.1), ("dispatch", EXCHANGE, 0.01),
                 ("B of stage 1 chunk 0", ACTION, 0.2), ("SEND_B of stage 1 chunk 0", ACTION, 0.05),
                 ("W of stage 1 chunk 0", ACTION, 0.3), ("FB of stage 0 chunk 1", ACTION, 0.4),
                 ("optimizer step", ACTION, 0.5)]
    rows = {p.name: p for p in phase_rows(intervals, costs, actions, lambda phase: phase)}
    assert {name: row.planned for name, row in rows.items()} == {
        "F stage 0": 1.0, "dispatch (MoE forward)": None, "B stage 1": 4.0, "p2p send/recv (local)": None,
        "W stage 1": 4.0, "F&B stage 0+1": 7.0, "optimizer step": None}
    assert rows["dispatch (MoE forward)"].inside == "F" and rows["W stage 1"].seconds == 0.3
    assert planned_comm(costs, actions, lambda phase: phase, 2) == 0.5 + 0.125 + 0.5 + 0.125


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: a shared 2-core machine runs tiny ops faster without OpenMP's spinning threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory, one_thread):
    """The tiny config's busiest rank (2 of 4: DualPipeV pp 2 x dp 2, EP 2 hierarchical over 2 nodes) rehearsed on the
    CPU through the CLI, 4 micro-batches: its printout, its JSON report, and whether every param stayed finite."""
    path = tmp_path_factory.mktemp("rehearsal") / "report.json"
    finite = []

    def check(optimizer, *_):
        finite.append(all(torch.isfinite(p).all() for g in optimizer.param_groups for p in g["params"]))

    hook = register_optimizer_step_post_hook(check)
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["--config", str(TINY), "--rehearse", "--device", "cpu", "--json", str(path)])
    finally:
        hook.remove()
    return code, out.getvalue(), json.loads(path.read_text()), finite, path


def test_cpu_rehearsal_issues_the_meta_rehearsals_collectives_byte_for_byte(cpu_report):
    """Routing forced to the rule and the receive buffers filled by it: the real step sends exactly what the meta
    rehearsal of the same step (whose counts are the rule's) sends, collective by collective; params stay finite."""
    code, _, report, finite, _ = cpu_report
    assert code == 0 and finite and all(finite)
    meta = rehearse(real_device_config(load_config(TINY), None), rank=report["rank"])
    sent = [(c["kind"], c["group"], c["calls"], c["bytes"]) for c in report["collectives"]]
    assert sent == meta.collectives.rows()
    for category in ("params", "grads", "optimizer"):  # fp32 model states: the tracker sees the meta rehearsal's
        assert report["memory"]["measured"][category] == meta.peak[category], category
        assert report["memory"]["measured"][category] == pytest.approx(report["memory"]["planned"][category], rel=0.01)


def test_cpu_rehearsal_times_every_action_of_the_schedule_beside_moe_plan(cpu_report):
    code, out, report, _, _ = cpu_report
    assert (report["rank"], report["world_size"], report["device"], report["micro_batches"]) == (2, 4, "cpu", 4)
    phases = {p["name"]: p for p in report["phases"]}
    priced = [p for p in phases.values() if p["planned"] is not None]
    # DualPipeV on pp 2, 4 chunks: rank 1 holds stages 1 and 2; its F, B, W and F&B actions, each beside the plan
    assert {p["name"].split(" stage")[0] for p in priced} >= {"F", "B", "W"}
    assert not any("unmatched" in name for name in phases)
    assert {"dispatch (MoE forward)", "experts (MoE forward)", "combine (MoE forward)", "optimizer step"} <= set(phases)
    assert all(p["seconds"] > 0 and math.isfinite(p["seconds"]) for p in phases.values())
    assert report["planned_comm_s"] > 0 and report["planned_step_s"] > 0
    assert "phases of the step, timed by the host clock" in out
    assert "communication is not measured" in out and "predicted step: measured" in out


def test_moe_plan_measure_gpu_prints_ratios_of_a_rehearsal_report(cpu_report, capsys):
    *_, path = cpu_report
    assert moe_plan(["--measure-gpu", str(path)]) == 0
    carried = capsys.readouterr().out
    assert "as the report carries it" in carried and "memory params GiB" in carried and "measured / plan" in carried
    assert moe_plan([str(TINY), "--measure-gpu", str(path)]) == 0  # today's planner prices the same marks again
    replanned = capsys.readouterr().out
    assert "re-planned now" in replanned
    assert replanned.split("\n", 1)[1] == carried.split("\n", 1)[1]  # the same planner: the same ratios


def test_moe_plan_measure_gpu_refuses_a_file_without_results(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"header": {}, "rows": [{"row": "x"}]}))
    assert moe_plan(["--measure-gpu", str(path)]) == 2
    assert "no rehearsal report and no trainer row" in capsys.readouterr().err


@torch.library.custom_op("moetest::out_of_memory", mutates_args=())
def _out_of_memory(x: torch.Tensor) -> torch.Tensor:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_an_out_of_memory_names_the_op_and_the_trackers_bytes_and_exits_1(monkeypatch, capsys, one_thread):
    real = launch.parallel.stages.lm_loss

    def planted(logits, *args, **kwargs):
        torch.ops.moetest.out_of_memory(logits)
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(launch.parallel.stages, "lm_loss", planted)
    code = main(["--config", str(TINY), "--rehearse", "--device", "cpu", "--set", "parallel.pp=1",
                 "--set", "parallel.schedule='none'"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "out of memory on cpu in moetest.out_of_memory.default at" in err and "test_rehearse_device.py" in err
    assert "the memory tracker held" in err and "Parameter" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the rehearsal would run")
def test_a_cuda_rehearsal_without_cuda_exits_2_naming_why(capsys):
    assert main(["--config", str(TINY), "--rehearse", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: torch" in err and "sees no CUDA GPU here; allowed: meta, cpu" in err


def test_micro_batches_belong_to_a_real_device(capsys):
    with pytest.raises(SystemExit):
        main(["--config", str(TINY), "--rehearse", "--micro-batches", "2"])
    assert "--micro-batches 2 sets a real device's step" in capsys.readouterr().err
    assert main(["--config", str(TINY), "--rehearse", "--device", "cpu", "--micro-batches", "2"]) == 2
    assert "parallel.num_chunks = 2 is too small for schedule 'dualpipev'" in capsys.readouterr().err
