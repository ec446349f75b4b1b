"""moe-plan: predict memory per GPU, bytes per link, bubble, step time and MFU of a config, or search layouts."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, replace
from pathlib import Path

from launch.config.run import RunConfig, load_config
from launch.errors import cli
from launch.plan.calibrate import render as render_checks
from launch.plan.calibrate import fitted_constants, to_dicts, validate
from launch.plan.efficiency import ATTENTION_SUSTAINED_CLOCK, MOE_HANDLING, PRECISIONS, SLOT_SECONDS, SUSTAINED_CLOCK
from launch.plan.memory import KERNELS, RECOMPUTE
from launch.plan.measure_gpu import measure_gpu
from launch.plan.measure import compare, cpu_machine, measure
from launch.plan.imbalance import measured_imbalance, parse_zipf, zipf_imbalance
from launch.plan.planner import (COMM_SM_SHARE, PAIR_HIDDEN, Machine, Options, chunk_tokens, make_plan,
                                 runtime_handling)
from launch.plan.presets import GPU, GPUS, RECIPES, gpu_preset
from launch.plan.report import known_error, render, table, to_dict
from launch.plan.search import describe, search

OVERRIDES = {"peak_tflops": "bf16_tflops", "fp8_tflops": "fp8_tflops", "memory_gb": "memory_gb",
             "intra_node_gbps": "intra_node_gbps", "inter_node_gbps": "inter_node_gbps",
             "exchange_latency_us": "exchange_latency_us"}
NEEDED_FOR_CUSTOM = ("peak_tflops", "memory_gb", "intra_node_gbps", "inter_node_gbps")


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="moe-plan", description=__doc__)
    p.add_argument("config", nargs="?", help="TOML run config (launch.config.run)")
    p.add_argument("--validate", action="store_true", help="plan every published run of launch/plan/calibration.toml "
                   "in its own layout and print predicted beside published tokens/s per GPU (no config needed)")
    p.add_argument("--search", action="store_true", help="rank every layout on --gpus GPUs that fits")
    p.add_argument("--gpus", type=int, help="GPUs (plan: must equal the config's pp x dp x cp x tp; search: required)")
    p.add_argument("--gpus-per-node", type=int, help="default: the config's parallel.gpus_per_node, else 8")
    p.add_argument("--gpu", help=f"preset: {', '.join(GPUS)} (default h800 unless every figure below is given)")
    p.add_argument("--peak-tflops", type=float, help="dense BF16 TFLOPS per GPU")
    p.add_argument("--fp8-tflops", type=float, help="dense FP8 TFLOPS per GPU (default 2x --peak-tflops)")
    p.add_argument("--memory-gb", type=float, help="GPU memory, GB")
    p.add_argument("--intra-node-gbps", type=float, help="NVLink GB/s per GPU per direction")
    p.add_argument("--inter-node-gbps", type=float, help="inter-node GB/s per GPU per direction")
    p.add_argument("--exchange-latency-us", type=float, help="fixed cost of one EP all-to-all exchange (default 0)")
    p.add_argument("--gemm-efficiency", type=float, help="price every GEMM at this fraction of peak (default: by shape "
                   "and precision, launch/plan/efficiency.py)")
    p.add_argument("--comm-sm-share", type=float, default=COMM_SM_SHARE,
                   help=f"share of SMs communication holds while it overlaps compute (default {COMM_SM_SHARE:.3f}: "
                        "DeepSeek-V3's 20 of 132)")
    p.add_argument("--moe-handling", choices=MOE_HANDLING,
                   help="how the stack handles an MoE layer's routed slots: synced (expert counts read to the host "
                        "every layer, eager launches: this project's runtime, Megatron-Core's all-to-all; "
                        f"{SLOT_SECONDS['synced'] * 1e9:g} ns a slot) or captured (router and preprocessing in CUDA "
                        f"graphs before a fused DeepEP/HybridEP dispatch; {SLOT_SECONDS['captured'] * 1e9:g} ns): "
                        "each cost fitted to its published runs, --validate (default: the config's runtime, captured "
                        "with train.cuda_graphs = true, else synced)")
    p.add_argument("--slot-ns", type=float, help="ns per routed slot of an MoE layer's forward + backward beyond its "
                   "GEMMs and bytes (default: --moe-handling's; 0: none)")
    p.add_argument("--clock", type=float, default=SUSTAINED_CLOCK,
                   help=f"share of its boost clock a GPU's GEMMs hold through a run (default {SUSTAINED_CLOCK:g}, "
                        "measured on an H100; `moe-bench clock` measures it on the GPU at hand; 1: a short benchmark)")
    p.add_argument("--attention-clock", type=float, default=ATTENTION_SUSTAINED_CLOCK,
                   help=f"the same for flash attention (default {ATTENTION_SUSTAINED_CLOCK:g})")
    p.add_argument("--recompute", choices=RECOMPUTE, help="activation recomputation (default: the config's "
                   "train.recompute; --measure runs the model with it)")
    p.add_argument("--recipe", choices=tuple(RECIPES), help="bytes per param of weights/grads/optimizer "
                   "(default: this project's ZeRO-1 for train.dtype)")
    p.add_argument("--linears", choices=PRECISIONS, help="precision of every linear layer's GEMMs (default: BF16, "
                   "the routed experts as model.expert_precision says; the router and LM head stay BF16); fp8-block "
                   "on DeepGEMM-like kernels (this project's; MXFP8 on Blackwell), fp8-block-te through Transformer "
                   "Engine's Float8BlockScaling on Hopper")
    p.add_argument("--virtual-stages", type=int, default=1, help="1f1b: model chunks per rank of an interleaved "
                   "1F1B (Megatron's VPP): the bubble shrinks by this factor")
    p.add_argument("--paired-1f1b", action="store_true", help="1f1b: steady-state F and B run as overlapped pairs "
                   "hiding each other's EP exchanges (Megatron-Core's EP all-to-all overlap); one stage (schedule "
                   "none): each micro-batch's F beside the previous one's B")
    p.add_argument("--pair-hidden", type=float, default=PAIR_HIDDEN,
                   help=f"paired 1f1b: share of its EP exchanges a pair hides of what the other half's compute "
                        f"could cover (default {PAIR_HIDDEN:g}: Megatron-Core's, fitted to the model zoo's A/B, "
                        "--validate; 1: all)")
    p.add_argument("--overlap-dp", action="store_true", help="the DP grad reduce runs behind the step's last backward")
    skew = p.add_mutually_exclusive_group()
    skew.add_argument("--loads", metavar="RUN_DIR", help="price each MoE layer at its busiest EP rank as a run measured "
                      "it: the mean busiest-over-mean rows of RUN_DIR/metrics.jsonl's 'stragglers' records (same EP "
                      "size and model; default: forced balance, as every published run)")
    skew.add_argument("--imbalance", metavar="zipf:S", help="price each MoE layer at its busiest EP rank under a "
                      "synthetic skew: expert i drawn with probability ~ i^-S (top-k without replacement, one "
                      "exchange's tokens, default placement; the config's redundant experts placed for it)")
    p.add_argument("--sample-tokens", type=int, default=1024, help="tokens per EP rank routed for the traffic")
    p.add_argument("--kernels", choices=KERNELS,
                   help="activation bytes of this project's ops or of fused kernels (DeepSeek-V3's); default: what "
                        "the runtime keeps for the config (fused-fp8 with its FP8 recipe keys on, else project)")
    p.add_argument("--measure", action="store_true", help="also run the layout here (gloo ranks, the trainer's model, "
                   "runtime and ZeRO-1) and print each rank's measured figures beside the plan's")
    p.add_argument("--steps", type=int, default=30, help="measure: forward-backward steps (bytes and memory of the last; "
                   "idle: median after the first)")
    p.add_argument("--top", type=int, default=10, help="search: layouts to print")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override")
    p.add_argument("--measure-gpu", metavar="RESULTS", help="print moe-plan's per-phase compute times and memory "
                   "beside a GPU's (a `moe-bench gpu --json` result or a `moe-train --rehearse --device cuda --json` "
                   "report) as ratios; with CONFIG (the rehearsed one) re-planned by this moe-plan")
    p.add_argument("--json", help="write every figure here")
    return p


def machine_from(args: argparse.Namespace, default_gpn: int, config: RunConfig) -> Machine:
    """The GPU preset with flag overrides (a GPU without a preset needs every figure); every figure finite; the
    routed slots' cost of --moe-handling, else of config's runtime (planner.runtime_handling)."""
    for name, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{name.replace('_', '-')} = {value} must be a finite number")
    given = {name: getattr(args, name) for name in OVERRIDES if getattr(args, name) is not None}
    for name, value in given.items():
        if value < 0 or (value == 0 and name != "exchange_latency_us"):
            raise ValueError(f"--{name.replace('_', '-')} = {value} must be > 0"
                             + (" or 0" if name == "exchange_latency_us" else ""))
    if args.gpu is None and given:
        missing = [f"--{n.replace('_', '-')}" for n in NEEDED_FOR_CUSTOM if n not in given]
        if missing:
            raise ValueError(f"no --gpu preset given, so {', '.join(missing)} must be given too "
                             f"(or pick --gpu {'|'.join(GPUS)})")
        base = GPU("custom", given["peak_tflops"], given.get("fp8_tflops", 2 * given["peak_tflops"]), 0, 0, 0,
                   "command line")
    else:
        base = gpu_preset(args.gpu or "h800")
    gpu = replace(base, **{OVERRIDES[n]: v for n, v in given.items()})
    gpn = args.gpus_per_node if args.gpus_per_node is not None else default_gpn
    if gpn < 1:
        raise ValueError(f"--gpus-per-node = {gpn} must be >= 1")
    if args.gemm_efficiency is not None and not 0 < args.gemm_efficiency <= 1:
        raise ValueError(f"--gemm-efficiency = {args.gemm_efficiency} must be in (0, 1]")
    if not 0 <= args.comm_sm_share < 1:
        raise ValueError(f"--comm-sm-share = {args.comm_sm_share} must be in [0, 1)")
    if not 0 <= args.pair_hidden <= 1:
        raise ValueError(f"--pair-hidden = {args.pair_hidden} must be in [0, 1]")
    if args.slot_ns is not None and args.slot_ns < 0:
        raise ValueError(f"--slot-ns = {args.slot_ns} must be >= 0")
    handling = args.moe_handling or runtime_handling(config)
    slot_seconds = SLOT_SECONDS[handling] if args.slot_ns is None else args.slot_ns * 1e-9
    for flag, value in (("--clock", args.clock), ("--attention-clock", args.attention_clock)):
        if not 0 < value <= 1:
            raise ValueError(f"{flag} = {value} must be in (0, 1]")
    return Machine(gpu, gpn, args.gemm_efficiency, comm_sm_share=args.comm_sm_share, slot_seconds=slot_seconds,
                   clock=args.clock, attention_clock=args.attention_clock, pair_hidden=args.pair_hidden)


def run(args: argparse.Namespace) -> dict:
    """Plan, search or validate as the arguments say; print the tables, return the JSON-ready result."""
    if args.validate:
        checks = validate()
        constants = fitted_constants(checks)
        print(render_checks(checks, constants))
        return {"runs": to_dicts(checks), "constants": constants}
    if args.measure_gpu:
        return measure_gpu(args.measure_gpu, load_config(args.config, args.set) if args.config else None)
    if args.config is None:
        raise ValueError("give a CONFIG to plan (or --validate, or --measure-gpu)")
    config = load_config(args.config, args.set + ([f'train.recompute="{args.recompute}"'] if args.recompute else []))
    par = config.parallel
    options = Options(config.train.recompute, args.kernels, args.recipe, args.sample_tokens, args.linears,
                      args.virtual_stages, args.paired_1f1b, args.overlap_dp, imbalance_of(args, config))
    if args.search:
        if not args.gpus or args.gpus < 1:
            raise ValueError("--search needs --gpus N (N >= 1)")
        machine = machine_from(args, par.gpus_per_node or min(8, args.gpus), config)
        result = search(config, args.gpus, machine, options)
        rows = [[i + 1, describe(vars(p.config.parallel), p.config.chunks_per_step), p.options.recompute,
                 p.peak_memory / 1e9, p.idle_fraction, p.step_seconds, p.tokens_per_second / args.gpus, p.mfu]
                for i, p in enumerate(result.ranked[:args.top])]
        print(f"{len(result.ranked)} layouts fit on {args.gpus} x {machine.gpu.name}, {len(result.cut)} cut")
        print(table(["#", "layout", "recompute", "peak GB", "idle", "step s", "tok/s/GPU", "MFU"], rows))
        print(known_error())
        kinds: dict[str, list[str]] = {}  # reasons that differ only in their numbers, one example each
        for _, why in result.cut:
            kinds.setdefault(re.sub(r"\d+(\.\d+)?", "#", why), []).append(why)
        print("cut (count, one example of each kind of reason):")
        for examples in sorted(kinds.values(), key=len, reverse=True):
            print(f"  {len(examples):5d}  {examples[0]}")
        return {"ranked": [to_dict(p) for p in result.ranked], "cut": [{"layout": l, "reason": r}
                                                                      for l, r in result.cut]}
    if args.gpus is not None and args.gpus != par.world_size:
        raise ValueError(f"--gpus {args.gpus} differs from the config's layout pp x dp x cp x tp = {par.world_size} "
                         f"(change [parallel] or use --search)")
    if args.measure:
        return run_measured(args, config, options)
    machine = machine_from(args, par.gpus_per_node or par.world_size, config)
    plan = make_plan(config, machine, options)
    print(render(plan))
    return to_dict(plan)


def imbalance_of(args: argparse.Namespace, config: RunConfig) -> tuple[float, ...]:
    """Per routed MoE layer, the busiest EP rank's rows over the balanced share that --loads or --imbalance give
    (launch.plan.imbalance); () without either: forced balance."""
    if args.loads is None and args.imbalance is None:
        return ()
    flag = "--loads" if args.loads is not None else "--imbalance"
    if args.search:
        raise ValueError(f"{flag} with --search: a skew's busiest rank depends on the EP size and tokens of each "
                         f"layout; plan one layout at a time")
    if args.loads is not None:
        return measured_imbalance(args.loads, config)
    return zipf_imbalance(config, parse_zipf(args.imbalance), chunk_tokens(config) // config.parallel.tp)


def run_measured(args: argparse.Namespace, config: RunConfig, options: Options) -> dict:
    """Plan config on this CPU (or the machine the flags give), run it, print measured beside predicted."""
    if args.steps < 1:
        raise ValueError(f"--steps = {args.steps} must be >= 1")
    given = args.gpu or any(getattr(args, name) is not None for name in OVERRIDES)
    machine = machine_from(args, config.parallel.gpus_per_node or config.parallel.world_size, config) if given \
        else cpu_machine(config)
    plan = make_plan(config, machine, options)
    checks = compare(plan, measure(config, args.steps))
    print(f"{describe(vars(config.parallel), config.chunks_per_step)}: measured over {args.steps} steps "
          f"beside predicted on {machine.gpu.name} ({machine.gpu.source})")
    print(table(["rank", "figure", "predicted", "measured", "error", "tolerance", "ok"],
                [["all" if c.rank < 0 else c.rank, c.figure, _figure(c.predicted), _figure(c.measured),
                  c.describe_error(), c.describe_tolerance(), {None: "-", True: "yes", False: "NO"}[c.ok]]
                 for c in checks]))
    return {"plan": to_dict(plan), "checks": [{**asdict(c), "error": c.error, "ok": c.ok} for c in checks]}


def _figure(value: float) -> str:
    return f"{value:,.0f}" if value == int(value) or abs(value) >= 1 else f"{value:.3f}"


@cli("moe-plan: error")
def main(argv: list[str] | None = None) -> int:
    """Entry point of moe-plan."""
    args = parser().parse_args(argv)
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
