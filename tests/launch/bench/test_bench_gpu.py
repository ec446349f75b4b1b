"""moe-bench gpu on a machine without a GPU: the dry run lists every row with its shapes and budget, a real run exits
2 naming why, configs/gpu-1x.toml parses and fits one 80 GB GPU by moe-plan, the docs page comes from a result, and
torchtitan's MoE module (the moe-layer row's peer) computes our layer's output from the same weights and tokens."""

import importlib.util
import json

import pytest
import torch

from launch.bench import gpu
from launch.bench.cli import main as moe_bench
from launch.bench.layer import load_weights, model_config, our_weights
from launch.bench.peers.fwdbwd import decided_tokens, inputs, relative_error
from launch.bench.report import versions
from launch.config.run import load_config
from launch.plan.cli import main as moe_plan
from launch.plan.planner import Machine, make_plan
from launch.plan.presets import gpu_preset
from moe.layer import MoELayer
from tests.graph_replay import ReplayGraphs

BF16_U = 2.0 ** -8  # bf16's unit roundoff (8 significant bits)
# torchtitan's experts round x, w1, w3, w2 to bf16 and round each GEMM's output and the SwiGLU product to bf16:
# 7 roundings along the expert path, each at most u relative to its operand's scale, reaching the output's scale
TORCHTITAN_BOUND = 7 * BF16_U


def test_dry_run_lists_every_row_with_its_shapes_and_budget(capsys):
    assert gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for row in gpu.ROWS:
        assert f"{row.name:<20} budget {row.budget_s:>4.0f} s  {row.runs}" in out
    assert "hidden 7168, 8 experts of 2048, top-8, 4096 tokens, bf16" in out  # the V3 slice of the moe-layer row
    assert "trainer-graphed" in out and "not yet" not in out  # train.cuda_graphs captures (launch.train.graphs)
    assert "graphs-check" in out and "10 steps eager twice and with CUDA graphs" in out
    budgets = {row.name: row.budget_s for row in gpu.ROWS}
    assert budgets["kernels"] <= 120 and budgets["v3-rank"] <= 120
    assert all(budget <= 60 for name, budget in budgets.items() if name.startswith("trainer-"))
    assert sum(budgets.values()) < 8 * 60 and f"total budget {sum(budgets.values()):.0f} s" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the suite would run")
def test_a_real_run_without_cuda_exits_2_naming_why(capsys):
    assert moe_bench(["gpu", "--only", "machine"]) == 2
    err = capsys.readouterr().err
    assert "moe-bench gpu needs a CUDA GPU" in err and "--dry-run" in err and "Traceback" not in err


def test_gpu_1x_is_qwen3_30b_a3bs_layer_and_fits_one_80gb_gpu_by_moe_plan():
    cfg = load_config(gpu.GPU_1X)
    m = cfg.model
    assert (m.hidden_size, m.num_experts, m.expert_ffn_size, m.top_k, m.num_heads, m.num_kv_heads, m.head_dim) == (
        2048, 128, 768, 8, 32, 4, 128)
    assert 4 <= m.num_layers <= 8 and (cfg.train.seq_len, cfg.train.dtype, cfg.parallel.world_size) == (
        4096, "bfloat16", 1)
    for preset in ("h100", "h200"):
        plan = make_plan(cfg, Machine(gpu_preset(preset), 1))
        assert plan.peak_memory <= 80e9 and plan.fits, preset
    figures = gpu.plan_figures(cfg)  # a trainer row's moe-plan figures: the H100's without CUDA
    assert sum(figures["plan_breakdown"].values()) == pytest.approx(figures["plan_step_ms"], rel=1e-9)
    assert figures["plan_breakdown"]["expert GEMM"] > 0 and "optimizer" not in figures["plan_breakdown"]


