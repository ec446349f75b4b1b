"""Plain-torch references of the grouped GEMMs (FP8: dequantise, then fp32 products), with the group offsets kept on
the device: rows are matched to groups there, so no reference reads offsets to the host."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.quant_ref import (dequantize_activation, dequantize_kgrouped, dequantize_weight, dequantize_weight_t,
                               row_groups)


def balanced_split(total: int, parts: int) -> list[int]:
    """total split into parts as evenly as possible, one more to each of the lowest (total mod parts)
    indices: the primitive of the rehearsal routing rule (see dispatch.rehearsal_rule), kept here because
    the kernels' meta path uses it and kernels may not import dispatch."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def grouped_rows_matmul(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """out[rows of g] = a[rows of g] @ b[g].t() for a [M, K], b [G, N, K], offs the cumulative group ends on the
    device; rows past offs[-1] (padding) are zero.

    Shapes are fixed by a and b, never by offs' values, so nothing is read to the host (the reference of every dtype
    torch._grouped_mm does not take, and graph-capturable): per group one product of all M rows, kept where the row is
    the group's; G times the FLOPs of the groups' own rows. Each row's value may differ from a product of its
    group's rows alone by the BLAS kernel's choice for the other row count (within rounding)."""
    group = row_groups(offs, a.shape[0]).unsqueeze(1)
    out = a.new_zeros(a.shape[0], b.shape[1])
    for g in range(b.shape[0]):  # the groups held here: a bound from the shape, not the data
        torch.where(group == g, a @ b[g].t(), out, out=out)
    return out


def grouped_rows_wgrad(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """dw[g] = a[rows of g].t() @ b[rows of g] for a [M, N], b [M, K] -> [G, N, K] (G = offs.numel()); rows past
    offs[-1] add nothing. No host read (see grouped_rows_matmul): per group a product over all M rows with the
    other groups' rows of a zeroed, which adds exact zeros: equal, bit for bit, to the product of the group's rows."""
    group = row_groups(offs, a.shape[0]).unsqueeze(1)
    return torch.stack([torch.where(group == g, a, 0).t() @ b for g in range(offs.numel())])


def fp8_grouped_gemm_ref(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offs: Tensor,
                         out_dtype: torch.dtype) -> Tensor:
    """out[rows of g] = deq(a)[rows of g] @ deq(b[g]).T for a [M, K] (1x128 tiles), b [G, N, K] (blocks)."""
    return grouped_rows_matmul(dequantize_activation(a, a_scale), dequantize_weight(b, b_scale), offs).to(out_dtype)


def fp8_grouped_gemm_dgrad_ref(dy: Tensor, dy_scale: Tensor, w_t: Tensor, w_scale: Tensor, offs: Tensor,
                               out_dtype: torch.dtype) -> Tensor:
    """dx[rows of g] = deq(dy)[rows of g] @ deq(w[g]) for dy [M, N] (1x128 tiles) and w's second orientation w_t
    [G, K, N] with w's block scales [G, ceil(N/128), ceil(K/128)] (quantize_weight(w, transposed=True))."""
    dx = grouped_rows_matmul(dequantize_activation(dy, dy_scale), dequantize_weight_t(w_t, w_scale), offs)
    return dx.to(out_dtype)


def fp8_grouped_gemm_wgrad_ref(a_t: Tensor, a_t_scale: Tensor, b_t: Tensor, b_t_scale: Tensor, offs: Tensor,
                               rows: int | None = None) -> Tensor:
    """dw[g] = deq(a)[rows of g].T @ deq(b)[rows of g] in fp32 from two k-grouped operands -> [G, N, K]; rows: the M
    the operands were made of, the length of the fp32 sums (default: the most rows the layout holds; rows past
    offs[-1] add zeros)."""
    a = dequantize_kgrouped(a_t, a_t_scale, offs, rows)
    b = dequantize_kgrouped(b_t, b_t_scale, offs, rows)
    return grouped_rows_wgrad(a, b, offs)
