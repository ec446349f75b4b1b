"""`moe-bench layer`: our MoELayer's forward + backward beside torchtitan's MoE and Megatron-Core's MoELayer.

Every contender runs the same shape and dtype on CPU, one thread per process, on 1 process and on EP
ranks over gloo (each rank its own [batch, seq] tokens, the experts split evenly): ours in processes
started by launch.parallel.spawn.run_processes, each peer in its own interpreter (a separate virtual
environment: launch/bench/peers/setup.sh) running launch/bench/peers/<peer>_moe.py, which imports only
torch and the peer library; the same processes start those, one per rank. All time the same loop
(launch/bench/peers/fwdbwd.py): warm-up steps, then repeats of drop grads, forward, backward of a fixed
output gradient, a barrier before each under EP. Every contender loads the same weights (ours, at --seed)
and first checks its output on each rank's tokens against one process of our layer in float64 ("rel diff":
max |out - reference| / max |reference| over the tokens whose top-k no rounding of the dtype can flip, those
whose k-th and (k+1)-th router logits differ by more than 2 eps of the dtype times the largest; the run fails
when it exceeds 1e-4, or 5e-2 where experts compute in bf16), so all run the same routing and experts. A row's
time is the median over repeats of the slowest rank; "x ours" is its time over ours at the same EP. Contenders
run one after another (rounds rotate the order; the ratio's range across rounds says how much the machine
drifted). A peer that is not installed or fails says why in its row.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dispatch import EPDispatcher
from dispatch.layout import check_num_experts
from launch.parallel.spawn import PEER_LOST
from launch.bench.peers.fwdbwd import TIE_EPS, decided_tokens, fwd_bwd, inputs, relative_error, time_steps
from launch.bench.progress import BenchProgress, BudgetExceeded, call_budget, run_ranks
from launch.bench.report import LOWER, emit, header
from moe.config import ModelConfig
from moe.layer import MoELayer

OURS = "ours"
PEERS_DIR = Path(__file__).parent / "peers"
PEERS = {"torchtitan": "torchtitan_moe.py", "megatron": "megatron_moe.py"}
PEERS_HOME = Path(os.environ.get("MOE_BENCH_PEERS", Path.home() / ".cache" / "moe-bench" / "peers"))
SHAPES = {"small": {"hidden": 128, "ffn": 256, "experts": 8, "top_k": 2, "batch": 2, "seq": 128},
          "large": {"hidden": 1024, "ffn": 512, "experts": 16, "top_k": 4, "batch": 4, "seq": 512}}
DTYPES = ("float32", "bfloat16")
RUNS = {  # what each contender runs beyond the common routing (softmax, top-k renormalised, dropless, no losses)
    OURS: "moe.MoELayer: torch._grouped_mm experts in the input dtype (a loop where its shapes do not fit), "
          "dispatch.EPDispatcher all-to-all under EP",
    "torchtitan": "MoE: GroupedExperts compute in bf16 whatever the input dtype, router gate in fp32, "
                  "AllToAllTokenDispatcher under EP (partial-DTensor backend, cpu mesh)",
    "megatron": "MoELayer: SequentialMLP (one MLP per expert, in turn; grouped GEMM needs Transformer Engine on "
                "a GPU), MoEAlltoAllTokenDispatcher; its torch.cuda stream calls are no-ops on CPU",
}
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # rel diff allowed, by the dtype the experts compute in
HINT = "run a smaller shape (--shape small, --seq, --hidden) or raise --call-budget"


def model_config(spec: dict[str, Any]) -> ModelConfig:
    """Our layer's config at the spec's shape with the routing every peer can match."""
    return ModelConfig(hidden_size=spec["hidden"], num_heads=1, num_kv_heads=1, num_layers=1, first_k_dense=0,
                       num_experts=spec["experts"], top_k=spec["top_k"], expert_ffn_size=spec["ffn"],
                       num_shared_experts=0, score_func="softmax", norm_topk=True)


def our_weights(layer: MoELayer) -> dict[str, torch.Tensor]:
    """The weights every contender loads (fwdbwd's layout)."""
    return {"router": layer.router.weight.detach(), "w_gate_up": layer.experts.w_gate_up.detach(),
            "w_down": layer.experts.w_down.detach()}


def load_weights(layer: MoELayer, weights: dict[str, torch.Tensor]) -> MoELayer:
    """layer holding weights (all experts: before to_expert_parallel)."""
    with torch.no_grad():
        for param, value in zip((layer.router.weight, layer.experts.w_gate_up, layer.experts.w_down),
                                (weights["router"], weights["w_gate_up"], weights["w_down"])):
            param.copy_(value)
    return layer


def write_weights(spec: dict[str, Any], ranks: int, path: Path) -> float:
    """Our layer's weights at spec["seed"] and, for each of `ranks` ranks, the float64 output of one process of
    it on that rank's tokens and the mask of its tokens the check counts (fwdbwd.decided_tokens), to path
    (torch.save); the share of tokens counted."""
    torch.manual_seed(spec["seed"])
    weights = our_weights(MoELayer(model_config(spec)))
    reference = load_weights(MoELayer(model_config(spec)).double(), weights)
    tokens = [inputs(spec, rank)[0].double() for rank in range(ranks)]
    with torch.no_grad():
        outputs = [reference(x)[0] for x in tokens]
    checked = [decided_tokens(x @ weights["router"].double().T, spec["top_k"], getattr(torch, spec["dtype"]))
               for x in tokens]
    torch.save({**weights, "reference": outputs, "checked": checked}, path)
    return torch.cat([c.flatten() for c in checked]).double().mean().item()


def ours_worker(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """This rank's seconds per timed forward+backward of our MoELayer (experts split over the world when > 1)."""
    spec = opts["spec"]
    weights = torch.load(spec["weights"], weights_only=True)
    layer = load_weights(MoELayer(model_config(spec)), weights).to(getattr(torch, spec["dtype"]))
    if world > 1:
        layer.to_expert_parallel(EPDispatcher(spec["experts"]))
    x, dy = inputs(spec, rank)
    with torch.no_grad():
        diff = relative_error(layer(x)[0], weights["reference"][rank], weights["checked"][rank])
    what = f"{OURS} EP={world} forward+backward"
    seconds = time_steps(fwd_bwd(layer, lambda t: layer(t)[0], x, dy), spec["warmup"], spec["repeats"],
                         barrier=dist.barrier if world > 1 else None,
                         guard=lambda _: call_budget(opts["call_budget"], what, opts))
    return {"seconds": seconds, "max_rel_diff": diff, "info": {"library": "moe-pretrain (this checkout)",
                                         "local_experts": layer.experts.w_down.shape[0]}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_worker(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Run this rank of the peer's script in its interpreter (rank 0 picks the peer's rendezvous port);
    its JSON line, or {"error": why}."""
    port = [_free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, 0)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the peer must not import this project
    env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]),
               OMP_NUM_THREADS=str(opts["spec"]["threads"]))
    command = [opts["python"], str(PEERS_DIR / PEERS[opts["peer"]]), json.dumps(opts["spec"])]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=opts["peer_timeout"])
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within --peer-timeout {opts['peer_timeout']:g} s"}
    except OSError as err:
        return {"error": f"cannot run {opts['python']}: {err.strerror}"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit code {done.returncode}: {tail[:300]}"}


def peer_python(name: str, given: dict[str, str]) -> str | None:
    """The peer's interpreter: --peer-python NAME=PATH, else PEERS_HOME/NAME/bin/python when it exists."""
    if name in given:
        return given[name]
    default = PEERS_HOME / name / "bin" / "python"
    return str(default) if default.exists() else None


def measure(name: str, ep: int, args: argparse.Namespace, progress: BenchProgress) -> dict[str, Any]:
    """{"seconds": slowest rank's per repeat, "info"} of one contender at one EP size, or {"error": why}."""
    opts = {"spec": args.spec, "call_budget": args.call_budget, "quiet": args.quiet}
    progress(f"{name} EP={ep}")
    if name == OURS:
        results = run_ranks(ours_worker, ep, opts, HINT)
    else:
        python = peer_python(name, args.peer_python)
        if python is None:
            return {"error": f"not installed: run {PEERS_DIR / 'setup.sh'} (virtual environments in {PEERS_HOME}, "
                             f"or $MOE_BENCH_PEERS) or pass --peer-python {name}=PYTHON"}
        results = run_ranks(peer_worker, ep, {**opts, "peer": name, "python": python,
                                              "peer_timeout": args.peer_timeout}, HINT)
    errors = [r["error"] for r in results if "error" in r]
    if errors:  # the cause, not a rank that lost its peer because of it
        return {"error": next((e for e in errors if not PEER_LOST.search(e)), errors[0])}
    return {"seconds": [max(ranks) for ranks in zip(*(r["seconds"] for r in results))],
            "max_rel_diff": max(r["max_rel_diff"] for r in results), "info": results[0]["info"]}


def _quartiles(seconds: list[float]) -> tuple[float, float, float]:
    if len(seconds) == 1:
        return seconds[0], seconds[0], seconds[0]
    q1, median, q3 = statistics.quantiles(seconds, n=4, method="inclusive")
    return q1, median, q3


def summarise(runs: dict[tuple[str, int], list[dict[str, Any]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (contender, EP): median and spread (interquartile range over the median, as launch.bench.harness
    reports it) over every round's repeats, the
    ratio to ours at the same EP and its range across rounds, or the reason it has no time."""
    rows = []
    for (name, ep), rounds in runs.items():
        row: dict[str, Any] = {"contender": name, "ep": ep, **{k: args.spec[k] for k in (*SHAPES["small"], "dtype")},
                               "repeats": args.repeats * args.rounds, "runs": RUNS[name]}
        error = next((r["error"] for r in rounds if "error" in r), None)
        if error is not None:
            rows.append({**row, "status": error, "step_ms": None, "step_ms_spread": None})
            continue
        q1, median, q3 = _quartiles([s for r in rounds for s in r["seconds"]])
        info = rounds[-1]["info"]
        diff = max(r["max_rel_diff"] for r in rounds)
        tolerance = TOLERANCE[info.get("expert_dtype", args.spec["dtype"])]
        rows.append({**row, **info, "step_ms": 1e3 * median, "step_ms_spread": (q3 - q1) / median,
                     "round_medians_ms": [1e3 * statistics.median(r["seconds"]) for r in rounds],
                     "max_rel_diff": diff, "tolerance": tolerance,
                     "status": "ok" if diff <= tolerance else f"OUTPUT DIFFERS from the reference (> {tolerance:g})"})
    for row in rows:
        ours = next(r for r in rows if r["contender"] == OURS and r["ep"] == row["ep"])
        if row["step_ms"] is None or ours["step_ms"] is None:
            row["vs_ours"] = row["vs_ours_min"] = row["vs_ours_max"] = None
            continue
        per_round = [p / o for p, o in zip(row["round_medians_ms"], ours["round_medians_ms"])]
        row["vs_ours"] = row["step_ms"] / ours["step_ms"]
        row["vs_ours_min"], row["vs_ours_max"] = min(per_round), max(per_round)
    return rows


COLUMNS = [("contender", "contender", ""), ("EP", "ep", "d"), ("fwd+bwd ms", "step_ms", ".2f"),
           ("spread", "step_ms_spread", ".2f"), ("rel diff", "max_rel_diff", ".1e"), ("x ours", "vs_ours", ".2f"),
           ("min", "vs_ours_min", ".2f"),
           ("max", "vs_ours_max", ".2f"), ("experts/rank", "local_experts", "d"), ("library", "library", ""),
           ("status", "status", "")]


def _csv_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _peer_pythons(p: argparse.ArgumentParser, pairs: list[str]) -> dict[str, str]:
    given = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or name not in PEERS or not path:
            p.error(f"--peer-python {pair!r}: expected NAME=PYTHON with NAME one of {', '.join(PEERS)}")
        given[name] = path
    return given


def build_parser() -> argparse.ArgumentParser:
    """The suite's options."""
    p = argparse.ArgumentParser(prog="moe-bench layer", description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--shape", choices=SHAPES, default="small",
        help="; ".join(f"{k}: " + ", ".join(f"{n} {v}" for n, v in s.items()) for k, s in SHAPES.items()))
    for name in SHAPES["small"]:
        add(f"--{name.replace('_', '-')}", type=int, help=f"override the shape's {name}")
    add("--dtype", choices=DTYPES, default="float32", help="parameters and activations")
    add("--ep", type=_csv_ints, default=[1, 2], help="EP sizes (processes), comma-separated (default 1,2)")
    add("--peers", default=",".join(PEERS), help=f"comma-separated subset of {', '.join(PEERS)} ('' for none)")
    add("--peer-python", action="append", default=[], metavar="NAME=PYTHON",
        help=f"a peer's interpreter (default: {PEERS_HOME}/NAME/bin/python, made by --setup-peers)")
    add("--setup-peers", metavar="DIR", help="make the peers' virtual environments in DIR (setup.sh) and exit")
    add("--repeats", type=int, default=20, help="timed steps per contender and round")
    add("--warmup", type=int, default=3, help="untimed steps per contender and round")
    add("--rounds", type=int, default=2, help="times every contender runs, the order rotated each round")
    add("--seed", type=int, default=0, help="weights; rank r's tokens use seed + 1000 (r + 1)")
    add("--call-budget", type=float, default=120.0,
        help="seconds one of our steps may take before the run stops naming it (0: no budget)")
    add("--peer-timeout", type=float, default=600.0, help="seconds one peer run (all its rounds' steps) may take")
    add("--quiet", action="store_true", help="no progress lines")
    add("--json", metavar="FILE", help="write the header and the rows")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options, checked before anything starts; args.spec is what every contender is handed."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.setup_peers:
        return args
    spec = {name: getattr(args, name) if getattr(args, name) is not None else value
            for name, value in SHAPES[args.shape].items()}
    for name, value in (*spec.items(), ("repeats", args.repeats), ("rounds", args.rounds)):
        if value < 1:
            p.error(f"--{name.replace('_', '-')} = {value} must be >= 1")
    if args.warmup < 0 or args.call_budget < 0 or not args.peer_timeout > 0:
        p.error("--warmup and --call-budget must be >= 0, --peer-timeout > 0")
    if not args.ep or min(args.ep) < 1:
        p.error(f"--ep {args.ep}: give EP sizes >= 1, e.g. 1,2")
    try:
        model_config(spec)
        for ep in args.ep:
            check_num_experts(spec["experts"], ep)
    except ValueError as err:
        p.error(str(err))
    args.peer_list = [name for name in args.peers.split(",") if name]
    unknown = [name for name in args.peer_list if name not in PEERS]
    if unknown:
        p.error(f"--peers {args.peers!r}: unknown {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    args.peer_python = _peer_pythons(p, args.peer_python)
    args.spec = {**spec, "dtype": args.dtype, "seed": args.seed, "threads": 1, "warmup": args.warmup,
                 "repeats": args.repeats, "timeout_s": args.peer_timeout}
    return args


def main(argv: list[str] | None = None) -> int:
    """Time every contender at every EP size in rounds, print the table and what each runs, write --json."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.setup_peers:
        return subprocess.run(["bash", str(PEERS_DIR / "setup.sh"), args.setup_peers]).returncode
    progress = BenchProgress("layer", not args.quiet)
    weights_dir = tempfile.TemporaryDirectory(prefix="moe-bench-layer-")
    args.spec["weights"] = str(Path(weights_dir.name) / "weights.pt")
    checked = write_weights(args.spec, max(args.ep), Path(args.spec["weights"]))
    contenders = [(name, ep) for ep in args.ep for name in (OURS, *args.peer_list)]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in contenders}
    try:
        for r in range(args.rounds):
            for key in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
                runs[key].append(measure(*key, args, progress))
    except BudgetExceeded as err:
        print(f"moe-bench layer: stopped: {err}", file=sys.stderr)
        return 3
    finally:
        weights_dir.cleanup()
    rows = summarise(runs, args)
    s = args.spec
    notes = [f"hidden {s['hidden']}, expert ffn {s['ffn']}, {s['experts']} experts top-{s['top_k']}, tokens "
             f"[{s['batch']}, {s['seq']}] per rank, {s['dtype']}, CPU, 1 thread per process; {args.rounds} rounds x "
             f"({args.warmup} warm-up + {args.repeats} timed) steps per contender; x ours = its time / ours at "
             "that EP (min, max: over rounds)",
             "routing everywhere: softmax scores, top-k, weights renormalised over the k, dropless, no balance loss, "
             "no shared expert",
             f"rel diff: over the {checked:.1%} of tokens whose top-k a {s['dtype']} router cannot flip (k-th and "
             f"(k+1)-th logits apart by > {TIE_EPS} eps of {s['dtype']} x the largest |logit|)",
             *(f"{name}: {RUNS[name]}" for name in (OURS, *args.peer_list))]
    head = header("layer", argv, notes)
    emit(head, rows, COLUMNS, args.json, ["contender", "ep", *SHAPES["small"], "dtype"],
         {"step_ms": LOWER})
    print("\n".join(f"note: {note}" for note in notes))
    bad = [f"{r['contender']} EP={r['ep']}" for r in rows if r["status"].startswith("OUTPUT DIFFERS")]
    if bad:
        print(f"moe-bench layer: outputs differ from one process of our layer in float64: {', '.join(bad)}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
