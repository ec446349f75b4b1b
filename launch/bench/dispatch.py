"""`moe-bench dispatch`: flat and hierarchical EP dispatch (bf16/fp8) against the classic one-hot capacity dispatch.

All six contenders run side by side, round-robin, in the same EP processes (gloo on CPU with simulated nodes,
NCCL on GPUs). Each call starts after a barrier and is timed on every rank; a repeat's time is its slowest
rank's, and the table shows the median over repeats. Experts are the identity. Byte counts are the
dispatchers' own counters, checked against the prediction made from the routing alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from dispatch.layout import check_num_experts
from dispatch.multiproc import run_processes
from dispatch.predict import predict_traffic
from dispatch.routing import ROUTINGS
from dispatch.topology import make_topology
from launch.bench.dispatch_model import V3, LinkModel, byte_fields, moved_bytes, predict_v3, projected_fields
from launch.bench.dispatch_worker import CONTENDERS, KINDS, ONEHOT, bench_worker, rank_routing
from launch.bench.onehot import dropped_slots, onehot_capacity, onehot_traffic

V3_HIDDEN = 7168


def predicted_traffic(backend: str, payload: str, indices: list[torch.Tensor], opts: dict[str, Any]) -> list[dict]:
    """Per rank {"dispatch", "combine"} Traffic expected for this contender (no communication)."""
    topology = make_topology(opts["nproc"], opts["gpus_per_node"])
    if backend == ONEHOT:
        capacity = onehot_capacity(opts["tokens"], opts["top_k"], opts["experts"], opts["capacity_factor"])
        return onehot_traffic(topology, opts["experts"], capacity, opts["hidden"], payload)
    return predict_traffic(indices, opts["experts"], topology, opts["hidden"], backend, payload)


def _median_of_slowest(results: list[dict], key: tuple[str, str], kind: str) -> float:
    per_repeat = zip(*(r["seconds"][key][kind] for r in results))
    return 1e3 * statistics.median(max(ranks) for ranks in per_repeat)


def _row(rows: list[dict], backend: str, payload: str) -> dict:
    return next(r for r in rows if r["backend"] == backend and r["payload"] == payload)


def summarise(results: list[dict], opts: dict[str, Any], link: LinkModel | None) -> list[dict[str, Any]]:
    """One record per contender: times, algbw, bytes (measured == predicted checked), projections, ratios."""
    indices = [rank_routing(opts, r)[0] for r in range(opts["nproc"])]
    moved = moved_bytes(indices, opts["experts"], opts["hidden"])
    capacity = onehot_capacity(opts["tokens"], opts["top_k"], opts["experts"], opts["capacity_factor"])
    routed = sum(int((ids >= 0).sum()) for ids in indices)
    dropped = sum(dropped_slots(ids, opts["experts"], capacity) for ids in indices) / routed
    rows = []
    for key in CONTENDERS:
        measured = {kind: [r["traffic"][key][kind] for r in results] for kind in KINDS}
        expected = predicted_traffic(*key, indices, opts)
        times = {f"{kind}_ms": _median_of_slowest(results, key, kind) for kind in KINDS}
        rows.append({
            "section": "measured", "backend": key[0], "payload": key[1], **times,
            "algbw_gbps": moved / 1e6 / times["dispatch_ms"], "combine_algbw_gbps": moved / 1e6 / times["combine_ms"],
            **byte_fields(measured["dispatch"], opts["tokens"] * opts["nproc"]),
            **byte_fields(measured["combine"], opts["tokens"] * opts["nproc"], "combine_"),
            "bytes_match_prediction": all(m == e[kind] for kind in KINDS for m, e in zip(measured[kind], expected)),
            "dropped_fraction": dropped if key[0] == ONEHOT else 0.0,
            "capacity": capacity if key[0] == ONEHOT else None,
            **projected_fields(measured, key[0], link, moved),
            **{name: opts[name] for name in ("tokens", "hidden", "experts", "top_k", "nproc", "gpus_per_node",
                                             "routing", "comm", "repeats")},
        })
    for row in rows:
        peer = _row(rows, ONEHOT, row["payload"])
        row["speedup_vs_onehot"] = (peer["dispatch_ms"] + peer["combine_ms"]) / (row["dispatch_ms"] + row["combine_ms"])
    return rows


def _verdict(ok: bool, target: str) -> str:
    return f"   [acceptance {target}: {'met' if ok else 'not met'}]"


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Fixed-width table, one line per record; columns are (title, record key, format spec)."""
    cells = [[title for title, _, _ in columns]] + [[format(r[key], spec) for _, key, spec in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths)))
             for line in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


NAMES = [("backend", "backend", ""), ("payload", "payload", "")]
BYTES = [(part.replace("_", " ").replace("payload", "pay"), f"{part}_bytes_per_token", ".0f")
         for part in ("inter_payload", "inter_meta", "intra_payload", "intra_meta")]
PROJECTED = [("proj disp ms", "projected_dispatch_ms", ".4f"), ("proj comb ms", "projected_combine_ms", ".4f"),
             ("proj disp GB/s", "projected_algbw_gbps", ".1f")]
