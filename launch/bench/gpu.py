"""`moe-bench gpu`: one GPU measured in one command under a stated time budget per row, each row beside its peer.

Rows (--only picks some; --dry-run lists them with their shapes and budgets and needs no CUDA):
  machine      the GPU, its driver and clocks (nvidia-smi, read again after every timed row), torch/triton/CUDA
  kernels      moe-bench kernels' FP8 grouped GEMM table at the FP8 GEMM issue's shapes, both torch peers beside
  moe-layer    our MoELayer's forward + backward at a DeepSeek-V3 slice beside torchtitan's MoE module, same weights
               and tokens, in rounds (launch.bench.harness: the contenders alternate)
  trainer-*    the trainer on configs/gpu-1x.toml (launch.train.loop.train, random tokens, no checkpoint): eager, the
               FP8 recipe, and each graphed (train.cuda_graphs) beside it; torchtitan's own trainer as its peer, or
               why it cannot run
  graphs-check configs/tiny-1proc.toml for GRAPHS_CHECK_STEPS steps eager (twice) and graphed, deterministic kernels:
               the graphed losses bitwise equal to the eager ones, no sync in a replay (set_sync_debug_mode "error");
               graphs-check-wide the same at a widened shape (WIDENED)
  v3-rank      the real-device rehearsal of DeepSeek-V3's rank (launch.plan.rehearse: memory by category and each
               phase's time beside moe-plan's), where the card holds moe-plan's peak for it
Each row runs in a process of its own (--in-process: all in this one), killed at twice its budget + 30 s, so a CUDA
fault or a hung kernel costs that row alone; --deadline S skips the rows that no longer fit S seconds.
Without CUDA a real run exits 2 naming why. --json writes the rows (with the common header), a markdown table
beside it (.md) and a plot (.html, and .png where a headless Chromium is found); --docs RESULT.json writes the
docs GPU page from such a result. --peers DIR installs the wheels in DIR (offline) before anything runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.backend import GEMM_ENV
from launch.bench import kernels
from launch.bench.breakdown import CATEGORIES, OTHER, ProfiledFeed
from launch.bench.harness import fields, ratio_fields, rounds
from launch.bench.layer import model_config, our_weights
from launch.bench.peers.fwdbwd import decided_tokens, fwd_bwd
from launch.bench.report import HIGHER, LOWER, header, header_line, machine, table, versions, write_json
from launch.config.run import RunConfig, load_config
from launch.plan.kinds import step_kinds
from launch.plan.planner import Machine, Options, make_plan
from launch.plan.presets import gpu_preset, preset_for_device
from launch.plan.rehearse import RandomFeed, planned_memory, rehearse
from launch.train.graphs import GraphBackend
from moe.layer import MoELayer

ROOT = Path(__file__).resolve().parents[2]
GPU_1X = ROOT / "configs" / "gpu-1x.toml"
DEEPSEEK_V3 = ROOT / "configs" / "deepseek-v3.toml"
V3_SLICE = {"hidden": 7168, "ffn": 2048, "experts": 8, "top_k": 8, "batch": 1, "seq": 4096}
KERNEL_CASES = ((8, (4096, 512)), (4, (8192,)), (32, (512, 128)))  # (groups, rows per group): the issue's set
KERNEL_SHAPES = "7168x4096,2048x7168"  # K x N: forward N 4096 K 7168, and N 7168 K 2048
CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
FP8_RECIPE = ["model.expert_precision='fp8'", "model.linear_precision='fp8'", "model.activation_cache='fp8'"]
# (warm-up, timed) steps of a trainer row: with grad_accum_steps = 1 a graphed row's warm-up holds the graph's eager
# micro-batches (launch.train.graphs.WARMUP_MICRO_BATCHES = 2) and its capture
TRAINER_STEPS = (3, 5)
TRAINER_BUDGET_S = 30
GRAPHS_CHECK_STEPS = 10
TINY_1PROC = ROOT / "configs" / "tiny-1proc.toml"
# issue 48's "widened config": tiny-1proc at 8x the hidden size, 4x the experts and seq, top-4, bf16
WIDENED = ["model.hidden_size=1024", "model.num_heads=8", "model.num_kv_heads=4", "model.dense_ffn_size=2816",
           "model.num_experts=32", "model.expert_ffn_size=512", "model.top_k=4", "model.num_groups=4",
           "model.topk_groups=2", "model.max_seq_len=512", "train.seq_len=512", "train.grad_accum_steps=4",
           "train.dtype='bfloat16'"]
# a row's process is killed after ROW_KILL_FACTOR x its budget + ROW_START_S (a hang, or far over budget)
ROW_KILL_FACTOR, ROW_START_S = 2.0, 30.0
LAYER_ROUNDS = (3, 10)  # (warm-up, timed) rounds of the MoE-layer row
BF16_TOLERANCE = 5e-2  # launch.bench.layer's bound for experts computing in bf16 (both contenders here)


class NoCuda(ValueError):
    """A real run without a CUDA GPU (exit 2, launch.errors)."""


@dataclass(frozen=True)
class Row:
    """One row of the suite: its budget, what it runs (shapes), its peer, and the function measuring it."""

    name: str
    budget_s: float
    runs: str
    peer: str
    measure: Callable[[argparse.Namespace, Row], dict[str, Any]]
    ready: Callable[[], str | None] = lambda: None  # why the row cannot run (yet) on any GPU, or None
    on_failure: dict[str, str] | None = None  # environment the later rows' processes get when this row fails


def _gpu_name() -> str:
    return torch.cuda.get_device_name(torch.cuda.current_device())


def nvidia_smi() -> dict[str, str] | None:
    """The GPU's clocks, power and temperature now (None without nvidia-smi)."""
    query = "clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,driver_version"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return dict(zip(("sm_mhz", "max_sm_mhz", "mem_mhz", "power_w", "temperature_c", "driver"),
                    (v.strip() for v in out.split(","))))


