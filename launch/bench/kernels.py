"""`moe-bench kernels`: FP8 grouped GEMM forward/dgrad/wgrad vs torch._grouped_mm (bf16) and
torch._scaled_grouped_mm (fp8 rowwise) at DeepSeek-V3 expert shapes; correctness only on CPU.

By default the shape table of issue 47 (SHAPE_TABLE: forward and dgrad at N, K 4096, 7168 and 7168, 2048 over 8 x 4096,
4 x 8192, 8 x 512, 32 x 512, 32 x 128 and jagged groups with an empty one and one of 4093 rows; wgrad at 8 x 4096,
32 x 512, 4 x 8192 tokens); --shapes / --groups / --rows give a grid instead. On an sm_90 GPU both of our kernels of
each op run (the Gluon "fast" one and the `tl` "reference"), each beside both peers in alternating rounds, an L2 flush
before every timed round, the SM clock logged per case; --dry-run lists the cases without CUDA."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from kernels.backend import GEMM_ENV, fast_gemm_runs_on, use_fast_gemm
from kernels.metrics import calc_diff
from kernels.ops import run
from kernels.quant_ref import FP8_DTYPE, FP8_MAX
from kernels.shapes import SHAPE_TABLE
from launch.bench.harness import fields, ratio_fields, rounds
from launch.bench.progress import BenchProgress
from launch.bench.report import HIGHER, LOWER, header, header_line, table, write_json
from launch.plan.efficiency import GemmModel
from launch.plan.presets import preset_for_device

OPS = ("forward", "dgrad", "wgrad")
PEERS = ("torch._grouped_mm bf16", "torch._scaled_grouped_mm fp8 rowwise")
PLANNED_AS = {"ours": "fp8-block", PEERS[0]: "bf16", PEERS[1]: "fp8-tensor"}  # moe-plan's precision of each
CPU_GROUP_SIZES = (0, 130, 1, 200, 0, 67)
CPU_SHAPE = (256, 128)
VARIANTS = {"fast": "gluon_ops", "reference": "triton_gemm"}  # our kernels of each op (kernels.ops.FAST_KERNELS)
L2_FLUSH_BYTES = 256 << 20  # more than any GPU's L2 (H100 50 MB, H200 60 MB)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _shapes(text: str) -> list[tuple[int, int]]:
    pairs = [v.split("x") for v in text.split(",") if v]
    return [(int(k), int(n)) for k, n in pairs]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of the kernels suite."""
    p = argparse.ArgumentParser(prog="moe-bench kernels", description=__doc__)
    p.add_argument("--shapes", type=_shapes, help="a grid instead of the issue's table: comma-separated KxN expert "
                   "GEMM shapes (grid default: 7168x4096,2048x7168)")
    p.add_argument("--groups", type=_ints, help="the grid's group counts (default 4,8,16,32)")
    p.add_argument("--rows", type=_ints, help="the grid's rows per group (default 128,512,2048,4096,8192)")
    p.add_argument("--dry-run", action="store_true", help="list the cases and kernels that would run; no CUDA needed")
    p.add_argument("--max-total-rows", type=int, default=65536, help="skip cases with more rows in all")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds")
    p.add_argument("--calls", type=int, default=1, help="back-to-back calls per timed round (1: each call on an "
                   "idle GPU, its launch included; e.g. 10: the GPU's own time per call)")
    p.add_argument("--repeats", type=int, default=10, help="timed rounds of ours and the peers in turn; medians, "
                   "spreads and the ratio round by round are reported")
    p.add_argument("--call-budget", type=float, default=60.0,
                   help="seconds one case's timing may take before the run stops naming it (0: no limit)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error("--calls must be >= 1")
    return args


def _exact(op: str, x: Tensor, w: Tensor, dy: Tensor, bounds: list[tuple[int, int]]) -> Tensor:
    """The float64 product of the unquantised inputs."""
    x, w, dy = x.double(), w.double(), dy.double()
    if op == "forward":
        return torch.cat([x[s:e] @ w[g].t() for g, (s, e) in enumerate(bounds)])
    if op == "dgrad":
        return torch.cat([dy[s:e] @ w[g] for g, (s, e) in enumerate(bounds)])
    return torch.stack([dy[s:e].t() @ x[s:e] for s, e in bounds])


def _ours(op: str, backend: str | None, x: Tensor, w: Tensor, dy: Tensor, offs: Tensor,
          variant: str | None = None) -> Callable[[], Tensor]:
    """A closure running our op on pre-quantised operands (quantisation is not timed); variant: one of VARIANTS'
    kernels called directly (None: what kernels.ops chooses)."""
    out_dtype = torch.bfloat16 if x.is_cuda else torch.float32
    if op in ("forward", "dgrad"):
        a = x if op == "forward" else dy
        operands = (*run("quantize_activation", backend, a),
                    *run("quantize_weight" if op == "forward" else "quantize_weight_t", backend, w), offs, out_dtype)
        if variant is not None:
            module = importlib.import_module(f"kernels.{VARIANTS[variant]}")
            kernel = getattr(module, "mgrouped_gemm" if op == "forward" else "mgrouped_dgrad")
            return lambda: kernel(*operands)
        return lambda: run("gemm" if op == "forward" else "dgrad", backend, *operands)
    operands = (*run("quantize_activation_kgrouped", backend, dy, offs),
                *run("quantize_activation_kgrouped", backend, x, offs), offs, x.shape[0])
    if variant is not None:  # the Gluon wgrad walks each group's rows only: no row count
        kernel = getattr(importlib.import_module(f"kernels.{VARIANTS[variant]}"), "kgrouped_gemm")
        return lambda: kernel(*operands[:-1])
    return lambda: run("wgrad", backend, *operands)


def _group_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


def _inputs(sizes: list[int], k: int, n: int, device: str, dtype: torch.dtype):
    g, m = len(sizes), sum(sizes)
    gen = torch.Generator(device=device).manual_seed(0)
    x, w, dy = (torch.randn(*shape, generator=gen, device=device).to(dtype) for shape in ((m, k), (g, n, k), (m, n)))
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    return x, w, dy, offs


def cpu_rows() -> list[dict]:
    """Correctness of each op at a small shape: calc_diff against the fp32 product, per backend."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    backends = ["torch"] + (["triton"] if os.environ["TRITON_INTERPRET"] == "1" else [])
    k, n = CPU_SHAPE
    x, w, dy, offs = _inputs(list(CPU_GROUP_SIZES), k, n, "cpu", torch.float32)
    shape = {"group_sizes": list(CPU_GROUP_SIZES), "N": n, "K": k}
    rows = []
    for op in OPS:
        exact = _exact(op, x, w, dy, _group_bounds(list(CPU_GROUP_SIZES)))
        for backend in backends:
            diff = calc_diff(_ours(op, backend, x, w, dy, offs)(), exact)
            rows.append({"op": op, "shape": shape, "backend": backend, "calc_diff": diff, "tflops": None,
                         "peer": None, "peer_tflops": None})
    return rows


def _event_seconds(fn: Callable[[], object], calls: int = 1) -> float:
    """Seconds per fn() on the GPU: CUDA events around `calls` back-to-back calls (1: one call on an idle GPU,
    its launch included; more: the host runs ahead, leaving the GPU's own time per call), after an L2 flush
    (L2_FLUSH_BYTES written), so no operand starts the round in L2."""
    _l2_flush().zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


_FLUSH: list[Tensor] = []


def _l2_flush() -> Tensor:
    """The buffer whose writes evict L2 (allocated once, on the current CUDA device)."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda"))
    return _FLUSH[0]


