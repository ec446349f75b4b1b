"""The first thing a GPU slice runs (before `moe-bench kernels`): every fast (Gluon) FP8 GEMM against the `tl`
reference kernel on the same e4m3 operands, at small edge cases (empty, 1-row and partial tiles, an unaligned N and
K, no rows at all) and then issue 47's table (kernels.shapes, jagged groups included): calc_diff < 1e-3
against the reference and against float64 of the quantised operands, and bitwise the same output on a second run.
Prints one line per case as it finishes (a hang shows which), then a summary; exit status 1 on any failure.

    timeout 300 python -m kernels.gpu_check [--quick]   (--quick: the edge cases only)
"""

from __future__ import annotations

import sys
import time

import torch

from kernels import triton_gemm
from kernels.backend import fast_gemm_runs_on
from kernels.metrics import calc_diff
from kernels.ops import run
from kernels.quant_ref import dequantize_activation, dequantize_kgrouped, dequantize_weight
from kernels.shapes import SHAPE_TABLE

BOUND = 1e-3
# (op, N, K, group sizes): empty groups, a 1-row group, partial row, column and K tiles, no rows at all
EDGE_CASES = [(op, n, k, sizes) for op in ("forward", "dgrad", "wgrad")
              for n, k, sizes in ((208, 208, (0, 1, 130, 0, 67)), (256, 384, (300,)), (128, 256, (0, 0)),
                                  (4096, 7168, (0, 4093, 3)))]


def _operands(op: str, n: int, k: int, sizes: tuple[int, ...], seed: int = 0):
    """e4m3 operands of one case as the kernels take them (bf16 inputs quantised by the Triton quantisers), and
    their float64 product (the dequantised operands')."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, groups = sum(sizes), len(sizes)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    group = torch.repeat_interleave(torch.arange(groups, device="cuda"), torch.tensor(sizes, device="cuda"))
    if op == "wgrad":  # dw [G, N, K] from dy [M, N] and x [M, K], both k-grouped
        dy, x = (torch.randn(m, width, generator=gen, device="cuda").bfloat16() for width in (n, k))
        dy_t, x_t = (run("quantize_activation_kgrouped", "triton", t, offs) for t in (dy, x))
        dy64, x64 = (dequantize_kgrouped(*t, offs).double() for t in (dy_t, x_t))
        exact = torch.stack([dy64[group == g].t() @ x64[group == g] for g in range(groups)])
        return (*dy_t, *x_t, offs), exact
    w = torch.randn(groups, n, k, generator=gen, device="cuda").bfloat16()
    a = torch.randn(m, n if op == "dgrad" else k, generator=gen, device="cuda").bfloat16()
    a_q, a_scale = run("quantize_activation", "triton", a)
    b_q, b_scale = run("quantize_weight_t" if op == "dgrad" else "quantize_weight", "triton", w)
    a64 = dequantize_activation(a_q, a_scale).double()
    w64 = dequantize_weight(*run("quantize_weight", "triton", w)).double()
    exact = torch.zeros(m, k if op == "dgrad" else n, dtype=torch.float64, device="cuda")
    for g in range(groups):
        rows = group == g
        exact[rows] = a64[rows] @ (w64[g] if op == "dgrad" else w64[g].t())
    return (a_q, a_scale, b_q, b_scale, offs, torch.bfloat16), exact


def check(op: str, n: int, k: int, sizes: tuple[int, ...]) -> dict:
    """One case: the fast kernel twice and the reference once on the same operands."""
    from kernels import gluon_ops  # imports Gluon: only once main() found it

    operands, exact = _operands(op, n, k, sizes)
    name = {"forward": "mgrouped_gemm", "dgrad": "mgrouped_dgrad", "wgrad": "kgrouped_gemm"}[op]
    fast, reference = getattr(gluon_ops, name), getattr(triton_gemm, name)
    began = time.perf_counter()
    first = fast(*operands)
    torch.cuda.synchronize()
    took = time.perf_counter() - began
    second = fast(*operands)
    ref = reference(*operands)
    empty = first.numel() == 0
    out = {"op": op, "N": n, "K": k, "groups": len(sizes), "rows": sum(sizes),
           "vs_reference": 0.0 if empty else calc_diff(first, ref),
           "vs_float64": 0.0 if empty else calc_diff(first.double(), exact),
           "bitwise_stable": torch.equal(first, second), "first_call_s": took}
    if op == "wgrad":  # an empty group's weight grad is exactly zero
        out["empty_groups_zero"] = all(bool((first[g] == 0).all()) for g, size in enumerate(sizes) if size == 0)
    out["ok"] = (out["vs_reference"] < BOUND and out["vs_float64"] < BOUND and out["bitwise_stable"]
                 and out.get("empty_groups_zero", True))
    return out


def main(argv: list[str]) -> int:
    """Run the edge cases (and without --quick the table); print each; 0 when all pass."""
    if not torch.cuda.is_available() or not fast_gemm_runs_on(torch.zeros(1, device="cuda")):
        print("gpu_check: needs a CUDA sm_90 GPU and a Triton with Gluon (kernels.backend.fast_gemm_runs_on)")
        return 2
    cases = EDGE_CASES + ([] if "--quick" in argv else SHAPE_TABLE)
    print(f"{torch.cuda.get_device_name()}; {len(cases)} cases; bound {BOUND:g}", flush=True)
    results = []
    for case in cases:
        r = check(*case)
        results.append(r)
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['op']:7s} N={r['N']:5d} K={r['K']:5d} groups={r['groups']:2d} "
              f"rows={r['rows']:6d}  vs ref {r['vs_reference']:.2e}  vs f64 {r['vs_float64']:.2e}  "
              f"stable {r['bitwise_stable']}  first call {r['first_call_s']:.2f} s", flush=True)
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
