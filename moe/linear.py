"""The model's non-expert linears in their precision (model.linear_precision), and what FP8 linears read.

"native" builds nn.Linear; "fp8" builds kernels.FP8Linear (an nn.Linear whose three GEMMs run in e4m3, keeping its
input's e4m3 tiles for backward). Two helpers keep a second copy of an FP8 linear's input from staying alive:

- fp8_norm_output: an RMSNorm's output quantised once for all its FP8 consumers (MLA's q_a and kv_a share one set of
  tiles); under selective recompute neither the output nor its tiles are kept, both rebuilt from the norm's input
  (which the norm keeps anyway), so the norm is fused into its consumers as DeepSeek-V3 recomputes it.
- project_heads: the attention output projection reads the core's output [B, heads, S, D] through a view; an FP8
  out keeps that view (the storage the fused core keeps for its own backward: no bytes of its own) and quantises it
  k-grouped for its wgrad in backward, instead of keeping e4m3 tiles beside the core's copy.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from dispatch.choices import check_choice
from kernels import FP8Linear, FP8Rows, quantize_activation
from moe.config import LinearPrecision
from moe.recompute import Rebuild, norm_output


def make_linear(width_in: int, width_out: int, precision: str, std: float) -> nn.Linear:
    """A bias-free linear [width_in -> width_out] drawn from normal(0, std), in linear_precision `precision`
    (both draw the same numbers: FP8Linear is built as nn.Linear is)."""
    check_choice("linear_precision", precision, LinearPrecision)
    linear = (FP8Linear if precision == "fp8" else nn.Linear)(width_in, width_out, bias=False)
    nn.init.normal_(linear.weight, std=std)
    return linear


def takes_rows(linear: nn.Module) -> bool:
    """Whether linear takes FP8Rows (e4m3 rows its caller quantised) as its input."""
    return isinstance(linear, FP8Linear)


def rows_of(x: Tensor | FP8Rows) -> Tensor:
    """The tensor standing for x: x itself, or FP8Rows' rows (shape, dtype, device and autograd edge)."""
    return x.rows if isinstance(x, FP8Rows) else x


def fp8_norm_output(rebuild: Rebuild | None, norm: Callable[[Tensor], Tensor], x: Tensor) -> FP8Rows:
    """norm(x) [..., K] as FP8Rows (1x128 e4m3 tiles) for FP8 linears to share. With a Rebuild (selective
    recompute) the output (moe.recompute.norm_output) and its tiles are dropped wherever an op would save them;
    backward rebuilds the tiles from x (the norm's saved input) by running the norm and the quantisation again."""
    out = norm_output(rebuild, norm, x)
    q, scale = quantize_activation(out.detach().reshape(-1, out.shape[-1]))
    if rebuild is not None:
        kept = x.detach()

        def tiles() -> tuple[Tensor, Tensor]:
            normed = norm(kept)
            return quantize_activation(normed.reshape(-1, normed.shape[-1]))
        rebuild.drop_tiles(q, scale, tiles)
    return FP8Rows(q, scale, out)


def normed_input(rebuild: Rebuild | None, norm: Callable[[Tensor], Tensor], x: Tensor, fp8: bool
                 ) -> Tensor | FP8Rows:
    """norm(x) for consumers that are FP8 linears (fp8: fp8_norm_output) or not (moe.recompute.norm_output)."""
    return fp8_norm_output(rebuild, norm, x) if fp8 else norm_output(rebuild, norm, x)


def quantised_once(x: Tensor | FP8Rows, consumer: nn.Module) -> Tensor | FP8Rows:
    """x for several linears like consumer: FP8Rows quantised here once when they are FP8 (so they share one set of
    e4m3 tiles instead of each saving its own), else x as it is."""
    if isinstance(x, FP8Rows) or not takes_rows(consumer):
        return x
    return FP8Rows(*quantize_activation(x.reshape(-1, x.shape[-1])), x)


def detached(x: Tensor | FP8Rows) -> Tensor | FP8Rows:
    """x detached from autograd, for a thunk that rebuilds from it; FP8Rows keep their tiles and a zero-stride
    stand-in for rows (the tiles are what the linears read: no float copy is held)."""
    if isinstance(x, Tensor):
        return x.detach()
    return FP8Rows(x.q.detach(), x.scale.detach(), x.rows.detach().new_zeros(()).expand(x.rows.shape))


def project_heads(out: nn.Linear, attn: Tensor, core_keeps: bool) -> Tensor:
    """out(attn) for the attention core's output attn [B, heads, S, D], as [B, S, heads x D] -> [B, S, H].
    core_keeps: the core keeps attn for its own backward (a fused SDPA kernel does; moe.cp's attention casts a copy):
    an FP8 out then keeps a view of it (no copy: the transpose is not materialised) instead of e4m3 tiles."""
    heads = attn.transpose(1, 2)
    if isinstance(out, FP8Linear) and core_keeps:
        return out(heads, fold=2, keep_input=True)
    return out(heads.reshape(*heads.shape[:2], -1))