MEASURED = [*NAMES, ("disp ms", "dispatch_ms", ".1f"), ("comb ms", "combine_ms", ".1f"),
            ("disp GB/s", "algbw_gbps", ".3f"), ("comb GB/s", "combine_algbw_gbps", ".3f"),
            ("x 1-hot", "speedup_vs_onehot", ".1f"), *BYTES, ("bytes=pred", "bytes_match_prediction", "")]


def format_ratios(rows: list[dict]) -> str:
    """Acceptance ratios: hierarchical vs flat inter-node bytes, fp8 vs bf16 payload bytes."""
    flat, hier = _row(rows, "flat", "bf16"), _row(rows, "hierarchical", "bf16")
    inter = hier["inter_node_bytes"] / flat["inter_node_bytes"]
    inter_pay = hier["inter_payload_bytes"] / flat["inter_payload_bytes"]
    lines = [f"hierarchical / flat inter-node bytes (bf16): {inter:.3f} all, {inter_pay:.3f} payload only"
             + _verdict(inter <= 0.55, "<= 0.55 at the default shape")]
    for backend in ("flat", "hierarchical"):
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


def caption(args: argparse.Namespace, peer: dict) -> str:
    """What ran and how the measured table counts."""
    groups = f" ({args.num_groups} groups, {args.topk_groups} kept)" if args.routing == "node-limited" else ""
    device = "cuda" if args.comm == "nccl" else f"cpu, {args.threads} thread(s) each"
    return "\n".join([
        f"dispatch benchmark: {args.nproc} ranks = {args.nproc // args.gpus_per_node} nodes x {args.gpus_per_node} "
        f"({args.comm}, {device}); {args.tokens} tokens/rank, hidden {args.hidden}, {args.experts} experts, "
        f"top-{args.top_k}, routing {args.routing}{groups}, x bf16, identity experts",
        f"times: slowest rank of each repeat (barrier before every call), median of {args.repeats} repeats after "
        f"{args.warmup} warmup; GB/s = received token rows per rank x hidden x 2 B / time (DeepEP's count, same "
        f"numerator for every row)",
        "bytes per token: one dispatch's sends, all ranks, / all tokens; meta = routing weights, expert ids, row "
        "counts; x 1-hot = one-hot time / this time (dispatch+combine, same payload); bytes=pred: counters equal "
        "the prediction from the routing",
        f"one-hot peer: capacity factor {args.capacity_factor:g} = {peer['capacity']} slots per expert, "
        f"{100 * peer['dropped_fraction']:.1f}% of routed slots dropped"])


def pick_comm(choice: str, nproc: int) -> str:
    """nccl when asked, or on auto when every process gets its own GPU; gloo otherwise."""
    if choice == "nccl" and torch.cuda.device_count() < nproc:
        raise ValueError(f"--comm nccl needs {nproc} GPUs, found {torch.cuda.device_count()}")
    if choice != "auto":
        return choice
    return "nccl" if torch.cuda.is_available() and nproc <= torch.cuda.device_count() else "gloo"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options; the defaults are the acceptance shape (2 simulated nodes x 2 ranks)."""
    p = argparse.ArgumentParser(prog="moe-bench dispatch", description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--tokens", type=int, default=4096, help="tokens per rank")
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
    add("--comm", choices=("auto", "gloo", "nccl"), default="auto",
        help="process group backend; auto: nccl + cuda when every rank gets a GPU")
    add("--threads", type=int, default=1, help="torch threads per process")
    add("--timeout", type=float, default=600.0, help="seconds before giving up")
    add("--inter-node-gbps", type=float, help="link model: inter-node GB/s per rank (e.g. 50 for IB)")
    add("--intra-node-gbps", type=float, help="link model: intra-node GB/s per rank (e.g. 160 for NVLink)")
    add("--predict-v3", action="store_true", help="also predict bytes at DeepSeek-V3 scale (no communication)")
    add("--v3-tokens", type=int, default=4096, help="tokens per rank of the V3 prediction")
    add("--json", metavar="FILE", help="write one record per row")
    args = p.parse_args(argv)
    for name in ("tokens", "hidden", "experts", "top_k", "nproc", "gpus_per_node", "repeats", "threads", "v3_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("capacity_factor", "inter_node_gbps", "intra_node_gbps"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if (args.inter_node_gbps is None) != (args.intra_node_gbps is None):
        p.error("the link model needs both --inter-node-gbps and --intra-node-gbps")
    try:
        topology = make_topology(args.nproc, args.gpus_per_node)
        args.num_groups = args.num_groups or topology.num_nodes
        check_num_experts(args.experts, args.nproc)
        rank_routing(vars(args), 0)
        args.comm = pick_comm(args.comm, args.nproc)
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every contender side by side, print the tables and ratios, optionally write JSON."""
    args = parse_args(argv)
    opts = vars(args)
    link = LinkModel(args.inter_node_gbps, args.intra_node_gbps) if args.inter_node_gbps else None
    results = run_processes(bench_worker, args.nproc, opts, backend=args.comm, threads=args.threads,
                            timeout_s=args.timeout)
    rows = summarise(results, opts, link)
    print(caption(args, _row(rows, ONEHOT, "bf16")))
    print(table(rows, MEASURED))
    print(format_ratios(rows))
    if link:
        print(format_projection(rows, link))
    if args.predict_v3:
        v3 = predict_v3(args.v3_tokens, V3_HIDDEN, link, args.seed)
        print(format_v3(v3, link))
        rows += v3
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
