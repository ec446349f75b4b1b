"""`moe-bench clock`: the share of a short benchmark's rate a GPU keeps through back-to-back tensor-core work.

Each kind of work (an N^3 BF16 GEMM, the same GEMM in FP8 with per-tensor scales, causal flash attention forward
+ backward at N tokens) first runs a burst of --burst calls on a GPU left idle for --rest seconds, then runs back
to back for --seconds, timed in windows of --window calls. Once the power cap pulls the clock down it stays down:
the sustained rate is the median window of the last two thirds, and sustained / burst is the factor moe-plan
prices a run with (launch.plan.efficiency.SUSTAINED_CLOCK for GEMMs, ATTENTION_SUSTAINED_CLOCK for attention),
printed beside it. Without a GPU the rows carry no timings.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from launch.bench.harness import Timing, fields
from launch.bench.report import HIGHER, LOWER, header, header_line, table, write_json
from launch.plan.efficiency import ATTENTION_SUSTAINED_CLOCK, SUSTAINED_CLOCK

PLANNED = {"bf16 GEMM": SUSTAINED_CLOCK, "fp8 GEMM": SUSTAINED_CLOCK, "attention": ATTENTION_SUSTAINED_CLOCK}
HEADS, HEAD_DIM = 32, 128  # attention: heads of width 128, the shape ATTENTION_EFFICIENCY comes from
COLUMNS = [("work", "work", ""), ("N", "size", "d"), ("burst TFLOPS", "burst_tflops", ".0f"),
           ("sustained TFLOPS", "sustained_tflops", ".0f"), ("spread", "call_ms_spread", ".1%"),
           ("sustained / burst", "clock", ".3f"), ("moe-plan's", "planned_clock", ".3f")]


@dataclass
class Held:
    """What one kind of work kept: its burst rate and the per-call seconds of its settled windows."""

    burst_tflops: float
    settled: Timing
    flops: float

    @property
    def sustained_tflops(self) -> float:
        """FLOPs over the settled windows' median seconds a call."""
        return self.flops / self.settled.median / 1e12

    @property
    def clock(self) -> float:
        """Sustained over burst rate."""
        return self.sustained_tflops / self.burst_tflops


def held(burst_seconds: float, windows: list[float], flops: float) -> Held:
    """Held from a burst's seconds a call and every window's seconds a call, in order: the first third of the
    windows is the clock settling, the rest is what the run keeps."""
    if not windows:
        raise ValueError("no timed window: raise --seconds")
    return Held(flops / burst_seconds / 1e12, Timing(windows[len(windows) // 3:]), flops)


def work(kind: str, size: int, device: str) -> tuple[Callable[[], object], float]:
    """(one call, its FLOPs) of a kind of work at size N on device."""
    if kind == "attention":
        q, k, v = (torch.randn(1, HEADS, size, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)
        forward = 4 * size * size * HEAD_DIM * HEADS / 2  # causal: half of QK^T and AV
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad), 3.5 * forward
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    if kind == "bf16 GEMM":
        return lambda: a @ b, 2.0 * size ** 3
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major right side
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), 2.0 * size ** 3


def _seconds_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def measure(kind: str, args: argparse.Namespace) -> Held:
    """The burst after a rest, then --seconds of windows (see the module doc)."""
    fn, flops = work(kind, args.size, "cuda")
    _seconds_per_call(fn, 3)
    time.sleep(args.rest)  # the clock back up to its boost
    burst = _seconds_per_call(fn, args.burst)
    windows, start = [], time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        windows.append(_seconds_per_call(fn, args.window))
    return held(burst, windows, flops)


def main(argv: list[str] | None = None) -> int:
    """Measure every kind of work (a GPU) or list the rows (none)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="moe-bench clock", description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=8192, help="GEMM N (N x N x N) and attention tokens (default 8192)")
    p.add_argument("--seconds", type=float, default=20.0, help="back-to-back seconds per kind of work (default 20)")
    p.add_argument("--rest", type=float, default=5.0, help="idle seconds before each burst (default 5)")
    p.add_argument("--burst", type=int, default=20, help="calls in the burst (default 20)")
    p.add_argument("--window", type=int, default=40, help="calls per timed window (default 40)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = p.parse_args(argv)
    if min(args.size, args.burst, args.window) < 1 or args.seconds <= 0 or args.rest < 0:
        p.error("--size, --burst and --window must be >= 1, --seconds > 0 and --rest >= 0")
    gpu = torch.cuda.is_available()
    notes = [__doc__.split("\n\n")[1].replace("\n", " ")]
    if not gpu:
        notes.append("no CUDA device: the rows carry no timings")
    head = header("clock", argv, notes)
    print(header_line(head))
    rows = []
    for kind, planned in PLANNED.items():
        row = {"work": kind, "size": args.size, "planned_clock": planned, "burst_tflops": None,
               "sustained_tflops": None, "clock": None, "call_ms": None}
        if gpu:
            got = measure(kind, args)
            row.update(burst_tflops=got.burst_tflops, sustained_tflops=got.sustained_tflops, clock=got.clock,
                       **fields("call_ms", got.settled))
        rows.append(row)
    print("\n".join(f"note: {note}" for note in notes))
    print(table(rows, COLUMNS, left=1))
    if args.json:
        write_json(args.json, head, rows, ["work", "size"],
                   {"call_ms": LOWER, "burst_tflops": HIGHER, "sustained_tflops": HIGHER})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
