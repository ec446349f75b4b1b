"""The FP8 ops on meta tensors (a rehearsal) give the outputs the kernels give on real tensors, shape for
shape and dtype for dtype, and nothing of the reference's fp32 intermediates."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from kernels.ops import run
from tests.kernels.helpers import offsets


class Allocations(TorchDispatchMode):
    """Bytes of every tensor the ops under it return."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.nbytes += t.nbytes
        return out


def _calls(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> dict[str, object]:
    """Every FP8 op on these operands (the grouped GEMMs on their quantised forms)."""
    xq, xs = kernels.quantize_activation(x)
    wq, ws = kernels.quantize_weight(w)
    wt, _ = kernels.quantize_weight(w, transposed=True)
    dq, ds = kernels.quantize_activation(dy)
    xt, xts = kernels.quantize_activation_kgrouped(x, offs)
    dt, dts = kernels.quantize_activation_kgrouped(dy, offs)
    return {"quantize_activation": (xq, xs), "quantize_weight": (wq, ws), "kgrouped": (xt, xts),
            "gemm": kernels.fp8_grouped_gemm(xq, xs, wq, ws, offs, out_dtype=torch.bfloat16),
            "quantize_weight_t": wt,
            "dgrad": kernels.fp8_grouped_gemm_dgrad(dq, ds, wt, ws, offs, out_dtype=torch.bfloat16),
            "wgrad": kernels.fp8_grouped_gemm_wgrad(dt, dts, xt, xts, offs)}


def _shapes(results: dict[str, object]) -> dict[str, list[tuple]]:
    flat = {k: v if isinstance(v, tuple) else (v,) for k, v in results.items()}
    return {k: [(tuple(t.shape), t.dtype) for t in v] for k, v in flat.items()}


def test_meta_outputs_match_the_reference_outputs():
    sizes = [70, 0, 200, 3]
    x, w = torch.randn(sum(sizes), 300), torch.randn(len(sizes), 260, 300)
    dy, offs = torch.randn(sum(sizes), 260), offsets(sizes)
    real = _shapes(_calls(x, w, dy, offs))
    meta = _shapes(_calls(*(t.to("meta") for t in (x, w, dy, offs))))
    assert meta == real
    assert real["wgrad"] == [((4, 260, 300), torch.float32)] and real["kgrouped"][0][1] == torch.float8_e4m3fn


def test_meta_ops_allocate_only_their_outputs():
    x, w = torch.empty(512, 1024, device="meta"), torch.empty(4, 2048, 1024, device="meta")
    with Allocations() as seen:
        run("quantize_weight", None, w)
    assert seen.nbytes == 4 * 2048 * 1024 + 4 * 16 * 8 * 4  # e4m3 weight + one fp32 scale per 128x128 block
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    with Allocations() as seen:  # the reference dequantises both operands to fp32 first (> 32 MiB)
        run("gemm", None, *run("quantize_activation", None, x), *run("quantize_weight", None, w), offs,
            torch.bfloat16)
    outputs = 512 * 1024 + 512 * 8 * 4 + 4 * 2048 * 1024 + 4 * 16 * 8 * 4 + 512 * 2048 * 2
    assert seen.nbytes == outputs
