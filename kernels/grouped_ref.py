"""Plain-torch references of the FP8 grouped GEMMs: dequantise, then one fp32 matmul per group."""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import Tensor

from kernels.quant_ref import dequantize_activation, dequantize_kgrouped, dequantize_weight


def balanced_split(total: int, parts: int) -> list[int]:
    """total split into parts as evenly as possible, one more to each of the lowest (total mod parts)
    indices: the primitive of the rehearsal routing rule (see dispatch.rehearsal_rule), kept here because
    the kernels' meta path uses it and kernels may not import dispatch."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def group_bounds(offs: Tensor, rows: int | None = None) -> list[tuple[int, int]]:
    """(start, end) row range of every group from the cumulative ends `offs`; meta offs hold no values,
    so there the `rows` rows split evenly over the groups (the rehearsal rule, dispatch.rehearsal_rule)."""
    if offs.is_meta:
        if rows is None:
            raise ValueError("group_bounds of meta offs needs the row count (rows=)")
        ends = list(accumulate(balanced_split(rows, offs.numel())))
    else:
        ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def _grouped_matmul(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    out = a.new_empty(a.shape[0], b.shape[1])
    for g, (start, end) in enumerate(group_bounds(offs, a.shape[0])):
        out[start:end] = a[start:end] @ b[g].t()
    return out


def fp8_grouped_gemm_ref(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offs: Tensor,
                         out_dtype: torch.dtype) -> Tensor:
    """out[rows of g] = deq(a)[rows of g] @ deq(b[g]).T for a [M, K] (1x128 tiles), b [G, N, K] (blocks)."""
    return _grouped_matmul(dequantize_activation(a, a_scale), dequantize_weight(b, b_scale), offs).to(out_dtype)


def fp8_grouped_gemm_dgrad_ref(dy: Tensor, dy_scale: Tensor, w: Tensor, w_scale: Tensor, offs: Tensor,
                               out_dtype: torch.dtype) -> Tensor:
    """dx[rows of g] = deq(dy)[rows of g] @ deq(w[g]) for dy [M, N] (1x128 tiles), w [G, N, K] (blocks)."""
    w_t = dequantize_weight(w, w_scale).transpose(1, 2)
    return _grouped_matmul(dequantize_activation(dy, dy_scale), w_t, offs).to(out_dtype)


def fp8_grouped_gemm_wgrad_ref(a_t: Tensor, a_t_scale: Tensor, b_t: Tensor, b_t_scale: Tensor,
                               offs: Tensor) -> Tensor:
    """dw[g] = deq(a)[rows of g].T @ deq(b)[rows of g] in fp32 from two k-grouped operands -> [G, N, K]."""
    a = dequantize_kgrouped(a_t, a_t_scale, offs)
    b = dequantize_kgrouped(b_t, b_t_scale, offs)
    dw = a.new_zeros(offs.numel(), a.shape[1], b.shape[1])
    for g, (start, end) in enumerate(group_bounds(offs)):
        dw[g] = a[start:end].t() @ b[start:end]
    return dw