def machine_row(args: argparse.Namespace, row: Row) -> dict[str, Any]:
    """The GPU, driver, clocks and versions."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"gpu": props.name, "memory_gib": props.total_memory / 2 ** 30, "sms": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}", "smi": nvidia_smi(), "versions": versions(),
            "cuda": torch.version.cuda, "host": machine()}


def kernels_check_row(args: argparse.Namespace, row: Row) -> dict[str, Any]:
    """kernels.gpu_check's edge cases (empty, 1-row and partial tiles, unaligned N and K): each fast (Gluon) FP8 GEMM
    against the `tl` reference and float64, and bitwise stable; a case that fails or raises fails the row."""
    from kernels import gpu_check

    if not gpu_check.fast_gemm_runs_on(torch.zeros(1, device="cuda")):
        return {"status": "not run: the fast kernels need an sm_90 GPU and a Triton with Gluon"}
    cases = [gpu_check.check(*case) for case in gpu_check.EDGE_CASES]
    failed = [c for c in cases if not c["ok"]]
    out: dict[str, Any] = {"cases": cases}
    if failed:
        first = failed[0]
        out["status"] = (f"OUTPUT DIFFERS in {len(failed)} of {len(cases)} cases, e.g. {first['op']} N={first['N']} "
                         f"K={first['K']} rows={first['rows']}: vs reference {first['vs_reference']:.1e}, stable "
                         f"{first['bitwise_stable']}")
    return out


def kernels_row(args: argparse.Namespace, row: Row) -> dict[str, Any]:
    """launch.bench.kernels.gpu_rows at each case of KERNEL_CASES until the row's budget is spent."""
    began, out, skipped = time.perf_counter(), [], []
    for groups, per_group in KERNEL_CASES:
        case = f"{groups} groups x {'/'.join(map(str, per_group))} rows"
        if time.perf_counter() - began > row.budget_s:
            skipped.append(case)
            continue
        opts = kernels.parse_args(["--shapes", KERNEL_SHAPES, "--groups", str(groups), "--rows",
                                   ",".join(map(str, per_group)), "--warmup", "3", "--repeats", "10", "--quiet"])
        out += kernels.gpu_rows(opts)
    return {"kernels": out, "skipped": skipped, "min_calc_diff_ok": all(r["calc_diff"] < 1e-3 for r in out),
            "bitwise_stable": all(r["bitwise_stable"] for r in out)}


def _layer_inputs(spec: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec["seed"] + 1000)
    shape = (spec["batch"], spec["seq"], spec["hidden"])
    return tuple(torch.randn(shape, generator=gen).to(device, torch.bfloat16) for _ in range(2))


def torchtitan_moe(spec: dict[str, Any], weights: dict[str, torch.Tensor], device: torch.device):
    """(torchtitan's MoE holding weights on device, its forward) or raises ImportError when it is not installed."""
    from launch.bench.peers.torchtitan_moe import build

    module, forward, _ = build({**spec, "dtype": "bfloat16"}, 0, 1, weights)
    return module.to(device), forward


def _event_step(step: Callable[[], None]) -> Callable[[], float]:
    """step timed by CUDA events: its device seconds."""
    def timed() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return timed


def layer_flops(spec: dict[str, Any]) -> float:
    """Forward + backward FLOPs of the routed experts (3 x forward; gate|up and down GEMMs per routed slot)."""
    tokens = spec["batch"] * spec["seq"]
    return 3 * 2 * tokens * spec["top_k"] * 3 * spec["hidden"] * spec["ffn"]


