"""SwiGLU experts with weights stacked per expert, computed as grouped matmuls; and the dense MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dispatch.choices import check_choice
from moe.config import ExpertPrecision
from moe.grouped_mm import group_offsets, grouped_linear
from moe.linear import make_linear, takes_rows
from moe.recompute import Rebuild, recomputed

if TYPE_CHECKING:
    from kernels import FP8Rows
    from moe.tp.comm import TPRegion


def _linear_for(precision: str):
    if precision == "fp8":
        from kernels import fp8_grouped_linear
        return fp8_grouped_linear
    return grouped_linear


def swiglu_down(gate_up: Tensor, down: Callable[[Tensor], Tensor], selective: bool) -> Tensor:
    """down(silu(gate) * up) of gate_up = [gate | up]; selective: silu(gate) and the product are not kept for
    backward but rebuilt there from gate_up (moe.recompute.Rebuild), also for the down projection's weight grad."""
    gate, up = gate_up.chunk(2, dim=-1)
    if not selective:
        return down(F.silu(gate) * up)
    g, u = gate.detach(), up.detach()
    with Rebuild() as rebuild:
        act = rebuild.drop(F.silu(gate), lambda: F.silu(g))
        return down(rebuild.drop(act * up, lambda: F.silu(g) * u))


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs: w_gate_up [E, 2F, H] and w_down [E, H, F], applied to sorted rows.

    recompute (moe.recompute): "selective" rebuilds the SwiGLU products in backward, "full" keeps the input rows
    only and reruns the experts in backward (an fp8 dispatch's FP8Rows are not rerun: kept as without recompute)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, *,
                 precision: str = "native", init_std: float = 0.02, out_std: float | None = None) -> None:
        super().__init__()
        check_choice("expert_precision", precision, ExpertPrecision)
        self.precision = precision
        self.w_gate_up = nn.Parameter(torch.randn(num_experts, 2 * ffn_size, hidden_size) * init_std)
        self.w_down = nn.Parameter(torch.randn(num_experts, hidden_size, ffn_size) * (out_std or init_std))
        self.recompute = "none"

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
        offs = group_offsets(tokens_per_expert)
        if self.recompute == "full" and isinstance(x, Tensor):
            return recomputed(lambda rows: (self._swiglu(rows, offs, dtype),), [x])[0]
        return self._swiglu(x, offs, dtype)

    def _swiglu(self, x: Tensor | FP8Rows, offs: Tensor, dtype: torch.dtype) -> Tensor:
        linear = _linear_for(self.precision)
        w_down = self.w_down.to(dtype)
        return swiglu_down(linear(x, self.w_gate_up.to(dtype), offs), lambda p: linear(p, w_down, offs),
                           self.recompute == "selective")


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP (dense layers and shared experts); tensor-parallel after moe.tp.parallelize_swiglu.

    recompute (moe.recompute): "selective" rebuilds the product in backward, "full" keeps the input only and reruns
    the MLP in backward (not under TP: its collectives would run again). precision: model.linear_precision of its
    gate_up and down linears."""

    def __init__(self, hidden_size: int, ffn_size: int, *, init_std: float = 0.02,
                 out_std: float | None = None, precision: str = "native") -> None:
        super().__init__()
        self.gate_up = make_linear(hidden_size, 2 * ffn_size, precision, init_std)
        self.down = make_linear(ffn_size, hidden_size, precision, out_std or init_std)
        self.tp: TPRegion | None = None
        self.recompute = "none"

    def takes_rows(self) -> bool:
        """Whether forward takes FP8Rows (its input quantised by the norm before it): FP8 linears, no TP (whose
        SP gather comes between the norm and gate_up), no full recompute (which keeps a tensor input)."""
        return takes_rows(self.gate_up) and self.tp is None and self.recompute != "full"

    def forward(self, x: Tensor | FP8Rows) -> Tensor:
        """x [..., H] (FP8Rows when takes_rows()) -> [..., H] (under TP with SP: token shards in and out)."""
        if self.recompute == "full" and self.tp is None:
            return recomputed(lambda rows: (self._swiglu(rows),), [x])[0]
        return self._swiglu(x)

    def _swiglu(self, x: Tensor | FP8Rows) -> Tensor:
        if self.tp is not None:
            x = self.tp.enter(x)
        out = swiglu_down(self.gate_up(x), self.down, self.recompute == "selective")
        return out if self.tp is None else self.tp.leave(out)
