"""Compiles the Gluon FP8 grouped GEMMs (forward/dgrad, wgrad) for an H100 (sm_90a) without a GPU and checks what
their machine code needs: no register spills, shared memory <= 227 KB, no CTA-wide barrier (`bar.sync 0` and kin)
inside a main loop, no ptxas C7514 warning (wgmma serialised). Prints {config: report} as JSON; --planted adds
variants that must fail each check (7 stages: shared memory over; a `bar.sync 0` put in the main loop; the wgrad at
BLOCK_N 128: spills; a ptxas log carrying C7514, no real variant found that serialises wgmma).

Torch-free (kernels/gluon_gemm.py, triton_common.py and fp8_format.py import only Triton), so it also runs under a
Triton installed alone, e.g. the GPU machines' 3.6: /work/venv-t36/bin/python -m tests.kernels.gluon_compile.
Run in a process without TRITON_INTERPRET (test_hopper_compile.py does that).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one sm_90 CTA may allocate
# name: (kernel, BLOCK_N, STAGES); forward/dgrad (mgrouped, bf16 out) and wgrad (kgrouped, fp32 out)
CHECKED = {"bn128_s5": ("mgrouped", 128, 5), "bn128_s6": ("mgrouped", 128, 6), "bn64_s6": ("mgrouped", 64, 6),
           "wgrad_bn64_s6": ("kgrouped", 64, 6)}
BARRIER = re.compile(r"^\s*(?:bar|barrier)\.sync(?:\.aligned)?\s+(\d+)\s*(?:,\s*(\d+))?\s*;")


def _import_kernels_without_torch() -> None:
    """Make `kernels.<module>` importable where torch is absent: the package's __init__ imports torch; its Triton
    modules do not."""
    try:
        import torch  # noqa: F401
    except ImportError:
        package = types.ModuleType("kernels")
        package.__path__ = [str(ROOT / "kernels")]
        sys.modules["kernels"] = package


def compile_gemm(kind: str, block_n: int, stages: int):
    """triton.compile for sm_90 of gluon_gemm's mgrouped_kernel (bf16 out, 8 groups at most) or kgrouped_kernel (fp32
    out) at one config."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels import gluon_gemm

    fn = getattr(gluon_gemm, f"{kind}_kernel")
    out, out_gl = ("bf16", gl.bfloat16) if kind == "mgrouped" else ("fp32", gl.float32)
    layouts = gluon_gemm.shared_layouts(block_n, out_gl)
    half = gluon_gemm.HALF_M.value
    types_ = {"a_desc": f"tensordesc<fp8e4nv[{half}, 128],{layouts['a']!r}>",
              "b_desc": f"tensordesc<fp8e4nv[{block_n}, 128],{layouts['b']!r}>",
              "c_desc": f"tensordesc<{out}[{half}, {block_n}],{layouts['c']!r}>",
              "as_ptr": "*fp32", "bs_ptr": "*fp32", "offs_ptr": "*i32", "c_ptr": f"*{out}"}
    constexprs = {"BLOCK_N": block_n, "STAGES": stages, **({"G_POW2": 8} if kind == "mgrouped" else {})}
    signature = {a: "constexpr" if a in constexprs else types_.get(a, "i32") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in fn.arg_names
             if a.endswith("_ptr") or a in ("N", "K", "stride_cm", "stride_cn", "stride_cg")}
    source = GluonASTSource(fn=fn, signature=signature, attrs=attrs,
                            constexprs={(fn.arg_names.index(a),): v for a, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": gluon_gemm.MATH_WARPS})


def ptxas(ptx: str) -> str:
    """ptxas -v's log for sm_90a (the ptxas Triton itself uses)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(ptx)
        src.flush()
        done = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src.name, "-o", "/dev/null"],
                              capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return done.stderr + done.stdout


def main_loop_barriers(ptx: str, threads: int) -> list[str]:
    """CTA-wide barriers (no thread count, or all `threads` of the CTA) inside a main loop: an innermost loop that
    issues wgmma (a loop: a label and a branch back to it; the warp-specialised dispatch loop around the partitions
    is not one); warpgroup-local named barriers (`bar.sync 2, 128`) are allowed."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__\w+):", line))}
    loops = {}
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and labels.get(m.group(1), i + 1) < i:
            loops[m.group(1)] = (labels[m.group(1)], i)
    wgmma_loops = [(start, end) for start, end in loops.values()
                   if any("wgmma.mma_async" in line for line in lines[start:end + 1])]
    main_loops = [(s, e) for s, e in wgmma_loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e)
                                                             for s2, e2 in wgmma_loops)]  # innermost: the K loops
    found = []
    for start, end in main_loops:
        for line in lines[start:end + 1]:
            m = BARRIER.match(line)
            if m and (m.group(2) is None or int(m.group(2)) >= threads):
                found.append(line.strip())
    return found


def report(kernel, ptx: str | None = None, ptxas_log: str | None = None) -> dict:
    """Registers, spill bytes, shared memory, CTA-wide barriers in the main loop and C7514 of one compiled kernel
    (ptx / ptxas_log: a planted variant's), with `ok` when every check passes."""
    import triton

    ptx = ptx if ptx is not None else kernel.asm["ptx"]
    log = ptxas_log if ptxas_log is not None else ptxas(ptx)
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    threads = 32 * kernel.metadata.num_warps
    maxnreg = sorted({int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
    out = {"triton": triton.__version__, "registers": int(regs.group(1)) if regs else None,
           "setmaxnreg": maxnreg, "spill_bytes": sum(spills), "shared_bytes": kernel.metadata.shared,
           "main_loop_cta_barriers": main_loop_barriers(ptx, threads), "c7514": "C7514" in log,
           "wgmma": "wgmma.mma_async" in ptx, "tma": "cp.async.bulk.tensor" in ptx}
    out["ok"] = (out["spill_bytes"] == 0 and out["shared_bytes"] <= SMEM_LIMIT and not out["main_loop_cta_barriers"]
                 and not out["c7514"] and out["wgmma"] and out["tma"])
    return out


def _with_barrier_in_main_loop(ptx: str) -> str:
    """The PTX with `bar.sync 0;` after every wgmma commit (the planted CTA-wide barrier)."""
    return re.sub(r"(wgmma\.commit_group\.sync\.aligned;)", r"\1\n\tbar.sync \t0;", ptx)


def main(argv: list[str]) -> None:
    """Compile and check every checked config (and with --planted the failing variants); print JSON. Compiles into a
    fresh cache folder: what is checked is compiled now, and no planted variant lands in the user's cache."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gluon-compile-")
    _import_kernels_without_torch()
    results = {}
    compiled = {}
    for name, (kind, block_n, stages) in CHECKED.items():
        compiled[name] = compile_gemm(kind, block_n, stages)
        results[name] = report(compiled[name])
    if "--planted" in argv:
        base = compiled["bn128_s5"]
        results["planted_stages7"] = report(compile_gemm("mgrouped", 128, 7))
        results["planted_bar_sync_0"] = report(base, _with_barrier_in_main_loop(base.asm["ptx"]))
        results["planted_wgrad_bn128"] = report(compile_gemm("kgrouped", 128, 4))  # 128 column scales per thread
        c7514 = "ptxas warning : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized"
        results["planted_c7514"] = report(base, None, ptxas(base.asm["ptx"]) + c7514)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