def layer_row(args: argparse.Namespace, row: Row) -> dict[str, Any]:
    """Ours and torchtitan's MoE forward + backward in rounds, outputs compared first."""
    device = torch.device("cuda", torch.cuda.current_device())
    spec = {**V3_SLICE, "seed": 0}
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        ours = MoELayer(model_config(spec))
    weights = our_weights(ours)
    ours = ours.to(torch.bfloat16)
    x, dy = _layer_inputs(spec, device)
    contenders = {"ours": (ours, lambda t: ours(t)[0])}
    peer_status = "ok"
    try:
        contenders["torchtitan"] = torchtitan_moe(spec, weights, device)
    except ImportError as err:
        peer_status = f"not installed: {err} (moe-bench gpu --peers DIR installs its wheels)"
    with torch.no_grad():
        outputs = {name: forward(x).float() for name, (_, forward) in contenders.items()}
        logits = x.double().flatten(0, 1) @ weights["router"].to(device).double().T
        checked = decided_tokens(logits, spec["top_k"], torch.bfloat16).to(device)
    result: dict[str, Any] = {"shape": spec, "tflops_counted": "routed experts only, 3 x forward",
                              "peer_status": peer_status}
    if "torchtitan" in outputs:
        diff = outputs["torchtitan"].flatten(0, 1) - outputs["ours"].flatten(0, 1)
        result["rel_diff"] = (diff[checked].abs().max() / outputs["ours"].abs().max()).item()
        if result["rel_diff"] > BF16_TOLERANCE:
            result["status"] = f"OUTPUT DIFFERS from ours (> {BF16_TOLERANCE:g}): torchtitan's MoE"
    del outputs
    steps = {name: _event_step(fwd_bwd(module, forward, x, dy)) for name, (module, forward) in contenders.items()}
    timed = rounds(steps, *LAYER_ROUNDS, rotate=True)
    mine = timed["ours"]["time"]
    result.update(fields("ours_ms", mine), ours_tflops=layer_flops(spec) / mine.median / 1e12)
    if "torchtitan" in timed:
        theirs = timed["torchtitan"]["time"]
        result.update(fields("peer_ms", theirs), ratio_fields("vs_peer", theirs / mine),
                      peer_tflops=layer_flops(spec) / theirs.median / 1e12)
    return result


def trainer_config(overrides: list[str], run_dir: str, device: torch.device) -> RunConfig:
    """configs/gpu-1x.toml with overrides on device, for TRAINER_STEPS steps and one profiled step after them (its
    time by kind of work: launch.bench.breakdown), every step's per-rank figures."""
    steps = sum(TRAINER_STEPS) + 1
    return load_config(GPU_1X, [*overrides, f"train.steps={steps}", "train.rank_metrics_every=1",
                                "train.eval_batches=0", f"train.run_dir={run_dir!r}", f"train.device={device.type!r}"])


def plan_figures(cfg: RunConfig) -> dict[str, Any]:
    """moe-plan's step, peak memory, tokens/s and MFU for cfg on this GPU (the H100's preset without one), and its
    step's ms by kind of work (launch.plan.kinds.step_kinds: the profiled breakdown's kinds)."""
    gpu = preset_for_device(_gpu_name()) if torch.cuda.is_available() else None
    plan = make_plan(cfg, Machine(gpu or gpu_preset("h100"), 1), Options(cfg.train.recompute))
    return {"plan_gpu": plan.machine.gpu.name, "plan_step_ms": plan.step_seconds * 1e3,
            "plan_peak_gib": plan.peak_memory / 2 ** 30, "plan_tokens_per_s": plan.tokens_per_second,
            "plan_mfu": plan.mfu, "plan_breakdown": {kind: s * 1e3 for kind, s in step_kinds(plan).items()}}