def sm_clock_mhz(device: str) -> int | None:
    """The SM clock now (MHz, through NVML), None where it cannot be read."""
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # no NVML / no CUDA: the clock is not logged
        return None


def _rowwise_fp8(t: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Rowwise e4m3 along `dim` (the reduction dim): the scaling torch._scaled_grouped_mm takes."""
    scale = t.float().abs().amax(dim=dim, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (t.float() / scale).to(FP8_DTYPE), scale.squeeze(dim)


def _groupwise_rowwise_fp8(t: Tensor, bounds: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """t [R, M] with columns split into groups -> e4m3 and one scale per (group, row), flattened [G*R]."""
    amax = torch.stack([t[:, s:e].float().abs().amax(dim=1) if e > s else t.new_zeros(t.shape[0], dtype=torch.float32)
                        for s, e in bounds])
    scale = amax.clamp(min=1e-12) / FP8_MAX
    group_of_column = torch.repeat_interleave(torch.arange(len(bounds), device=t.device),
                                              torch.tensor([e - s for s, e in bounds], device=t.device))
    return (t.float() / scale[group_of_column].t()).to(FP8_DTYPE), scale.reshape(-1)


def _peers(op: str, x: Tensor, w: Tensor, dy: Tensor, offs: Tensor,
           bounds: list[tuple[int, int]]) -> dict[str, Callable[[], Tensor]]:
    """Closures running the peers on the same problem (operands prepared outside the closure)."""
    if op == "wgrad":
        bf16_args = (dy.t(), x)
        a_q, a_s = _groupwise_rowwise_fp8(dy.t().contiguous(), bounds)
        b_q, b_s = _groupwise_rowwise_fp8(x.t().contiguous(), bounds)
        fp8_args = (a_q, b_q.t(), a_s, b_s)
    else:
        a, b_nk = (x, w) if op == "forward" else (dy, w.transpose(-2, -1).contiguous())
        bf16_args = (a, b_nk.transpose(-2, -1))
        a_q, a_s = _rowwise_fp8(a, 1)
        b_q, b_s = _rowwise_fp8(b_nk, -1)
        fp8_args = (a_q, b_q.transpose(-2, -1), a_s, b_s)
    return {PEERS[0]: lambda: torch._grouped_mm(*bf16_args, offs=offs),
            PEERS[1]: lambda: torch._scaled_grouped_mm(*fp8_args, offs=offs, out_dtype=torch.bfloat16)}


def _runs(name: str, fn: Callable[[], object]) -> bool:
    """Whether fn runs here (a peer may not: its op or dtype missing); says why not."""
    try:
        fn()
        return True
    except (RuntimeError, NotImplementedError, TypeError) as err:
        print(f"  ({name} skipped: {type(err).__name__}: {str(err).splitlines()[0][:100]})", file=sys.stderr)
        return False


def planned_tflops(model: GemmModel | None, op: str, shape: dict, precision: str) -> float | None:
    """moe-plan's predicted TFLOPS (launch.plan.efficiency) of one op at a shape, for comparison with the
    measured figure (None without a preset for this GPU)."""
    if model is None:
        return None
    m, n, k, groups = shape["rows_per_group"], shape["N"], shape["K"], shape["groups"]
    seconds = dict(zip(OPS, model.linear(m, n, k, precision, groups)))[op]
    return 2.0 * groups * m * n * k / seconds / 1e12


def cases(args: argparse.Namespace) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """(op, N, K, group sizes) to run: the issue's SHAPE_TABLE, or the grid of --shapes x --groups x --rows (the
    options left out take the grid defaults) with every op; cases over --max-total-rows left out."""
    if args.shapes is None and args.groups is None and args.rows is None:
        table = SHAPE_TABLE
    else:
        shapes = args.shapes or _shapes("7168x4096,2048x7168")
        group_counts, per_group_rows = args.groups or _ints("4,8,16,32"), args.rows or _ints("128,512,2048,4096,8192")
        table = [(op, n, k, (per_group,) * groups) for k, n in shapes for groups in group_counts
                 for per_group in per_group_rows for op in OPS]
    return [case for case in table if sum(case[3]) <= args.max_total_rows]


def _shape(n: int, k: int, sizes: tuple[int, ...]) -> dict:
    """A case's shape as rows show it (jagged groups: their sizes too; rows_per_group is then the mean)."""
    shape = {"groups": len(sizes), "rows_per_group": sum(sizes) // len(sizes), "N": n, "K": k}
    if len(set(sizes)) > 1:
        shape["group_sizes"] = list(sizes)
    return shape


def gpu_rows(args: argparse.Namespace, device: str = "cuda") -> list[dict]:
    """Times ours and the peers side by side at every case (cases()), beside moe-plan's prediction of each: on an
    sm_90 GPU both our kernels of the op (VARIANTS), elsewhere the one kernels.ops chooses."""
    rows = []
    gpu = preset_for_device(torch.cuda.get_device_name(device)) if torch.device(device).type == "cuda" else None
    # short timed rounds: the boost clock holds
    model = None if gpu is None else GemmModel(gpu, clock=1.0, attention_clock=1.0)
    progress = BenchProgress("kernels", not args.quiet)
    for op, n, k, sizes in cases(args):
        x, w, dy, offs = _inputs(list(sizes), k, n, device, torch.bfloat16)
        shape = _shape(n, k, sizes)
        progress(f"{op} {_shape_text(shape)}")
        flops = 2.0 * sum(sizes) * n * k
        exact = _exact(op, x, w, dy, _group_bounds(list(sizes)))
        forced = os.environ.get(GEMM_ENV)  # $MOE_FP8_GEMM: only the kernel it forces
        variants = list(VARIANTS) if fast_gemm_runs_on(x) and not forced else [None]
        ours = {variant: _ours(op, None, x, w, dy, offs, variant) for variant in variants}
        diffs, stable = {}, {}
        for variant, fn in ours.items():  # each kernel's error, and whether a second call gives the same bits
            first = fn()
            diffs[variant], stable[variant] = calc_diff(first, exact), bool(torch.equal(first, fn()))
            del first
        del exact
        calls = {**{f"ours {v}": fn for v, fn in ours.items()},
                 **_peers(op, x, w, dy, offs, _group_bounds(list(sizes)))}
        calls = {name: partial(_event_seconds, fn, args.calls) for name, fn in calls.items() if _runs(name, fn)}
        clock = sm_clock_mhz(device) if gpu is not None else None
        timed = {name: t["time"] for name, t in rounds(calls, args.warmup, args.repeats, args.call_budget,
                                                      what=f"{op} at {_shape_text(shape)}", rotate=True).items()}
        for variant in variants:
            mine = timed.get(f"ours {variant}")
            chosen = variant or ("fast" if use_fast_gemm(x) else "reference")  # None: kernels.ops' choice
            backend = {"fast": "gluon", "reference": "triton"}[chosen]
            for peer in PEERS:
                theirs = timed.get(peer)
                row = {"op": op, "shape": shape, "backend": backend, "calc_diff": diffs[variant],
                       "bitwise_stable": stable[variant], "peer": peer,
                       "sm_clock_mhz": clock, "tflops": flops / mine.median / 1e12 if mine else None,
                       "peer_tflops": flops / theirs.median / 1e12 if theirs else None,
                       "plan_tflops": planned_tflops(model, op, shape, PLANNED_AS["ours"]),
                       "peer_plan_tflops": planned_tflops(model, op, shape, PLANNED_AS[peer]),
                       **(fields("ms", mine) if mine else {}), **(fields("peer_ms", theirs) if theirs else {})}
                if mine and theirs:  # ours' speed over the peer's, round by round
                    row.update(ratio_fields("ratio", theirs / mine))
                rows.append(row)
        del x, w, dy, ours, calls
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows


def dry_run(args: argparse.Namespace) -> list[str]:
    """One line per case: op, shape, FLOPs and the kernels that would run beside the peers (no CUDA needed: on a GPU
    other than sm_90 only the one kernels.ops chooses runs)."""
    lines = []
    for op, n, k, sizes in cases(args):
        lines.append(f"{op:8s} {_shape_text(_shape(n, k, sizes)):70s} {2.0 * sum(sizes) * n * k / 1e12:7.2f} TFLOP  "
                     f"ours (fast, reference) | {' | '.join(PEERS)}")
    return lines


def _shape_text(shape: dict) -> str:
    return " ".join(f"{key}={','.join(map(str, val)) if isinstance(val, list) else val}" for key, val in shape.items())


COLUMNS = [("op", "op", ""), ("shape", "shape_text", ""), ("backend", "backend", ""), ("calc_diff", "calc_diff", ".2e"),
           ("TFLOPS", "tflops", ".1f"), ("plan TF", "plan_tflops", ".1f"), ("spread", "ms_spread", ".0%"),
           ("peer", "peer", ""), ("peer TF", "peer_tflops", ".1f"), ("peer plan TF", "peer_plan_tflops", ".1f"),
           ("ratio", "ratio", ".2f"), ("spread", "ratio_spread", ".0%")]


ACCEPTANCE = {"op": "forward", "shape": {"groups": 8, "rows_per_group": 4096, "N": 4096, "K": 7168},
              "peer": PEERS[0]}


def print_acceptance(rows: list[dict]) -> None:
    """The issue's headline: forward at 8 groups x 4096 rows, N=4096, K=7168 against bf16 torch._grouped_mm."""
    for r in rows:
        if all(r[key] == value for key, value in ACCEPTANCE.items()) and r["tflops"] and r["peer_tflops"]:
            print(f"headline: forward 8x4096 rows, N=4096, K=7168: {r['tflops']:.0f} TFLOPS vs bf16 "
                  f"{r['peer_tflops']:.0f} TFLOPS = {r['ratio']:.2f}x (goal >= 1.3x and >= 800 TFLOPS on H100)")


def main(argv: list[str] | None = None) -> int:
    """Run the suite; exit status 1 if any op misses calc_diff < 1e-3."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        print("\n".join(dry_run(args)))
        print(f"{len(cases(args))} cases")
        return 0
    notes = [] if torch.cuda.is_available() else ["no CUDA device: correctness check only at a small shape; "
                                                  "timings need a GPU (tflops are null)"]
    head = header("kernels", argv, notes)
    print(header_line(head))
    print("\n".join(f"note: {note}" for note in notes))
    rows = gpu_rows(args) if torch.cuda.is_available() else cpu_rows()
    for row in rows:
        row["shape_text"] = _shape_text(row["shape"])
    print(table(rows, COLUMNS, left=3))
    print_acceptance(rows)
    if args.json:
        write_json(args.json, head, rows, ["op", "shape", "backend", "peer"],
                   {"tflops": HIGHER, "peer_tflops": HIGHER, "ms": LOWER, "peer_ms": LOWER})
    return 0 if all(r["calc_diff"] < 1e-3 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
