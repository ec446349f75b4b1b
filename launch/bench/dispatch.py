"""`moe-bench dispatch`: flat and hierarchical EP dispatch (bf16/fp8) against the standard per-expert all-to-all
(Megatron-Core's alltoall dispatcher) and the classic one-hot capacity dispatch (GShard).

All eight contenders run side by side, in rounds (launch.bench.harness), in the same EP processes (gloo on CPU
with simulated nodes, NCCL on GPUs). Each call starts after a barrier and is timed on every rank; a round's
time is its slowest rank's, and the table shows the median over rounds with its spread; the speedups over the
peers are taken round by round. Experts are the identity, so every point checks
combine(dispatch(x)) == x * kept routing weights (calc_diff). Byte counts are the dispatchers' own counters,
checked against the prediction made from the routing alone. --sweep runs a grid of any options and plots it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from dispatch.choices import allowed_values
from dispatch.layout import check_num_experts
from dispatch.predict import predict_traffic
from dispatch.synthetic import ROUTINGS
from launch.bench.harness import fields, ratio_fields, slowest
from dispatch.topology import BACKENDS, make_topology
from launch.bench.alltoall import per_expert_traffic
from launch.bench.dispatch_model import V3, LinkModel, byte_fields, moved_bytes, predict_v3, projected_fields
from launch.bench.dispatch_worker import (CONTENDERS, KINDS, ONEHOT, PER_EXPERT, cpu_has_native_bf16,
                                          peer_compute_dtype, points_worker, rank_routing)
from launch.bench.onehot import dropped_slots, onehot_capacity, onehot_traffic
from launch.parallel.device import CommBackend
from launch.bench.plot import sweep_figure, write_figure
from launch.bench.progress import BenchProgress, BudgetExceeded, run_ranks
from launch.bench.report import HIGHER, LOWER, header, header_line, table, write_json
from launch.bench.sweep import point_argv, point_label, sweep_axes, sweep_points

V3_HIDDEN = 7168
GPU_TOKENS, CPU_TOKENS, SMALL_CPU_TOKENS = 4096, 1024, 512  # default tokens per rank


def default_tokens(comm: str, nproc: int) -> int:
    """GPU_TOKENS on GPUs; on CPU, CPU_TOKENS with a core per process, SMALL_CPU_TOKENS when processes share cores
    (the one-hot peer's cost grows with tokens^2)."""
    if comm == "nccl":
        return GPU_TOKENS
    return CPU_TOKENS if (os.cpu_count() or 1) >= nproc else SMALL_CPU_TOKENS
TOLERANCE = {"bf16": 1e-4, "fp8": 2e-3}  # calc_diff of combine(dispatch(x)) against x * kept weights
SHAPE = ("tokens", "hidden", "experts", "top_k", "nproc", "gpus_per_node", "routing")
KEY = ["section", "backend", "payload", "point", *SHAPE]  # rows of runs at other shapes do not match
METRICS = {"dispatch_ms": LOWER, "combine_ms": LOWER, "algbw_gbps": HIGHER, "combine_algbw_gbps": HIGHER}


def predicted_traffic(backend: str, payload: str, indices: list[torch.Tensor], opts: dict[str, Any]) -> list[dict]:
    """Per rank {"dispatch", "combine"} Traffic expected for this contender (no communication)."""
    topology = make_topology(opts["nproc"], opts["gpus_per_node"])
    if backend == ONEHOT:
        capacity = onehot_capacity(opts["tokens"], opts["top_k"], opts["experts"], opts["capacity_factor"])
        return onehot_traffic(topology, opts["experts"], capacity, opts["hidden"], payload)
    if backend == PER_EXPERT:
        return per_expert_traffic(indices, opts["experts"], topology, opts["hidden"], payload)
    return predict_traffic(indices, opts["experts"], topology, opts["hidden"], backend, payload)


def _row(rows: list[dict], backend: str, payload: str) -> dict:
    return next(r for r in rows if r["backend"] == backend and r["payload"] == payload)


def summarise(results: list[dict], opts: dict[str, Any], link: LinkModel | None) -> list[dict[str, Any]]:
    """One record per contender: times, algbw, bytes (measured == predicted checked), correctness, projections,
    ratios to both peers."""
    indices = [rank_routing(opts, r)[0] for r in range(opts["nproc"])]
    moved = moved_bytes(indices, opts["experts"], opts["hidden"])
    capacity = onehot_capacity(opts["tokens"], opts["top_k"], opts["experts"], opts["capacity_factor"])
    routed = sum(int((ids >= 0).sum()) for ids in indices)
    dropped = sum(dropped_slots(ids, opts["experts"], capacity) for ids in indices) / routed
    rows = []
    for key in CONTENDERS:
        measured = {kind: [r["traffic"][key][kind] for r in results] for kind in KINDS}
        expected = predicted_traffic(*key, indices, opts)
        timings = {kind: slowest([r["seconds"][key][kind] for r in results]) for kind in KINDS}
        times = {name: value for kind in KINDS for name, value in fields(f"{kind}_ms", timings[kind]).items()}
        diff = max(r["calc_diff"][key] for r in results)
        bytes_ok = all(m == e[kind] for kind in KINDS for m, e in zip(measured[kind], expected))
        row = {
            "section": "measured", "point": opts["point"], "contender": " ".join(key), "backend": key[0],
            "payload": key[1], **times,
            "algbw_gbps": moved / 1e6 / times["dispatch_ms"], "combine_algbw_gbps": moved / 1e6 / times["combine_ms"],
            **byte_fields(measured["dispatch"], opts["tokens"] * opts["nproc"]),
            **byte_fields(measured["combine"], opts["tokens"] * opts["nproc"], "combine_"),
            "bytes_match_prediction": bytes_ok, "calc_diff": diff, "correct": bytes_ok and diff < TOLERANCE[key[1]],
            "dropped_fraction": dropped if key[0] == ONEHOT else 0.0,
            "capacity": capacity if key[0] == ONEHOT else None,
            **projected_fields(measured, key[0], link, moved),
            **{name: opts[name] for name in (*SHAPE, "comm")}, "_total": timings["dispatch"] + timings["combine"],
        }
        row["bytes_per_token"] = row["inter_node_bytes_per_token"] + row["intra_node_bytes_per_token"]
        rows.append(row)
    for row in rows:  # ratios round by round: dispatch + combine of the peer over this contender's
        for peer, field in ((ONEHOT, "speedup_vs_onehot"), (PER_EXPERT, "speedup_vs_per_expert")):
            row.update(ratio_fields(field, _row(rows, peer, row["payload"])["_total"] / row["_total"]))
    for row in rows:
        del row["_total"]
    return rows


def _verdict(ok: bool, target: str) -> str:
    return f"   [acceptance {target}: {'met' if ok else 'not met'}]"


NAMES = [("backend", "backend", ""), ("payload", "payload", "")]
BYTES = [(part.replace("_", " ").replace("payload", "pay"), f"{part}_bytes_per_token", ".0f")
         for part in ("inter_payload", "inter_meta", "intra_payload", "intra_meta")]
PROJECTED = [("proj disp ms", "projected_dispatch_ms", ".4f"), ("proj comb ms", "projected_combine_ms", ".4f"),
             ("proj disp GB/s", "projected_algbw_gbps", ".1f")]
TIMES = [("disp ms", "dispatch_ms", ".1f"), ("spread", "dispatch_ms_spread", ".0%"), ("comb ms", "combine_ms", ".1f"),
         ("disp GB/s", "algbw_gbps", ".3f"), ("comb GB/s", "combine_algbw_gbps", ".3f"),
         ("x 1-hot", "speedup_vs_onehot", ".1f"), ("x per-exp", "speedup_vs_per_expert", ".2f"),
         ("spread", "speedup_vs_per_expert_spread", ".0%")]
CHECKS = [("calc_diff", "calc_diff", ".1e"), ("bytes=pred", "bytes_match_prediction", ""), ("ok", "correct", "")]
MEASURED = [*NAMES, *TIMES, *BYTES, *CHECKS]
SWEEP = [("point", "point_label", ""), *NAMES, *TIMES[:4], ("bytes/token", "bytes_per_token", ".0f"), *CHECKS]


def format_ratios(rows: list[dict]) -> str:
    """Acceptance ratios: hierarchical vs flat inter-node bytes, fp8 vs bf16 payload bytes, flat vs per-expert."""
    flat, hier, per_expert = (_row(rows, b, "bf16") for b in ("flat", "hierarchical", PER_EXPERT))
    inter = hier["inter_node_bytes"] / flat["inter_node_bytes"]
    inter_pay = hier["inter_payload_bytes"] / flat["inter_payload_bytes"]
    lines = [f"hierarchical / flat inter-node bytes (bf16): {inter:.3f} all, {inter_pay:.3f} payload only"
             + _verdict(inter <= 0.55, "<= 0.55 at the default shape"),
             f"flat / per-expert payload bytes (bf16): "
             f"{(flat['inter_payload_bytes'] + flat['intra_payload_bytes']) / (per_expert['inter_payload_bytes'] + per_expert['intra_payload_bytes']):.3f}"
             " (a token goes once per destination rank, not once per expert)"]
    for backend in BACKENDS:
        bf16, fp8 = _row(rows, backend, "bf16"), _row(rows, backend, "fp8")
        pay = [r["inter_payload_bytes"] + r["intra_payload_bytes"] for r in (fp8, bf16)]
        meta = [r["inter_meta_bytes"] + r["intra_meta_bytes"] for r in (fp8, bf16)]
        lines.append(f"fp8 / bf16 dispatch payload bytes ({backend}): {pay[0] / pay[1]:.3f} (token rows + scales; "
                     f"routing metadata apart: fp8 {meta[0]:,} B, bf16 {meta[1]:,} B)"
                     + _verdict(pay[0] <= 0.52 * pay[1], "<= 0.52"))
    return "\n".join(lines)


def format_projection(rows: list[dict], link: LinkModel) -> str:
    """Projected (not measured) link-only times under the link model."""
    return (f"PROJECTED, not measured: link-only time of the counted bytes at {link.inter_gbps:g} GB/s inter-node and "
            f"{link.intra_gbps:g} GB/s intra-node per rank (slowest rank's sends; hierarchical hops in sequence)\n"
            + table(rows, [*NAMES, *PROJECTED]))


def format_v3(rows: list[dict], link: LinkModel | None) -> str:
    """The predicted DeepSeek-V3-scale rows and the node-limit check."""
    nodes = V3["world"] // V3["gpus_per_node"]
    title = (f"PREDICTED, no communication: DeepSeek-V3 scale, {V3['world']} ranks = {nodes} nodes x "
             f"{V3['gpus_per_node']}, {V3['experts']} experts, top-{V3['top_k']}, {V3['num_groups']} groups "
             f"{V3['topk_groups']} kept, {rows[0]['tokens']} tokens/rank, hidden {rows[0]['hidden']} "
             f"(bytes per token)\n")
    columns = [*NAMES, *BYTES, ("max inter-node copies", "max_inter_node_copies", "d"),
               ("mean copies", "mean_inter_node_copies", ".2f"), *(PROJECTED if link else [])]
    hier = max(r["max_inter_node_copies"] for r in rows if r["backend"] == "hierarchical")
    return (title + table(rows, columns) + f"\nhierarchical: at most {hier} inter-node copies per token"
            + _verdict(hier <= 4, "<= 4"))


def caption(args: argparse.Namespace) -> str:
    """What ran and how the measured table counts."""
    groups = f" ({args.num_groups} groups, {args.topk_groups} kept)" if args.routing == "node-limited" else ""
    device = "cuda" if args.comm == "nccl" else f"cpu, {args.threads} thread(s) each"
    return "\n".join([
        f"dispatch benchmark: {args.nproc} ranks = {args.nproc // args.gpus_per_node} nodes x {args.gpus_per_node} "
        f"({args.comm}, {device}); {args.tokens} tokens/rank, hidden {args.hidden}, {args.experts} experts, "
        f"top-{args.top_k}, routing {args.routing}{groups}, x bf16, identity experts",
        f"times: slowest rank of each round (barrier before every call), median of {args.repeats} rounds of the "
        f"contenders in turn after {args.warmup} warmup (spread = IQR / median); GB/s = received token rows per rank x hidden x 2 B / time (DeepEP's count, same "
        f"numerator for every row)",
        "bytes per token: one dispatch's sends, all ranks, / all tokens; meta = routing weights, expert ids, row "
        "counts; x 1-hot, x per-exp = that peer's time / this time (dispatch+combine, same payload); calc_diff: "
        f"combine(dispatch(x)) vs x * kept weights, ok when < {TOLERANCE['bf16']:g} (bf16) / {TOLERANCE['fp8']:g} "
        "(fp8) and the byte counters equal the prediction from the routing (bytes=pred)",
        f"one-hot peer: capacity factor {args.capacity_factor:g}"])


def machine_notes(args: argparse.Namespace, tokens_given: bool) -> list[str]:
    """What this machine changed about the run (said in the header and the JSON)."""
    notes = []
    if not tokens_given:
        notes.append(f"default --tokens {args.tokens} per rank chosen for this machine "
                     f"({GPU_TOKENS} when every rank has a GPU; on CPU {CPU_TOKENS} with a core per process, "
                     f"{SMALL_CPU_TOKENS} when the {args.nproc} processes share {os.cpu_count()} cores)")
    if args.comm != "nccl" and peer_compute_dtype(args.comm) == torch.float32:
        notes.append("this CPU has no native bf16 (no AVX512-BF16/AMX): the one-hot and per-expert peers compute in "
                     "float32; rows still travel as bf16 (or fp8) and counts are unchanged")
    elif args.comm != "nccl" and cpu_has_native_bf16():
        notes.append("this CPU computes bf16 natively: the peers compute in bf16")
    return notes


def pick_comm(choice: str, nproc: int) -> str:
    """nccl when asked, or on auto when every process gets its own GPU; gloo otherwise."""
    if choice == "nccl" and torch.cuda.device_count() < nproc:
        raise ValueError(f"--comm nccl needs {nproc} GPUs, found {torch.cuda.device_count()}")
    if choice != "auto":
        return choice
    return "nccl" if torch.cuda.is_available() and nproc <= torch.cuda.device_count() else "gloo"


def build_parser() -> argparse.ArgumentParser:
    """The suite's options; the defaults are the acceptance shape (2 simulated nodes x 2 ranks)."""
    p = argparse.ArgumentParser(prog="moe-bench dispatch", description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--tokens", type=int, default=None,
        help=f"tokens per rank (default {GPU_TOKENS} on GPUs; on CPU {CPU_TOKENS}, or {SMALL_CPU_TOKENS} when the "
             "processes outnumber the cores)")
    add("--hidden", type=int, default=1024)
    add("--experts", type=int, default=32)
    add("--top-k", type=int, default=8)
    add("--nproc", type=int, default=4, help="EP size: processes launched")
    add("--gpus-per-node", type=int, default=2, help="ranks per (simulated) node")
    add("--routing", choices=ROUTINGS, default="node-limited")
    add("--num-groups", type=int, default=None, help="node-limited expert groups (default: one per node)")
    add("--topk-groups", type=int, default=1, help="node-limited groups kept per token")
    add("--skew", type=float, default=1.0, help="skewed routing exponent")
    add("--capacity-factor", type=float, default=1.0, help="one-hot peer's capacity factor")
    add("--repeats", type=int, default=3, help="timed repeats per contender (median reported)")
    add("--warmup", type=int, default=1, help="untimed repeats per contender")
    add("--seed", type=int, default=0, help="rank r's routing uses seed + r")
    add("--comm", choices=allowed_values(CommBackend), default="auto",
        help="process group backend; auto: nccl + cuda when every rank gets a GPU")
    add("--threads", type=int, default=1, help="torch threads per process")
    add("--call-budget", type=float, default=60.0,
        help="seconds one dispatch or combine call may take before the run stops naming it (0: no limit)")
    add("--quiet", action="store_true", help="no progress lines")
    add("--inter-node-gbps", type=float, help="link model: inter-node GB/s per rank (e.g. 50 for IB)")
    add("--intra-node-gbps", type=float, help="link model: intra-node GB/s per rank (e.g. 160 for NVLink)")
    add("--predict-v3", action="store_true", help="also predict bytes at DeepSeek-V3 scale (no communication)")
    add("--v3-tokens", type=int, default=4096, help="tokens per rank of the V3 prediction")
    add("--sweep", nargs="+", metavar="NAME=V1,V2", default=[],
        help="run every combination of these option values (e.g. tokens=512,2048 top-k=2,8); plots GB/s and bytes "
             "per token against the first one, next to the JSON")
    add("--json", metavar="FILE", help="write the header and one record per row (sweep default: dispatch-sweep.json)")
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """p.error naming the first option out of range or a shape the routing cannot take; fills in defaults."""
    args.tokens_given = args.tokens is not None
    if args.tokens is None:
        args.tokens = default_tokens(args.comm, args.nproc)
    for name in ("tokens", "hidden", "experts", "top_k", "nproc", "gpus_per_node", "repeats", "threads", "v3_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("capacity_factor", "inter_node_gbps", "intra_node_gbps"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.warmup < 0 or args.call_budget < 0:
        p.error("--warmup and --call-budget must be >= 0")
    if (args.inter_node_gbps is None) != (args.intra_node_gbps is None):
        p.error("the link model needs both --inter-node-gbps and --intra-node-gbps")
    try:
        topology = make_topology(args.nproc, args.gpus_per_node)
        args.num_groups = args.num_groups or topology.num_nodes
        check_num_experts(args.experts, args.nproc)
        rank_routing({**vars(args), "tokens": 1}, 0)
    except ValueError as err:
        p.error(str(err))


def _parse_one(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args = p.parse_args(argv)
    args.comm_choice = args.comm
    try:
        args.comm = pick_comm(args.comm, args.nproc)
    except ValueError as err:
        p.error(str(err))
    return args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options, checked (with --sweep: every point, before anything runs); defaults filled in for this machine.

    With --sweep, args.points holds the parsed options of every point, in order."""
    p = build_parser()
    args = _parse_one(p, argv)
    args.axes = sweep_axes(p, args.sweep)
    args.points = [(point, _parse_one(p, point_argv(argv, point))) for point in sweep_points(args.axes) if point]
    if not args.points:
        _check(p, args)
        return args
    for _, one in args.points:
        _check(p, one)
    args.tokens, args.tokens_given = args.points[0][1].tokens, all(one.tokens_given for _, one in args.points)
    return args


HINT = ("run a smaller shape (--tokens, --hidden, --top-k) or raise --call-budget; the one-hot peer's cost grows "
        "with tokens^2 x top-k")


def run_points(points: list[tuple[dict[str, str], argparse.Namespace]], link: LinkModel | None) -> list[dict]:
    """Every contender at every point (the run without --sweep is one point, {}), rows in the points' order.

    Points that need the same processes (--nproc, --comm, --threads) run in one launch, one after the other."""
    launches: dict[tuple, list[int]] = {}
    for i, (_, args) in enumerate(points):
        launches.setdefault((args.nproc, args.comm, args.threads), []).append(i)
    per_point: list[list[dict]] = [[] for _ in points]
    for (nproc, comm, threads), members in launches.items():
        opts = [{**{k: v for k, v in vars(points[i][1]).items() if k != "points"}, "point": points[i][0]}
                for i in members]
        quiet = points[members[0]][1].quiet
        results = run_ranks(points_worker, nproc, {"points": opts, "quiet": quiet}, HINT, backend=comm,
                            threads=threads, progress=BenchProgress("dispatch", not quiet))
        for j, i in enumerate(members):
            per_point[i] = summarise([rank[j] for rank in results], opts[j], link)
            for row in per_point[i]:
                row["point_label"] = point_label(points[i][0])
    return [row for rows in per_point for row in rows]


def run_sweep(args: argparse.Namespace, link: LinkModel | None) -> list[dict]:
    """Every point of the sweep, a table row per (point, contender); plots next to the JSON."""
    rows = run_points(args.points, link)
    print(table(rows, SWEEP, left=3))
    base = Path(args.json).with_suffix("")
    fig = sweep_figure(rows, next(iter(args.axes)), [("algbw_gbps", "dispatch GB/s"),
                                                     ("combine_algbw_gbps", "combine GB/s"),
                                                     ("bytes_per_token", "dispatch bytes per token")],
                       f"moe-bench dispatch sweep: {' x '.join(args.axes)}")
    html, png, why_not = write_figure(fig, base)
    print(f"plots: {html}" + (f", {png}" if png else f" ({why_not})"))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run every contender side by side (at every sweep point), print the tables, write JSON (+ plots)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.sweep and not args.json:
        args.json = "dispatch-sweep.json"
    link = LinkModel(args.inter_node_gbps, args.intra_node_gbps) if args.inter_node_gbps else None
    head = header("dispatch", argv, machine_notes(args, args.tokens_given))
    print(header_line(head))
    print("\n".join(f"note: {note}" for note in head["notes"]))
    try:
        if args.sweep:
            rows = run_sweep(args, link)
        else:
            rows = run_points([({}, args)], link)
            print(caption(args))
            print(table(rows, MEASURED))
            print(format_ratios(rows))
            if link:
                print(format_projection(rows, link))
    except BudgetExceeded as err:
        print(f"moe-bench dispatch: stopped: {err}", file=sys.stderr)
        return 3
    if args.predict_v3:
        v3 = predict_v3(args.v3_tokens, V3_HIDDEN, link, args.seed)
        print(format_v3(v3, link))
        rows += v3
    if args.json:
        write_json(args.json, head, rows, KEY, METRICS)
        print(f"wrote {args.json}")
    bad = [f"{r.get('point_label', '')} {r['contender']}".strip() for r in rows if r.get("correct") is False]
    if bad:
        print(f"moe-bench dispatch: correctness check failed for {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