def train_measure(overrides: list[str], device: torch.device) -> dict[str, Any]:
    """A trainer row's figures: configs/gpu-1x.toml with overrides trained on device (random tokens, no checkpoint)
    for TRAINER_STEPS steps and one profiled step, beside moe-plan's (the tests run it on the CPU at a tiny shape)."""
    from launch.train.loop import train

    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory(prefix="moe-bench-gpu-") as run_dir:
        cfg = trainer_config(overrides, run_dir, device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        feed = ProfiledFeed(RandomFeed(cfg, device), sum(TRAINER_STEPS), device)  # one more step, profiled
        records = train(cfg, progress=False, device=device, feed=feed, checkpoints=False)
        breakdown = feed.stop()
    timed = records[TRAINER_STEPS[0]:sum(TRAINER_STEPS)]
    tokens = cfg.train.grad_accum_steps * cfg.train.micro_batch_size * cfg.train.seq_len
    steps = [tokens / r["tokens_per_s"] for r in timed]
    return {"tokens_per_s": tokens / statistics.median(steps), "step_ms": 1e3 * statistics.median(steps),
            "step_ms_spread": (max(steps) - min(steps)) / statistics.median(steps), "repeats": len(steps),
            "mfu": statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else None,
            "last_loss": records[-1]["lm_loss"], "overrides": overrides, "breakdown": breakdown,
            **plan_figures(cfg)}


def trainer_row(overrides: list[str]) -> Callable[[argparse.Namespace, Row], dict[str, Any]]:
    """A trainer row training configs/gpu-1x.toml with overrides on this GPU (train_measure)."""
    def measure(args: argparse.Namespace, row: Row) -> dict[str, Any]:
        return train_measure(overrides, torch.device("cuda", torch.cuda.current_device()))
    return measure


def graphs_check_row(overrides: list[str]) -> Callable[[argparse.Namespace, Row], dict[str, Any]]:
    """Issue 48's GPU check of train.cuda_graphs (graphs_check, tiny-1proc with overrides) on this GPU, CUDA graphs
    whose replays refuse syncs."""
    def measure(args: argparse.Namespace, row: Row) -> dict[str, Any]:
        from launch.train.graphs import CudaGraphs

        device = torch.device("cuda", torch.cuda.current_device())
        return graphs_check(device, lambda: CudaGraphs(device, sync_check=True), overrides=overrides)
    return measure


def graphs_check(device: torch.device, backend: Callable[[], GraphBackend], steps: int = GRAPHS_CHECK_STEPS,
                 overrides: list[str] = ()) -> dict[str, Any]:
    """configs/tiny-1proc.toml with overrides (random tokens) on device for steps steps, eagerly twice and graphed
    through backend() (on a GPU launch.train.graphs.CudaGraphs with sync_check: a synchronising call in a graphed
    micro-batch raises, and the row reports it), under torch.use_deterministic_algorithms (warnings only: the ops
    without a deterministic kernel are listed); the graphed losses must equal the eager ones bitwise (when the two
    eager runs differ, the kernels are not deterministic and the row says so)."""
    from launch.train.loop import train

    losses: dict[str, list[float]] = {}
    was_deterministic, workspace = torch.are_deterministic_algorithms_enabled(), os.environ.get(CUBLAS_WORKSPACE)
    os.environ[CUBLAS_WORKSPACE] = ":4096:8"  # cuBLAS's deterministic workspace
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught, tempfile.TemporaryDirectory(prefix="moe-graphs-") as runs:
            warnings.simplefilter("always")
            for name, graphed in (("eager", False), ("eager again", False), ("graphed", True)):
                cfg = load_config(TINY_1PROC, [*overrides, f"train.steps={steps}", "train.eval_batches=0",
                                               f"train.run_dir={str(Path(runs) / name.replace(' ', '-'))!r}",
                                               f"train.device={device.type!r}",
                                               f"train.cuda_graphs={str(graphed).lower()}"])
                records = train(cfg, progress=False, device=device, feed=RandomFeed(cfg, device), checkpoints=False,
                                graph_backend=backend() if graphed else None)
                losses[name] = [r["loss"] for r in records]
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        if workspace is None:
            os.environ.pop(CUBLAS_WORKSPACE, None)
        else:
            os.environ[CUBLAS_WORKSPACE] = workspace
    nondeterministic = sorted({str(w.message).splitlines()[0][:200] for w in caught
                               if "deterministic" in str(w.message)})
    result = {"losses": losses, "nondeterministic_ops": nondeterministic,
              "eager_repeatable": losses["eager"] == losses["eager again"],
              "graphed_equal": losses["graphed"] == losses["eager"]}
    if not result["graphed_equal"]:
        step = next(i for i, (a, b) in enumerate(zip(losses["graphed"], losses["eager"])) if a != b)
        why = "" if result["eager_repeatable"] else " (the two eager runs differ too: nondeterministic kernels)"
        result["status"] = f"OUTPUT DIFFERS: graphed loss {losses['graphed'][step]!r} at step {step}, eager " \
                           f"{losses['eager'][step]!r}{why}"
    return result


def device_split_row(args: argparse.Namespace, row: Row) -> dict[str, Any]:
    """Issue 48's GPU check of the device-split exchange at world size 1 (dispatch.device_split_check.gpu_check):
    symmetric memory's all_to_all_vdev against the reference, and a flat dispatch + combine through it against the
    exact exchange."""
    from dispatch.device_split_check import gpu_check

    return with_split_status(gpu_check(torch.device("cuda", torch.cuda.current_device())))


def with_split_status(result: dict[str, Any]) -> dict[str, Any]:
    """gpu_check's result with the row's status: not run (no NVSHMEM), error (an op failed), OUTPUT DIFFERS, or ok."""
    if result.get("reason"):  # NVSHMEM (or CUDA) not available here
        result["status"] = f"not run: {result['reason']}"
    elif result.get("error"):
        result["status"] = f"error: {result['error'][:300]}"
    elif not result["ok"]:
        result["status"] = (f"OUTPUT DIFFERS: exchange bitwise {result['exchange']['bitwise']}, layer max abs diff "
                            f"{result['layer']['max_abs_diff']:.2e} (bound {result['layer']['bound']:.2e})")
    return result


def torchtitan_measure(overrides: list[str], device: torch.device) -> dict[str, Any]:
    """torchtitan's own Qwen3 MoE model at configs/gpu-1x.toml's shape (with overrides) on the trainer rows' tokens
    (launch.bench.peers.torchtitan_model: its model, a loop doing its train_step at world 1), the same steps."""
    from launch.bench.peers.torchtitan_model import measure

    with tempfile.TemporaryDirectory(prefix="moe-bench-gpu-") as run_dir:
        return measure(trainer_config(overrides, run_dir, device), device, *TRAINER_STEPS)


def torchtitan_trainer_row(args: argparse.Namespace, row: Row) -> dict[str, Any]:
    """torchtitan_measure on this GPU at configs/gpu-1x.toml's shape."""
    return torchtitan_measure([], torch.device("cuda", torch.cuda.current_device()))


def compare_trainers(rows: list[dict[str, Any]]) -> None:
    """Each of our trainer rows' tokens/s over torchtitan's (vs_peer: > 1, ours is faster; MFU beside), where both
    ran."""
    peer = next((r for r in rows if r["row"] == "trainer-torchtitan" and r.get("tokens_per_s")), None)
    for r in rows:
        if peer is not None and r["row"].startswith("trainer-") and r is not peer and r.get("tokens_per_s"):
            r.update(vs_peer=r["tokens_per_s"] / peer["tokens_per_s"], peer_tokens_per_s=peer["tokens_per_s"],
                     peer_mfu=peer.get("mfu"))


def v3_rank_row(args: argparse.Namespace, row: Row) -> dict[str, Any]:
    """DeepSeek-V3's largest rank rehearsed on this GPU, where moe-plan's peak for it fits the card."""
    cfg = load_config(DEEPSEEK_V3)
    device = torch.device("cuda", torch.cuda.current_device())
    need = max(sum(rank.values()) for rank in planned_memory(cfg)[0])
    have = torch.cuda.get_device_properties(device).total_memory
    if need > have:
        return {"status": f"does not fit: moe-plan's peak for the rank is {need / 2 ** 30:.1f} GiB, the card holds "
                          f"{have / 2 ** 30:.1f} GiB (an H100 waits for the FP8 recipe to bring it <= 70 GiB)"}
    return {"rehearsal": rehearse(cfg, device=device).to_dict()}


def _peer_installed() -> str | None:
    return None if importlib.util.find_spec("torchtitan") else "runs ours only: torchtitan not installed (--peers DIR)"


ROWS = [
    Row("machine", 5, "GPU, driver, clocks (nvidia-smi), torch/triton/CUDA versions", "-", machine_row),
    Row("kernels-check", 30, "the fast (Gluon) FP8 GEMMs' edge cases against the tl reference and float64 "
        "(kernels.gpu_check --quick); when it fails, the later rows run the reference kernels ($MOE_FP8_GEMM)",
        "the tl reference kernel", kernels_check_row, on_failure={GEMM_ENV: "reference"}),
    Row("kernels", 105, f"FP8 grouped GEMM forward/dgrad/wgrad, KxN {KERNEL_SHAPES}, (groups, rows per group) "
        + ", ".join(f"{g} x {'/'.join(map(str, r))}" for g, r in KERNEL_CASES),
        "torch._grouped_mm bf16, torch._scaled_grouped_mm fp8 rowwise", kernels_row),
    Row("moe-layer", 30, "MoELayer forward+backward, hidden {hidden}, {experts} experts of {ffn}, top-{top_k}, "
        "{seq} tokens, bf16".format(**V3_SLICE), "torchtitan MoE (GroupedExperts, bf16)", layer_row, _peer_installed),
    Row("trainer-eager", TRAINER_BUDGET_S,
        f"configs/gpu-1x.toml, eager, bf16, {TRAINER_STEPS[0]}+{TRAINER_STEPS[1]} steps",
        "torchtitan's Qwen3 MoE (row trainer-torchtitan)", trainer_row([])),
    Row("trainer-fp8", TRAINER_BUDGET_S, "configs/gpu-1x.toml, eager, DeepSeek-V3's FP8 recipe", "-",
        trainer_row(FP8_RECIPE)),
    *(Row(name, TRAINER_BUDGET_S, f"configs/gpu-1x.toml, {what}CUDA graphs", "-", trainer_row(overrides))
      for name, what, overrides in (("trainer-graphed", "", ["train.cuda_graphs=true"]),
                                    ("trainer-fp8-graphed", "FP8 recipe, ", [*FP8_RECIPE, "train.cuda_graphs=true"]))),
    Row("graphs-check", 15, f"configs/tiny-1proc.toml, {GRAPHS_CHECK_STEPS} steps eager twice and with CUDA graphs "
        "(replays under set_sync_debug_mode 'error'), deterministic algorithms", "the eager run", graphs_check_row([])),
    Row("graphs-check-wide", 20, f"configs/tiny-1proc.toml widened ({', '.join(WIDENED)}), as graphs-check",
        "the eager run", graphs_check_row(WIDENED)),
    Row("device-split", 15, "parallel.dispatch_exchange = 'device_split' at world size 1: symmetric memory's "
        "all_to_all_vdev (NVSHMEM) bitwise against the reference, a flat dispatch + combine through it against the "
        "exact exchange", "the reference (padded exchange, rows past each count padded)", device_split_row),
    Row("trainer-torchtitan", TRAINER_BUDGET_S, "torchtitan's Qwen3 MoE model at configs/gpu-1x.toml's shape, its "
        "train_step at world 1 (fp32 params, bf16 autocast, fused AdamW), the trainer rows' tokens and steps",
        "the trainer-* rows", torchtitan_trainer_row, _peer_installed),
    Row("v3-rank", 100, "configs/deepseek-v3.toml, the rank moe-plan gives the largest peak, on this GPU under the "
        "fake process group (moe-train --rehearse --device cuda)", "moe-plan's memory and compute prediction",
        v3_rank_row),
]
ROW_NAMES = [r.name for r in ROWS]


def install_peers(folder: str) -> str:
    """pip install every wheel in folder, offline, without dependencies; what pip said (its last line)."""
    wheels = sorted(Path(folder).glob("*.whl"))
    if not wheels:
        raise ValueError(f"--peers {folder}: no .whl files there (make them elsewhere with `pip download NAME "
                         f"--no-deps -d {folder}`)")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links",
                           folder, *map(str, wheels)], capture_output=True, text=True)
    importlib.invalidate_caches()
    tail = (done.stderr.strip().splitlines() or ["installed"])[-1]
    return f"{len(wheels)} wheels from {folder}: " + ("installed" if done.returncode == 0 else f"pip failed: {tail}")


