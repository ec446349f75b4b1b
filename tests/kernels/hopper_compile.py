"""Compiles every Triton kernel for an H100 (sm_90) without a GPU; prints the TTGIR ops each one uses as JSON.

Run as a script in a process without TRITON_INTERPRET (test_hopper_compile.py does that).
"""

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import triton_gemm, triton_quant

HOPPER = GPUTarget("cuda", 90, 32)
ALIGNED = ("_ptr", "N", "K", "stride_cm", "stride_cg", "stride_cn", "stride_xm", "stride_qm", "stride_qk")


def compile_ops(fn, types: dict, constexprs: dict, num_warps: int) -> list[str]:
    """Names of the TritonGPU/NVIDIA ops in the kernel's TTGIR after compiling it for sm_90."""
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in fn.arg_names
             if a.endswith(ALIGNED) and a not in constexprs}
    consts = {(fn.arg_names.index(a),): v for a, v in constexprs.items()}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs), target=HOPPER,
                            options={"num_warps": num_warps, "num_stages": 3})
    return sorted(set(re.findall(r"\b(ttng\.[a-z_]+|ttg\.async_[a-z_]+)", kernel.asm["ttgir"])))


def main() -> None:
    """Compile the GEMMs at their 128x128 tile config and the quantisers; print {kernel: ops}."""
    scales = {"as_ptr": "*fp32", "bs_ptr": "*fp32", "offs_ptr": "*i32"}
    descs = {"a_desc": "tensordesc<fp8e4nv[128, 128]>", "b_desc": "tensordesc<fp8e4nv[128, 128]>"}
    tiles = {"BLOCK_M": 128, "BLOCK_N": 128}
    quant = {"x_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "offs_ptr": "*i32"}
    print(json.dumps({
        "mgrouped": compile_ops(triton_gemm._mgrouped_kernel.fn, {**descs, **scales, "c_ptr": "*bf16"},
                                {**tiles, "G_POW2": 8}, 8),
        "kgrouped": compile_ops(triton_gemm._kgrouped_kernel.fn, {**descs, **scales, "c_ptr": "*fp32"}, tiles, 8),
        "quantize_rows": compile_ops(triton_quant._quantize_rows_kernel, quant, {"BLOCK_M": 32}, 4),
        "quantize_blocks": compile_ops(triton_quant._quantize_blocks_kernel, quant, {}, 8),
        "quantize_kgrouped": compile_ops(triton_quant._quantize_kgrouped_kernel, quant,
                                         {"BLOCK_K": 64, "G_POW2": 8}, 8),
        "retile_kgrouped": compile_ops(triton_quant._retile_kgrouped_kernel, {**quant, "x_ptr": "*u8", "xs_ptr": "*fp32"},
                                       {"BLOCK_K": 64, "G_POW2": 8}, 8),
    }))


if __name__ == "__main__":
    main()
