"""Public FP8 ops: validate the inputs, then run the Triton kernel or the torch reference.

Triton runs on CUDA tensors; the reference runs on CPU tensors; `backend=` or $MOE_KERNELS_BACKEND
(auto | triton | torch) overrides that (Triton on CPU tensors needs TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import Tensor

from kernels import checks
from kernels.backend import use_fast_gemm, use_triton
from kernels.grouped_ref import fp8_grouped_gemm_dgrad_ref, fp8_grouped_gemm_ref, fp8_grouped_gemm_wgrad_ref
from kernels.meta import META_KERNELS
from kernels.quant_ref import (TILE, quantize_activation_kgrouped_ref, quantize_activation_ref, quantize_weight_ref,
                               quantize_weight_t_ref, retile_kgrouped_ref)


KERNELS: dict[str, tuple[str, Callable]] = {
    "quantize_activation": ("triton_quant.quantize_activation", quantize_activation_ref),
    "quantize_activation_kgrouped": ("triton_quant.quantize_activation_kgrouped", quantize_activation_kgrouped_ref),
    "retile_kgrouped": ("triton_quant.retile_kgrouped", retile_kgrouped_ref),
    "quantize_weight": ("triton_quant.quantize_weight", quantize_weight_ref),
    "quantize_weight_t": ("triton_quant.quantize_weight_t", quantize_weight_t_ref),
    "gemm": ("triton_gemm.mgrouped_gemm", fp8_grouped_gemm_ref),
    "dgrad": ("triton_gemm.mgrouped_dgrad", fp8_grouped_gemm_dgrad_ref),
    "wgrad": ("triton_gemm.kgrouped_gemm", fp8_grouped_gemm_wgrad_ref),
}
# the persistent warp-specialised Gluon kernels that replace the `tl` ones where backend.use_fast_gemm says so
FAST_KERNELS = {"gemm": "gluon_ops.mgrouped_gemm", "dgrad": "gluon_ops.mgrouped_dgrad",
                "wgrad": "gluon_ops.kgrouped_gemm"}


def run(op: str, backend: str | None, *args):
    """Run KERNELS[op] on already validated args: Triton (imported lazily; FAST_KERNELS[op] where use_fast_gemm) or
    the reference, per use_triton()."""
    triton_name, reference = KERNELS[op]
    if args[0].is_meta:  # a rehearsal: what the GPU kernel allocates, not the reference's intermediates
        return META_KERNELS[op](*args)
    if use_triton(args[0], backend):
        if op in FAST_KERNELS and use_fast_gemm(args[0]):
            triton_name = FAST_KERNELS[op]
        module, name = triton_name.split(".")
        return getattr(importlib.import_module(f"kernels.{module}"), name)(*args)
    return reference(*args)


def default_out_dtype(t: Tensor) -> torch.dtype:
    """bf16 on GPU, fp32 on CPU."""
    return torch.bfloat16 if t.is_cuda else torch.float32


def quantize_activation(x: Tensor, *, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (q e4m3 [M, K], scale fp32 [M, ceil(K/128)]): one scale per 1x128 tile, x ~= q * scale."""
    checks.check_float("x", x, 2)
    return run("quantize_activation", backend, x)