def dry_run(rows: list[Row]) -> list[dict[str, Any]]:
    """Every chosen row with its shapes, peer and budget (no CUDA needed)."""
    return [{"row": r.name, "budget_s": r.budget_s, "runs": r.runs, "peer": r.peer, "status": r.ready() or "runs"}
            for r in rows]


def run_rows(args: argparse.Namespace, rows: list[Row], done: Callable[[list[dict[str, Any]]], None] | None = None
             ) -> list[dict[str, Any]]:
    """Measure each row in this process; a row that fails says why (the others still run); its wall time beside its
    budget. done(rows so far) after each row (the JSON written as the run goes: a run cut short keeps its rows)."""
    out: list[dict[str, Any]] = []
    for row in rows:
        print(f"[moe-bench gpu] {row.name} (budget {row.budget_s:g} s): {row.runs}", file=sys.stderr, flush=True)
        began = time.perf_counter()
        try:
            got = row.measure(args, row)
        except Exception as err:  # noqa: BLE001 - a failing row reports its error; the suite goes on
            got = {"status": f"error: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"}
        out.append(_row_result(row, time.perf_counter() - began, got))
        torch.cuda.empty_cache()
        if done is not None:
            done(out)
    return out


def _row_result(row: Row, wall: float, got: dict[str, Any]) -> dict[str, Any]:
    """A row's entry in the result: its status (over budget said), wall time, what it ran, the clocks after it."""
    status = got.pop("status", "ok")
    if status == "ok" and wall > row.budget_s:
        status = f"ok, over budget ({wall:.0f} s > {row.budget_s:g} s)"
    return {"row": row.name, "budget_s": row.budget_s, "wall_s": wall, "status": status, "runs": row.runs,
            "peer": row.peer, "smi_after": nvidia_smi(), **got}


