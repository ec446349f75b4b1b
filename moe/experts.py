"""SwiGLU experts with weights stacked per expert, computed as grouped matmuls; and the dense MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dispatch.choices import check_choice
from dispatch.fp8 import dequantize_fp8, quantize_fp8
from kernels import FP8Rows
from moe.config import ActivationCache, ExpertPrecision
from moe.grouped_mm import group_offsets, grouped_linear
from moe.linear import make_linear, takes_rows
from moe.recompute import Rebuild, recomputed

if TYPE_CHECKING:
    from moe.tp.comm import TPRegion


def _linear_for(precision: str):
    if precision == "fp8":
        from kernels import fp8_grouped_linear
        return fp8_grouped_linear
    return grouped_linear


def _product(gate_up: Tensor, row_weight: Tensor | None) -> Tensor:
    """silu(gate) * up of gate_up = [gate | up], times row_weight [rows] per row (in at least fp32, rounded once
    to gate_up's dtype) when given."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    if row_weight is None:
        return act
    acc = torch.promote_types(act.dtype, torch.float32)
    return (act.to(acc) * row_weight.to(acc).unsqueeze(-1)).to(act.dtype)


def _cache(gate_up: Tensor, cache: str) -> tuple[Tensor, ...]:
    """What a cached SwiGLU keeps of gate_up [..., 2F]: ("fp8") its e4m3 1x128 tiles and fp32 scales, as
    kernels.quantize_activation makes them of its rows [rows, 2F] (dispatch.fp8.quantize_fp8: fp64 rounded to fp32
    first); ("native") gate_up itself."""
    if cache == "native":
        return (gate_up,)
    return quantize_fp8(gate_up.reshape(-1, gate_up.shape[-1]))


def _restore(cached: tuple[Tensor, ...], dtype: torch.dtype, shape: torch.Size) -> Tensor:
    """gate_up of dtype and shape from its _cache (e4m3 tiles dequantised in fp32, then cast)."""
    if len(cached) == 1:
        return cached[0]
    return dequantize_fp8(*cached, dtype).view(shape)


class _CachedSwiGLU(torch.autograd.Function):
    """h = row_weight * silu(gate) * up (_product) of gate_up, saving only gate_up's cache (_cache) and
    row_weight; backward restores gate_up from the cache, recomputes the product and gives d gate|up and
    d row_weight[row] = <dh[row], silu(gate) * up [row]> (in at least fp32)."""

    @staticmethod
    def forward(ctx, gate_up: Tensor, row_weight: Tensor | None, *cached: Tensor) -> Tensor:  # noqa: D102
        ctx.save_for_backward(row_weight, *cached)
        ctx.dtype, ctx.shape = gate_up.dtype, gate_up.shape
        return _product(gate_up, row_weight)

    @staticmethod
    def backward(ctx, dh: Tensor):  # noqa: D102
        row_weight, *cached = ctx.saved_tensors
        gate, up = _restore(tuple(cached), ctx.dtype, ctx.shape).chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_act, d_weight = dh, None
        if row_weight is not None:
            acc = torch.promote_types(dh.dtype, torch.float32)
            d_act = (dh.to(acc) * row_weight.to(acc).unsqueeze(-1)).to(dh.dtype)
            if ctx.needs_input_grad[1]:
                d_weight = (dh.to(acc) * (silu * up).to(acc)).sum(-1).to(row_weight.dtype)
        d_gate_up = torch.cat([d_act * up * sig * (1 + gate * (1 - sig)), d_act * silu], dim=-1)
        return (d_gate_up, d_weight, *[None] * len(cached))


def _cached_swiglu_down(gate_up: Tensor, down: Callable[[Tensor | FP8Rows], Tensor], cache: str,
                        row_weight: Tensor | None, fp8_down: bool) -> Tensor:
    """down(row_weight * silu(gate) * up) keeping gate_up's cache only (see swiglu_down)."""
    cached = _cache(gate_up.detach(), cache)
    dtype, shape = gate_up.dtype, gate_up.shape
    weight = None if row_weight is None else row_weight.detach()
    h = _CachedSwiGLU.apply(gate_up, row_weight, *cached)

    def product() -> Tensor:  # the down projection's input, rebuilt from the cache in backward
        return _product(_restore(cached, dtype, shape), weight)
    with Rebuild() as rebuild:
        if not fp8_down:
            return down(rebuild.drop(h, product))
        width = h.shape[-1]  # the thunk holds no tensor of the graph: h itself would live as long as it does
        q, scale = quantize_fp8(h.detach().reshape(-1, width))  # the tiles the FP8 linear would make of h
        q, scale = rebuild.drop_tiles(q, scale, lambda: quantize_fp8(product().reshape(-1, width)))
        return down(FP8Rows(q, scale, h))


def swiglu_down(gate_up: Tensor, down: Callable[[Tensor | FP8Rows], Tensor], selective: bool, cache: str = "native",
                row_weight: Tensor | None = None, fp8_down: bool = False) -> Tensor:
    """down(silu(gate) * up) of gate_up = [gate | up]; selective: silu(gate) and the product are not kept for
    backward but rebuilt there from gate_up (moe.recompute.Rebuild), also for the down projection's weight grad.

    cache = "fp8" (model.activation_cache) or a row_weight [rows] (an expert row's routing weight, folded in as
    down(row_weight * silu(gate) * up)): one op (_CachedSwiGLU) makes the product and keeps only gate_up's cache,
    e4m3 1x128 tiles with fp32 scales ("fp8") or gate_up itself ("native"), and row_weight; backward rebuilds the
    product, and the down projection's input from it, from that cache. fp8_down: down is an FP8 linear that takes
    FP8Rows; it is handed the product's e4m3 tiles, which it keeps, and which are rebuilt the same way."""
    if cache == "native" and row_weight is None:
        gate, up = gate_up.chunk(2, dim=-1)
        if not selective:
            return down(F.silu(gate) * up)
        g, u = gate.detach(), up.detach()
        with Rebuild() as rebuild:
            act = rebuild.drop(F.silu(gate), lambda: F.silu(g))
            return down(rebuild.drop(act * up, lambda: F.silu(g) * u))
    return _cached_swiglu_down(gate_up, down, cache, row_weight, fp8_down)


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs: w_gate_up [E, 2F, H] and w_down [E, H, F], applied to sorted rows.

    recompute (moe.recompute): "selective" rebuilds the SwiGLU products in backward, "full" keeps the input rows
    only and reruns the experts in backward (an fp8 dispatch's FP8Rows are not rerun: kept as without recompute).
    activation_cache (model.activation_cache): "fp8" keeps each row's gate|up in e4m3 only (swiglu_down), and fp8
    experts keep their input rows as the e4m3 tiles their first GEMM reads (FP8Rows), not in the run's dtype."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, *,
                 precision: str = "native", init_std: float = 0.02, out_std: float | None = None,
                 activation_cache: str = "native") -> None:
        super().__init__()
        check_choice("expert_precision", precision, ExpertPrecision)
        check_choice("activation_cache", activation_cache, ActivationCache)
        self.precision = precision
        self.activation_cache = activation_cache
        self.w_gate_up = nn.Parameter(torch.randn(num_experts, 2 * ffn_size, hidden_size) * init_std)
        self.w_down = nn.Parameter(torch.randn(num_experts, hidden_size, ffn_size) * (out_std or init_std))
        self.recompute = "none"
        self.spares: list[Tensor] = []  # redundant experts' weights after the owned ones (moe.replicas), no params

    def hold_spares(self, spares: list[Tensor]) -> None:
        """Use spares (the redundant experts' copies of w_gate_up and w_down, moe.replicas) after the owned experts,
        held as non-persistent buffers: no parameters (the optimizer sees the owners only), not in the state dict
        (checkpoints hold owners only), but model state to a memory tracker (the rehearsal)."""
        self.spares = list(spares)
        for name, spare in zip(("spare_w_gate_up", "spare_w_down"), self.spares):
            self.register_buffer(name, spare, persistent=False)

    @property
    def num_experts(self) -> int:
        """Number of experts held here (owned ones; the redundant copies in spares come after them)."""
        return self.w_gate_up.shape[0]

    def _weights(self) -> tuple[Tensor, Tensor]:
        """w_gate_up and w_down, followed by the redundant experts' copies when this rank holds spare slots."""
        if not self.spares:
            return self.w_gate_up, self.w_down
        return torch.cat([self.w_gate_up, self.spares[0]]), torch.cat([self.w_down, self.spares[1]])

    def forward(self, x: Tensor | FP8Rows, tokens_per_expert: Tensor, row_weight: Tensor | None = None) -> Tensor:
        """x [N, H] rows contiguous per expert (counts in tokens_per_expert [E]) -> [N, H]; fp8 experts also
        take FP8Rows (an fp8 dispatch's e4m3 rows), which the first GEMM uses as they are. row_weight [N]: each
        row's routing weight, folded in before the down projection (out = down(w * silu(gate) * up))."""
        slots = self.num_experts + (len(self.spares[0]) if self.spares else 0)
        if tokens_per_expert.numel() != slots:
            raise ValueError(f"tokens_per_expert has {tokens_per_expert.numel()} entries, "
                             f"expected one per expert slot ({slots})")
        dtype = x.dtype if isinstance(x, Tensor) else x.rows.dtype
        if not isinstance(x, Tensor) and self.precision != "fp8":
            raise ValueError(f"e4m3 rows (FP8Rows) need expert_precision = 'fp8', got {self.precision!r}")
        offs = group_offsets(tokens_per_expert)
        if self.recompute == "full" and isinstance(x, Tensor):
            weights = [] if row_weight is None else [row_weight]
            return recomputed(lambda rows, *w: (self._swiglu(rows, offs, dtype, *w),), [x, *weights])[0]
        return self._swiglu(x, offs, dtype, row_weight)

    def _swiglu(self, x: Tensor | FP8Rows, offs: Tensor, dtype: torch.dtype, row_weight: Tensor | None = None
                ) -> Tensor:
        linear = _linear_for(self.precision)
        fp8 = self.precision == "fp8"
        if fp8 and self.activation_cache == "fp8" and isinstance(x, Tensor):
            x = FP8Rows(*quantize_fp8(x.detach()), x)  # the tiles the first GEMM makes of x, kept in x's place
        w_gate_up, w_down = self._weights()
        w_down = w_down.to(dtype)
        return swiglu_down(linear(x, w_gate_up.to(dtype), offs), lambda p: linear(p, w_down, offs),
                           self.recompute == "selective", self.activation_cache, row_weight, fp8)


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
        self.activation_cache = "native"  # model.activation_cache, set by the block or layer holding it

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
        # an FP8 down projection is handed the product's e4m3 tiles, rebuilt in backward from the FP8 cache
        fp8_down = self.activation_cache == "fp8" and takes_rows(self.down) and self.tp is None
        out = swiglu_down(self.gate_up(x), self.down, self.recompute == "selective", self.activation_cache,
                          fp8_down=fp8_down)
        return out if self.tp is None else self.tp.leave(out)