def quantize_activation_kgrouped(x: Tensor, offs: Tensor, *, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] sorted by group -> (q_t e4m3 [K, 128*T], scale fp32 [K, T]), T = ceil(M/128) + G: x^T in
    1x128 tiles along tokens restarting at every group (the tile at row r of group g is column g + r//128,
    zero-padded); the operand layout of the k-grouped wgrad. Rows past offs[-1] (padding) are left out."""
    checks.check_float("x", x, 2)
    checks.check_offs(offs, x.shape[0])
    checks.check_same_device(x=x, offs=offs)
    return run("quantize_activation_kgrouped", backend, x, offs)


def retile_kgrouped(x_q: Tensor, x_scale: Tensor, offs: Tensor, *,
                    backend: str | None = None) -> tuple[Tensor, Tensor]:
    """e4m3 rows x_q [M, K] sorted by group, with 1x128 tile scales x_scale [M, ceil(K/128)] along K (as
    quantize_activation makes them) -> the k-grouped layout of quantize_activation_kgrouped: exactly
    quantize_activation_kgrouped(x_q * x_scale, offs), without materialising the fp32 x_q * x_scale."""
    checks.check_fp8("x_q", x_q, 2)
    checks.check_scale("x_scale", x_scale, checks.activation_scale_shape(x_q))
    checks.check_offs(offs, x_q.shape[0])
    checks.check_same_device(x_q=x_q, x_scale=x_scale, offs=offs)
    return run("retile_kgrouped", backend, x_q, x_scale, offs)


def quantize_weight(w: Tensor, *, transposed: bool = False, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """w [N, K] or [G, N, K] -> (q e4m3, scale fp32 [..., ceil(N/128), ceil(K/128)]), one per 128x128 block.

    transposed: q holds the same codes in the other orientation, [..., K, N] (K-major for dgrad, which reduces over
    N), written so by the quantiser itself (no transpose pass); the scales are the same tensor either way."""
    checks.check_float("w", w, (2, 3))
    return run("quantize_weight_t" if transposed else "quantize_weight", backend, w)


def _check_mgrouped(names: tuple[str, str], a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor,
                    offs: Tensor, b_dim: int, b_transposed: bool = False) -> None:
    a_name, b_name = names
    checks.check_fp8(a_name, a, 2)
    checks.check_fp8(b_name, b, 3)
    checks.check_same_size("reduction size", (f"{a_name}.shape[1]", a.shape[1]),
                           (f"{b_name}.shape[{b_dim}]", b.shape[b_dim]))
    checks.check_scale(f"{a_name}_scale", a_scale, checks.activation_scale_shape(a))
    checks.check_scale(f"{b_name}_scale", b_scale, checks.weight_scale_shape(b.transpose(1, 2) if b_transposed else b))
    checks.check_offs(offs, a.shape[0], b.shape[0])
    checks.check_same_device(**{a_name: a, f"{a_name}_scale": a_scale, b_name: b, f"{b_name}_scale": b_scale,
                                "offs": offs})


def fp8_grouped_gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offs: Tensor, *,
                     out_dtype: torch.dtype | None = None, backend: str | None = None) -> Tensor:
    """out[rows of g] = a[rows of g] @ b[g].T: a e4m3 [M, K] (1x128 scales) with rows sorted by group,
    b e4m3 [G, N, K] (128x128 scales), offs int32 [G] cumulative group ends (any sizes, 0 included; rows past
    offs[-1] are padding, in no group: their out rows are zero in the reference, not written by the Triton kernel,
    never data); fp32 promotion every 128 of K; out [M, N] in out_dtype (default bf16 on GPU, fp32 on CPU)."""
    _check_mgrouped(("a", "b"), a, a_scale, b, b_scale, offs, b_dim=2)
    return run("gemm", backend, a, a_scale, b, b_scale, offs, out_dtype or default_out_dtype(a))


def fp8_grouped_gemm_dgrad(dy: Tensor, dy_scale: Tensor, w_t: Tensor, w_scale: Tensor, offs: Tensor, *,
                           out_dtype: torch.dtype | None = None, backend: str | None = None) -> Tensor:
    """dx[rows of g] = dy[rows of g] @ w[g]: dy e4m3 [M, N] (1x128 scales), w_t e4m3 [G, K, N] with w's
    128x128 scales [G, ceil(N/128), ceil(K/128)] (quantize_weight(w, transposed=True)) -> dx [M, K]."""
    _check_mgrouped(("dy", "w_t"), dy, dy_scale, w_t, w_scale, offs, b_dim=2, b_transposed=True)
    return run("dgrad", backend, dy, dy_scale, w_t, w_scale, offs, out_dtype or default_out_dtype(dy))


def fp8_grouped_gemm_wgrad(a_t: Tensor, a_t_scale: Tensor, b_t: Tensor, b_t_scale: Tensor, offs: Tensor, *,
                           rows: int | None = None, backend: str | None = None) -> Tensor:
    """dw[g] = a[rows of g].T @ b[rows of g] in fp32 -> [G, N, K], from k-grouped operands
    (quantize_activation_kgrouped of a [M, N] and of b [M, K]: the same tile columns); rows past offs[-1] add
    nothing. rows: M, which the reference's fp32 sums run over (default: the most rows the layout holds, 128 x its
    token tiles less the groups; a sum's length may change its last bits)."""
    checks.check_offs(offs, None)
    checks.check_kgrouped("a_t", a_t, a_t_scale, offs.numel())
    checks.check_kgrouped("b_t", b_t, b_t_scale, offs.numel(), a_t.shape[1] // TILE)
    checks.check_same_device(a_t=a_t, a_t_scale=a_t_scale, b_t=b_t, b_t_scale=b_t_scale, offs=offs)
    return run("wgrad", backend, a_t, a_t_scale, b_t, b_t_scale, offs, rows)