def row_command(row: Row, result: Path) -> list[str]:
    """The command measuring one row in a process of its own, its result written to `result` as JSON."""
    return [sys.executable, "-m", "launch.bench.cli", "gpu", "--only", row.name, "--row-json", str(result)]


def run_isolated(rows: list[Row], deadline_s: float | None = None,
                 done: Callable[[list[dict[str, Any]]], None] | None = None,
                 command: Callable[[Row, Path], list[str]] = row_command) -> list[dict[str, Any]]:
    """Each row in a process of its own (row_command), so that a CUDA fault (which poisons its process's context) or
    a hang (a kernel waiting forever) costs that row alone: the process is killed after ROW_KILL_FACTOR x its budget
    + ROW_START_S, or when deadline_s (seconds from now) is reached; a row whose budget no longer fits before the
    deadline is skipped, saying so. A failing row with on_failure sets that environment for the rows after it (a
    failed kernels-check: the reference FP8 GEMM). done(rows so far) after each row, as run_rows."""
    began, out, env = time.perf_counter(), [], dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="moe-bench-gpu-rows-") as folder:
        for row in rows:
            left = None if deadline_s is None else deadline_s - (time.perf_counter() - began)
            if left is not None and left < row.budget_s:
                out.append(_row_result(row, 0.0, {"status": f"skipped: {left:.0f} s left before the run's deadline "
                                                            f"(--deadline {deadline_s:g}), the row's budget is "
                                                            f"{row.budget_s:g} s"}))
            else:
                out.append(_run_child(row, command(row, Path(folder) / f"{row.name}.json"), Path(folder), left, env))
                if row.on_failure and not out[-1]["status"].startswith("ok"):
                    env.update(row.on_failure)
                    out[-1]["later_rows_env"] = row.on_failure
            if done is not None:
                done(out)
    return out


def _run_child(row: Row, argv: list[str], folder: Path, left: float | None, env: dict[str, str]
               ) -> dict[str, Any]:
    """One row's process, killed at its limit; its result, or why there is none."""
    limit = ROW_KILL_FACTOR * row.budget_s + ROW_START_S if left is None else min(
        ROW_KILL_FACTOR * row.budget_s + ROW_START_S, left)
    result = folder / f"{row.name}.json"
    began = time.perf_counter()
    child = subprocess.Popen(argv, start_new_session=True, env=env)  # its own group: the kill reaches what it started
    try:
        code = child.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 9)
        child.wait()
        return _row_result(row, time.perf_counter() - began, {"status": f"error: killed after {limit:.0f} s (a hang, "
                                                                        f"or far over its {row.budget_s:g} s budget)"})
    if not result.exists():
        why = f"error: the row's process exited with code {code} and no result (its log above says why)"
        return _row_result(row, time.perf_counter() - began, {"status": why})
    return json.loads(result.read_text())


