"""Host side of the Gluon FP8 grouped GEMMs (kernels/gluon_gemm.py: forward, dgrad, wgrad): per-shape configs, TMA
descriptors, launch.

Chosen by kernels.backend.use_fast_gemm: CUDA tensors on an sm_90 GPU with a Triton that has Gluon (3.6 and 3.9
checked: tests/kernels/gluon_compile.py); elsewhere the `tl` kernels of triton_gemm run.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import gluon_gemm, triton_gemm
from kernels.fp8_format import ALIGN, TILE
from kernels.triton_common import walk_size

SMEM_LIMIT = 227 * 1024
DEFAULT_CONFIG = (128, 6)  # (BLOCK_N, STAGES): the widest ring that fits with a bf16 output (229672 B)
# Per (N, K) of the shape table (forward: N, K; dgrad: K, N): checked in so a fresh machine pays no tuning.
# Compile-checked, not yet measured (no GPU when written): the GPU slice replaces them with the timed best.
CONFIGS: dict[tuple[int, int], tuple[int, int]] = {
    (4096, 7168): (128, 6), (7168, 2048): (128, 6),  # forward
    (7168, 4096): (128, 6), (2048, 7168): (128, 6),  # dgrad
}
WGRAD_CONFIG = (64, 6)  # (BLOCK_N, STAGES) of the wgrad: 128 columns of fp32 column scales spill (112 bytes)
_OUT = {torch.bfloat16: (gl.bfloat16, 2), torch.float32: (gl.float32, 4)}


def config(n: int, k: int, out_dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, STAGES) for an [.., K] x [N, K] product: the checked-in entry (else DEFAULT_CONFIG), with fewer
    stages where the output tile's bytes (fp32) would take shared memory past the limit."""
    block_n, stages = CONFIGS.get((n, k), DEFAULT_CONFIG)
    while gluon_gemm.smem_bytes(block_n, stages, _OUT[out_dtype][1]) > SMEM_LIMIT:
        stages -= 1
    return block_n, stages


def mgrouped_gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offs: Tensor,
                  out_dtype: torch.dtype) -> Tensor:
    """triton_gemm.mgrouped_gemm's contract on the persistent warp-specialised kernel: out[rows of g] =
    a[rows of g] @ b[g].T for K-major e4m3 a [M, K] (1x128 scales, any strides), b [G, N, K] (128x128 blocks)."""
    a, b = a.contiguous(), b.contiguous()
    m, k = a.shape
    groups, n, _ = b.shape
    if k % ALIGN or n % ALIGN:
        raise ValueError(f"the Gluon FP8 GEMM needs both matrix sizes (K = {k}, N = {n}) to be multiples of {ALIGN} "
                         "(TMA row alignment); use backend='torch' for other sizes")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_n, stages = config(n, k, out_dtype)
    layouts = gluon_gemm.shared_layouts(block_n, _OUT[out_dtype][0])
    half = gluon_gemm.HALF_M.value
    a_desc = TensorDescriptor.from_tensor(a, [half, TILE], layouts["a"])
    b_desc = TensorDescriptor.from_tensor(b.view(groups * n, k), [block_n, TILE], layouts["b"])
    c_desc = TensorDescriptor.from_tensor(out, [half, block_n], layouts["c"])
    walk = walk_size(m, n, groups, gluon_gemm.BLOCK_M.value, block_n)
    programs = min(walk, torch.cuda.get_device_properties(a.device).multi_processor_count)
    gluon_gemm.mgrouped_kernel[(programs,)](
        a_desc, a_scale, b_desc, b_scale, offs, c_desc, out, m, n, k, groups, walk,
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), out.stride(0),
        BLOCK_N=block_n, STAGES=stages, G_POW2=triton.next_power_of_2(groups), num_warps=gluon_gemm.MATH_WARPS)
    return out


def mgrouped_dgrad(dy: Tensor, dy_scale: Tensor, w_t: Tensor, w_scale: Tensor, offs: Tensor,
                   out_dtype: torch.dtype) -> Tensor:
    """dx[rows of g] = dy[rows of g] @ w[g] from w's dgrad orientation w_t [G, K, N] (triton_gemm.mgrouped_dgrad's
    contract), w's block scales read transposed."""
    return mgrouped_gemm(dy, dy_scale, w_t, w_scale.transpose(1, 2), offs, out_dtype)


def kgrouped_gemm(a_t: Tensor, a_scale: Tensor, b_t: Tensor, b_scale: Tensor, offs: Tensor,
                  rows: int | None = None) -> Tensor:
    """triton_gemm.kgrouped_gemm's contract on the persistent warp-specialised kernel: dw[g] = a[rows of g].T @
    b[rows of g] (fp32 [G, N, K]) from k-grouped e4m3 a_t [N, 128T] and b_t [K, 128T] (rows, the reference's sum
    length, changes nothing: each group's own tiles are walked); K not a multiple of 4 (the fp32 output's rows would
    not be TMA-aligned) goes to the `tl` kernel."""
    a_t, b_t = a_t.contiguous(), b_t.contiguous()
    n, k, groups = a_t.shape[0], b_t.shape[0], offs.numel()
    if k % 4:
        return triton_gemm.kgrouped_gemm(a_t, a_scale, b_t, b_scale, offs)
    out = torch.empty(groups, n, k, dtype=torch.float32, device=a_t.device)
    block_n, stages = WGRAD_CONFIG
    walk = groups * triton.cdiv(n, gluon_gemm.BLOCK_M.value) * triton.cdiv(k, block_n)
    if walk == 0 or n == 0:
        return out
    layouts = gluon_gemm.shared_layouts(block_n, gl.float32)
    half = gluon_gemm.HALF_M.value
    a_desc = TensorDescriptor.from_tensor(a_t, [half, TILE], layouts["a"])
    b_desc = TensorDescriptor.from_tensor(b_t, [block_n, TILE], layouts["b"])
    c_desc = TensorDescriptor.from_tensor(out.view(groups * n, k), [half, block_n], layouts["c"])
    programs = min(walk, torch.cuda.get_device_properties(a_t.device).multi_processor_count)
    gluon_gemm.kgrouped_kernel[(programs,)](
        a_desc, a_scale, b_desc, b_scale, offs, c_desc, out, n, k, walk, a_scale.stride(0), a_scale.stride(1),
        b_scale.stride(0), b_scale.stride(1), out.stride(0), out.stride(1),
        BLOCK_N=block_n, STAGES=stages, num_warps=gluon_gemm.MATH_WARPS)
    return out
