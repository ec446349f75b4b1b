"""SwiGLU experts with weights stacked per expert, computed as grouped matmuls; and the dense MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.config import check_choice, EXPERT_PRECISIONS
from moe.grouped_mm import group_offsets, grouped_linear

if TYPE_CHECKING:
    from kernels import FP8Rows
    from moe.tp.comm import TPRegion


def _linear_for(precision: str):
    if precision == "fp8":
        from kernels import fp8_grouped_linear
        return fp8_grouped_linear
    return grouped_linear


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs: w_gate_up [E, 2F, H] and w_down [E, H, F], applied to sorted rows."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, *,
                 precision: str = "native", init_std: float = 0.02, out_std: float | None = None) -> None:
        super().__init__()
        check_choice("expert_precision", precision, EXPERT_PRECISIONS)
        self.precision = precision
        self.w_gate_up = nn.Parameter(torch.randn(num_experts, 2 * ffn_size, hidden_size) * init_std)
        self.w_down = nn.Parameter(torch.randn(num_experts, hidden_size, ffn_size) * (out_std or init_std))

    @property
    def num_experts(self) -> int:
        """Number of experts held here."""
        return self.w_gate_up.shape[0]

    def forward(self, x: Tensor | FP8Rows, tokens_per_expert: Tensor) -> Tensor:
        """x [N, H] rows contiguous per expert (counts in tokens_per_expert [E]) -> [N, H]; fp8 experts also
        take FP8Rows (an fp8 dispatch's e4m3 rows), which the first GEMM uses as they are."""
        if tokens_per_expert.numel() != self.num_experts:
            raise ValueError(f"tokens_per_expert has {tokens_per_expert.numel()} entries, "
                             f"expected one per expert ({self.num_experts})")
        dtype = x.dtype if isinstance(x, Tensor) else x.rows.dtype
        if not isinstance(x, Tensor) and self.precision != "fp8":
            raise ValueError(f"e4m3 rows (FP8Rows) need expert_precision = 'fp8', got {self.precision!r}")
        linear = _linear_for(self.precision)
        offs = group_offsets(tokens_per_expert)
        gate, up = linear(x, self.w_gate_up.to(dtype), offs).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.w_down.to(dtype), offs)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP (dense layers and shared experts); tensor-parallel after moe.tp.parallelize_swiglu."""

    def __init__(self, hidden_size: int, ffn_size: int, *, init_std: float = 0.02,
                 out_std: float | None = None) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * ffn_size, bias=False)
        self.down = nn.Linear(ffn_size, hidden_size, bias=False)
        nn.init.normal_(self.gate_up.weight, std=init_std)
        nn.init.normal_(self.down.weight, std=out_std or init_std)
        self.tp: TPRegion | None = None

    def forward(self, x: Tensor) -> Tensor:
        """x [..., H] -> [..., H] (under TP with SP: token shards in and out)."""
        if self.tp is not None:
            x = self.tp.enter(x)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        out = self.down(F.silu(gate) * up)
        return out if self.tp is None else self.tp.leave(out)