METRICS = {"ours_ms": LOWER, "peer_ms": LOWER, "step_ms": LOWER, "tokens_per_s": HIGHER}
SUMMARY = [("row", "row", ""), ("status", "status", ""), ("wall s", "wall_s", ".0f"), ("budget s", "budget_s", ".0f"),
           ("ours ms", "ours_ms", ".2f"), ("peer ms", "peer_ms", ".2f"), ("peer/ours", "vs_peer", ".2f"),
           ("tokens/s", "tokens_per_s", ".0f"), ("peer tokens/s", "peer_tokens_per_s", ".0f"), ("MFU", "mfu", ".1%"),
           ("plan tokens/s", "plan_tokens_per_s", ".0f"),
           ("peak GiB", "peak_memory_gib", ".1f"), ("plan GiB", "plan_peak_gib", ".1f")]


def markdown(doc: dict[str, Any]) -> str:
    """The result as a markdown page: machine and date, the summary table, the kernel table, the V3 rank."""
    head, rows = doc["header"], doc["rows"]
    gpu = ", ".join(head["machine"]["gpus"]) or "no GPU"
    lines = [f"# GPU results: {gpu}", "",
             f"Generated from `{head['command']}` run on {head['time_utc']} ({head['machine']['cpu']}; driver "
             f"{head['machine']['gpu_driver']}; torch {head['versions']['torch']}, "
             f"triton {head['versions']['triton']}, "
             f"CUDA {head['machine']['cuda']}; commit {head['git_commit']}).", ""]
    lines += [f"- {note}" for note in head["notes"]] + [""]
    lines += ["| " + " | ".join(title for title, _, _ in SUMMARY) + " |", "|" + "---|" * len(SUMMARY)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(k) is None else format(r[k], f) for _, k, f in SUMMARY) + " |")
    lines += ["", "Each row runs: " + "; ".join(f"**{r['row']}** {r['runs']} (peer: {r['peer']})" for r in rows), ""]
    profiled = [r for r in rows if r.get("breakdown")]
    if profiled:
        categories = [c for c in (*(name for name, _ in CATEGORIES), OTHER)
                      if any(c in r["breakdown"]["ms"] or c in r.get("plan_breakdown", {}) for r in profiled)]

        def cell(r: dict[str, Any], kind: str | None) -> str:
            measured = r["breakdown"]["total_ms"] if kind is None else r["breakdown"]["ms"].get(kind)
            plan = r.get("plan_breakdown")
            if plan is None:
                return _num(measured, ".1f")
            return f"{_num(measured, '.1f')} / {_num(sum(plan.values()) if kind is None else plan.get(kind), '.1f')}"
        lines += ["## Where the time goes", "", "One step after the timed ones under torch.profiler (launch.bench."
                  "breakdown): each kind of work's device ms, and moe-plan's ms for it where the row has a plan "
                  "(measured / moe-plan; `moe-plan --measure-gpu` prints the ratios).", "",
                  "| kind | " + " | ".join(r["row"] for r in profiled) + " |", "|---|" + "---|" * len(profiled)]
        lines += [f"| {c} | " + " | ".join(cell(r, c) for r in profiled) + " |" for c in categories]
        lines += ["| total | " + " | ".join(cell(r, None) for r in profiled) + " |", ""]
    for r in rows:
        if r.get("kernels"):
            lines += ["## Kernels", "", "| op | shape | kernel | TFLOPS | peer | peer TFLOPS | ratio | calc_diff | "
                      "same bits twice |", "|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {k['op']} | {kernels._shape_text(k['shape'])} | {k.get('backend', '-')} | "
                      f"{_num(k['tflops'])} | {k['peer']} | {_num(k['peer_tflops'])} | {_num(k.get('ratio'), '.2f')} | "
                      f"{k['calc_diff']:.1e} | {k.get('bitwise_stable', '-')} |" for k in r["kernels"]] + [""]
        if r.get("rehearsal"):
            report = r["rehearsal"]
            lines += ["## DeepSeek-V3 rank", "", f"rank {report['rank']} of {report['world_size']}, "
                      f"{report['micro_batches']} micro-batches; moe-plan for {report['planned_for']}", "",
                      "| phase | count | measured ms | moe-plan ms |", "|---|---|---|---|"]
            lines += [f"| {p['name']} | {p['count']} | {p['seconds'] * 1e3:.2f} | "
                      f"{_num(None if p['planned'] is None else p['planned'] * 1e3, '.2f')} |"
                      for p in report["phases"]]
            lines.append("")
    return "\n".join(lines) + "\n"