def test_the_docs_page_and_moe_plans_ratios_come_from_a_result(tmp_path, capsys):
    rows = [{"row": "moe-layer", "status": "ok", "wall_s": 20.0, "budget_s": 30, "runs": "MoELayer", "peer": "tt",
             "ours_ms": 10.0, "peer_ms": 12.0, "vs_peer": 1.2},
            {"row": "trainer-eager", "status": "ok", "wall_s": 35.0, "budget_s": 40, "runs": "gpu-1x", "peer": "-",
             "tokens_per_s": 20000.0, "step_ms": 204.8, "mfu": 0.31, "peak_memory_gib": 61.0, "plan_step_ms": 180.0,
             "plan_peak_gib": 58.0, "plan_tokens_per_s": 22755.0,
             "breakdown": {"ms": {"expert GEMM": 80.5, "attention": 30.0}, "total_ms": 110.5},
             "plan_breakdown": {"expert GEMM": 70.0, "routing & permute": 20.0}},
            {"row": "trainer-graphed", "status": "error: RuntimeError: capture failed", "wall_s": 0.0, "budget_s": 40,
             "runs": "gpu-1x", "peer": "-"}]
    result = tmp_path / "gpu.json"
    head = {"suite": "gpu", "time_utc": "2026-11-28T17:00:00+00:00", "command": "moe-bench gpu --json gpu.json",
            "machine": {"cpu": "a CPU", "gpus": [], "gpu_driver": None, "cuda": None}, "versions": versions(),
            "git_commit": "0" * 40, "notes": ["a note"]}
    result.write_text(json.dumps({"header": head, "key": ["row"], "metrics": {}, "rows": rows}))
    page = tmp_path / "gpu-results.md"
    assert gpu.main(["--docs", str(result), "--docs-out", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# GPU results: no GPU") and head["time_utc"] in text and head["machine"]["cpu"] in text
    assert "| trainer-eager | ok | 35 | 40 | - | - | - | 20000 | - | 31.0% | 22755 | 61.0 | 58.0 |" in text
    assert "| trainer-graphed | error: RuntimeError: capture failed |" in text
    assert "## Where the time goes" in text and "| kind | trainer-eager |" in text
    assert "| expert GEMM | 80.5 / 70.0 |" in text and "| attention | 30.0 / - |" in text
    assert "| routing & permute | - / 20.0 |" in text and "| total | 110.5 / 90.0 |" in text
    capsys.readouterr()
    assert moe_plan(["--measure-gpu", str(result)]) == 0
    out = capsys.readouterr().out
    assert "trainer-eager: step ms" in out and "1.138" in out and "trainer-eager: peak GiB" in out  # 204.8 / 180


def test_the_graphs_check_says_when_graphed_losses_differ():
    """The graphs-check row's core (gpu.graphs_check) on the CPU, a shrunk configs/tiny-1proc.toml, its graph backend
    the replay simulator with replays planted to do nothing: the two eager runs agree, the graphed one does not, and
    the row says OUTPUT DIFFERS at the first replayed step (the real backend's agreement is
    tests/launch/train/test_cuda_graphs.py's)."""
    class Frozen(ReplayGraphs):
        def capture(self, work):
            graph, out = super().capture(work)
            graph.replay = lambda: None
            return graph, out
    small = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1",
             "model.dense_ffn_size=64", "model.expert_ffn_size=16", "train.seq_len=16", "train.micro_batch_size=2",
             "train.grad_accum_steps=2"]
    result = gpu.graphs_check(torch.device("cpu"), Frozen, steps=3, overrides=small)
    assert result["eager_repeatable"] and not result["graphed_equal"]
    assert result["status"].startswith("OUTPUT DIFFERS: graphed loss") and "at step 1" in result["status"]
    assert not torch.are_deterministic_algorithms_enabled()  # restored


def test_peers_folder_without_wheels_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no .whl files there"):
        gpu.install_peers(str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="torchtitan is not installed (an optional peer: pip install --no-deps torchtitan "
                           "spmd_types tyro docstring_parser typeguard)")
def test_torchtitans_moe_computes_our_layers_output_from_the_same_weights_and_tokens(seed=0):
    """The moe-layer row's peer at a tiny shape on the CPU: torchtitan's MoE built by the adapter from our weights
    gives our float64 layer's output within bf16's bound (its experts compute in bf16), and ours within fp32's."""
    from launch.bench.peers.torchtitan_moe import build

    spec = {"hidden": 64, "ffn": 32, "experts": 8, "top_k": 2, "batch": 2, "seq": 16, "seed": seed,
            "dtype": "float32"}
    torch.manual_seed(seed)
    ours = MoELayer(model_config(spec))
    weights = our_weights(ours)
    reference = load_weights(MoELayer(model_config(spec)).double(), weights)
    _, forward, info = build(spec, 0, 1, weights)
    x = inputs(spec, 0)[0]
    with torch.no_grad():
        expected = reference(x.double())[0]
        checked = decided_tokens(x.double() @ weights["router"].double().T, spec["top_k"], torch.float32)
        assert relative_error(ours(x)[0], expected, checked) < 1e-5
        assert relative_error(forward(x), expected, checked) < TORCHTITAN_BOUND
    assert info["local_experts"] == 8


def test_rows_run_in_turn_a_failing_row_says_why_and_each_row_is_kept_as_it_ends(monkeypatch):
    """run_rows with stand-in rows (no GPU needed): the JSON is rewritten after every row, so a run cut short keeps
    the rows it finished; a row that raises reports the error and the next still runs; over budget is said."""
    monkeypatch.setattr(gpu, "nvidia_smi", lambda: None)
    ticks = iter([0.0, 1.0, 1.0, 1.5, 1.5, 1.5])
    monkeypatch.setattr(gpu.time, "perf_counter", lambda: next(ticks))

    def fails(args, row):
        raise RuntimeError("CUDA error: an illegal memory access\nmore")

    rows = [gpu.Row("a", 0.5, "A", "-", lambda args, row: {"ours_ms": 1.0}),
            gpu.Row("b", 9.0, "B", "-", fails), gpu.Row("c", 9.0, "C", "-", lambda args, row: {"status": "not yet"})]
    seen = []
    out = gpu.run_rows(None, rows, lambda so_far: seen.append([r["row"] for r in so_far]))
    assert seen == [["a"], ["a", "b"], ["a", "b", "c"]]
    assert [r["status"] for r in out] == ["ok, over budget (1 s > 0.5 s)",
                                         "error: RuntimeError: CUDA error: an illegal memory access", "not yet"]
    assert out[0]["ours_ms"] == 1.0 and out[1]["wall_s"] == 0.5


@pytest.mark.slow
def test_each_row_runs_in_its_own_process_killed_at_its_limit_and_the_deadline_skips_what_no_longer_fits(
        monkeypatch, tmp_path):
    """run_isolated with stand-in row processes (python -c, no GPU): a row writing its result is kept as written, a
    row whose process dies without one (as a CUDA fault kills it) says so and hands the rows after it its on_failure
    environment, a hanging row is killed at ROW_KILL_FACTOR x budget + ROW_START_S and the next still runs, and a row
    whose budget no longer fits before the deadline is skipped saying why."""
    monkeypatch.setattr(gpu, "nvidia_smi", lambda: None)
    monkeypatch.setattr(gpu, "ROW_KILL_FACTOR", 1.0)
    monkeypatch.setattr(gpu, "ROW_START_S", 0.0)
    monkeypatch.delenv("MOE_STAND_IN", raising=False)
    writes = ("import json, os, sys; "
              "open(sys.argv[1], 'w').write(json.dumps({'status': os.environ.get('MOE_STAND_IN', 'ok')}))")
    scripts = {"writes": writes, "dies": "import os; os._exit(3)", "after": writes,
               "hangs": "import time; time.sleep(60)", "late": "pass"}

    def command(row, result):
        return [gpu.sys.executable, "-c", scripts[row.name], str(result)]

    rows = [gpu.Row("writes", 5, "W", "-", None), gpu.Row("dies", 5, "D", "-", None, on_failure={"MOE_STAND_IN": "x"}),
            gpu.Row("after", 5, "A", "-", None), gpu.Row("hangs", 1, "H", "-", None),
            gpu.Row("late", 50, "L", "-", None)]
    seen = []
    out = gpu.run_isolated(rows, deadline_s=30, done=lambda so_far: seen.append(len(so_far)), command=command)
    assert seen == [1, 2, 3, 4, 5]
    assert out[0] == {"status": "ok"} and out[2] == {"status": "x"}  # the failed row's environment reached "after"
    assert out[1]["status"] == "error: the row's process exited with code 3 and no result (its log above says why)"
    assert out[1]["later_rows_env"] == {"MOE_STAND_IN": "x"}
    assert out[3]["status"] == "error: killed after 1 s (a hang, or far over its 1 s budget)"
    assert out[4]["status"].startswith("skipped: ") and "the row's budget is 50 s" in out[4]["status"]


def test_only_runs_the_rows_in_the_order_named(capsys):
    assert gpu.main(["--dry-run", "--only", "v3-rank", "--only", "machine"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in lines if "budget" in line and "total" not in line]
    assert listed == ["v3-rank", "machine"]


def test_our_trainer_rows_are_set_beside_torchtitans_where_both_ran():
    rows = [{"row": "trainer-eager", "tokens_per_s": 30.0, "mfu": 0.2}, {"row": "trainer-fp8", "status": "error: x"},
            {"row": "moe-layer", "ours_ms": 1.0}, {"row": "trainer-torchtitan", "tokens_per_s": 20.0, "mfu": 0.1}]
    gpu.compare_trainers(rows)
    assert rows[0]["vs_peer"] == 1.5 and rows[0]["peer_tokens_per_s"] == 20.0 and rows[0]["peer_mfu"] == 0.1
    assert "vs_peer" not in rows[1] and "vs_peer" not in rows[2] and "vs_peer" not in rows[3]
    rows[3] = {"row": "trainer-torchtitan", "status": "error: y"}
    del rows[0]["vs_peer"]
    gpu.compare_trainers(rows)
    assert "vs_peer" not in rows[0]


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_the_trainer_rows_and_torchtitans_run_on_the_cpu_at_a_tiny_gpu_1x(monkeypatch):
    """The trainer rows' whole body (train_measure: gpu-1x with overrides, TRAINER_STEPS steps and a profiled one,
    moe-plan beside) eagerly and with the FP8 recipe, and torchtitan's row (torchtitan_measure) on the CPU at a tiny
    gpu-1x shape; compare_trainers sets ours beside it. (On the GPU the rows run the same functions on CUDA.)"""
    from tests.launch.bench.test_bench_torchtitan_model import TINY

    cpu = torch.device("cpu")
    monkeypatch.setattr(gpu, "TRAINER_STEPS", (1, 2))  # (warm-up, timed): the suite's time
    rows = [{"row": "trainer-eager", **gpu.train_measure(TINY, cpu)},
            {"row": "trainer-fp8", **gpu.train_measure([*TINY, *gpu.FP8_RECIPE], cpu)},
            {"row": "trainer-torchtitan", **gpu.torchtitan_measure(TINY, cpu)}]
    for r in rows:  # (the CPU's FP8 reference runs as plain aten ops: its GEMMs are mm, its quantisers unnamed)
        assert r["repeats"] == gpu.TRAINER_STEPS[1] and r["tokens_per_s"] > 0 and 0 < r["mfu"]
        assert r["breakdown"]["ms"]["GEMM"] > 0 and r["breakdown"]["ms"]["optimizer"] > 0
    assert rows[0]["breakdown"]["ms"]["expert GEMM"] > 0 and rows[2]["breakdown"]["ms"]["expert GEMM"] > 0
    assert rows[0]["plan_step_ms"] > 0 and rows[0]["peak_memory_gib"] is None and rows[1]["plan_breakdown"]
    gpu.compare_trainers(rows)
    assert rows[0]["vs_peer"] == rows[0]["tokens_per_s"] / rows[2]["tokens_per_s"]


def test_the_device_split_rows_status_says_what_the_check_found():
    assert gpu.with_split_status({"ok": False, "reason": "NVSHMEM is not available"})["status"] == \
        "not run: NVSHMEM is not available"
    assert gpu.with_split_status({"ok": False, "error": "RuntimeError: boom"})["status"] == "error: RuntimeError: boom"
    differs = {"ok": False, "exchange": {"bitwise": False}, "layer": {"max_abs_diff": 0.5, "bound": 1e-5}}
    assert gpu.with_split_status(differs)["status"].startswith("OUTPUT DIFFERS: exchange bitwise False")
    assert "status" not in gpu.with_split_status({"ok": True, "exchange": {"bitwise": True}})
    from dispatch.device_split_check import gpu_check  # on this CPU machine: the reason, not an exception
    assert gpu.with_split_status(gpu_check("cpu"))["status"].startswith("not run: needs a CUDA device")