def _num(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def plot(doc: dict[str, Any], base: Path) -> str:
    """A bar chart of the timed rows (ours beside the peer) and the kernels' TFLOPS; where it went, or why not."""
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        from launch.bench.plot import write_figure
    except ImportError as err:
        return f"no plot ({err})"
    fig = make_subplots(rows=2, cols=1, subplot_titles=("kernels: TFLOPS", "rows: ms (lower is better)"))
    cases = [k for r in doc["rows"] for k in r.get("kernels", []) if k["peer"] == kernels.PEERS[0]]
    names = [f"{k['op']} {kernels._shape_text(k['shape'])}" for k in cases]
    fig.add_trace(go.Bar(name="ours", x=names, y=[k["tflops"] for k in cases]), row=1, col=1)
    for peer in kernels.PEERS:
        fig.add_trace(go.Bar(name=peer, x=names, y=[k["peer_tflops"] for r in doc["rows"]
                                                    for k in r.get("kernels", []) if k["peer"] == peer]), row=1, col=1)
    timed = [r for r in doc["rows"] if r.get("ours_ms") is not None or r.get("step_ms") is not None]
    fig.add_trace(go.Bar(name="ours (rows)", x=[r["row"] for r in timed],
                         y=[r.get("ours_ms", r.get("step_ms")) for r in timed]), row=2, col=1)
    fig.add_trace(go.Bar(name="peer (rows)", x=[r["row"] for r in timed], y=[r.get("peer_ms") for r in timed]),
                  row=2, col=1)
    fig.update_layout(barmode="group", height=900, width=1200, title=f"moe-bench gpu, {doc['header']['time_utc']}")
    html, png, why = write_figure(fig, base)
    return f"plot: {html}" + (f", {png}" if png else f" ({why})")


def write_outputs(doc: dict[str, Any], json_path: str) -> list[str]:
    """The JSON, the markdown beside it and the plot; the paths written."""
    path = Path(json_path)
    write_json(path, doc["header"], doc["rows"], doc["key"], doc["metrics"])
    path.with_suffix(".md").write_text(markdown(doc))
    return [str(path), str(path.with_suffix(".md")), plot(doc, path.with_name(path.stem + "-plot"))]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The suite's options."""
    p = argparse.ArgumentParser(prog="moe-bench gpu", description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", choices=ROW_NAMES, metavar="ROW",
                   help=f"run only this row (repeatable): {', '.join(ROW_NAMES)}")
    p.add_argument("--dry-run", action="store_true", help="list the rows with their shapes and budgets; no CUDA")
    p.add_argument("--peers", metavar="DIR", help="pip install DIR/*.whl offline (no index, no dependencies) first")
    p.add_argument("--json", metavar="OUT", help="write the rows as JSON, OUT's .md and a plot beside it")
    p.add_argument("--docs", metavar="RESULT", help="write the docs GPU page from a result JSON and exit")
    p.add_argument("--docs-out", default=str(ROOT / "docs" / "gpu-results.md"), help="where --docs writes")
    p.add_argument("--deadline", type=float, metavar="S",
                   help="stop starting rows whose budget no longer fits S seconds after the start, and kill a row "
                        "still running then (the rows done so far are kept)")
    p.add_argument("--in-process", action="store_true",
                   help="run the rows in this process (by default each row runs in a process of its own, so that a "
                        "CUDA fault or a hang costs that row alone)")
    p.add_argument("--row-json", metavar="OUT", help=argparse.SUPPRESS)  # a row's process: its one result, to OUT
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Dry run, docs page, or the rows on this GPU."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.docs:
        from launch.bench.report import read_json

        Path(args.docs_out).write_text(markdown(read_json(args.docs)))
        print(f"wrote {args.docs_out} from {args.docs}")
        return 0
    rows = [ROWS[ROW_NAMES.index(name)] for name in args.only] if args.only else ROWS
    if args.dry_run:
        for r in dry_run(rows):
            print(f"{r['row']:<20} budget {r['budget_s']:>4.0f} s  {r['runs']}\n{'':<20} peer: {r['peer']}; "
                  f"{r['status']}")
        print(f"total budget {sum(r.budget_s for r in rows):.0f} s" + (f"; would install the wheels in {args.peers}"
                                                                      if args.peers else ""))
        return 0
    if args.row_json:  # one row's process (run_isolated): its result only
        Path(args.row_json).write_text(json.dumps(run_rows(args, rows)[0], default=str))
        return 0
    if not torch.cuda.is_available():
        raise NoCuda(f"moe-bench gpu needs a CUDA GPU: torch {torch.__version__} sees none "
                     f"(torch.cuda.is_available() is False); --dry-run lists the rows without one")
    notes = [install_peers(args.peers)] if args.peers else []
    notes.append("MFU: model FLOPs per token (launch.metrics.flops, causal attention) x tokens/s over the GPU's dense "
                 "peak; the same formula for every row. torch.compile: off for ours and the peers; activation "
                 "checkpointing: the config's train.recompute (none in configs/gpu-1x.toml), none for the peers")
    head = header("gpu", argv, notes)
    print(header_line(head))
    doc: dict[str, Any] = {"header": head, "key": ["row"], "metrics": METRICS, "rows": []}

    def partial(rows_so_far: list[dict[str, Any]]) -> None:
        if args.json:
            write_json(args.json, head, rows_so_far, doc["key"], METRICS)

    if args.in_process:
        results = doc["rows"] = run_rows(args, rows, partial)
    else:
        results = doc["rows"] = run_isolated(rows, args.deadline, partial)
    compare_trainers(results)
    print(table(results, SUMMARY, left=2))
    if args.json:
        print("\n".join(write_outputs(doc, args.json)))
    return 0 if all(not r["status"].startswith(("error", "OUTPUT")) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
