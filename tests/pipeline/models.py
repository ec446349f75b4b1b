"""Stage modules and single-process references for the pipeline equivalence tests."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


class MLPStage(nn.Module):
    """Linear/tanh stack over two boundary tensors; returns two outputs that are views of one tensor."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: Tensor, skip: Tensor) -> tuple[Tensor, Tensor]:
        y = self.down(torch.tanh(self.up(x))) + skip
        both = torch.cat([y, x], dim=-1)
        return both[..., : y.shape[-1]], both[..., y.shape[-1]:]


class MoEStage(nn.Module):
    """Residual MoE layer (dropless, no aux loss; experts in `precision`) followed by an MLP stage."""

    def __init__(self, hidden: int, precision: str = "native") -> None:
        super().__init__()
        from moe.config import ModelConfig
        from moe.layer import MoELayer
        cfg = ModelConfig(hidden_size=hidden, num_heads=2, num_kv_heads=1, num_experts=4, top_k=2,
                          expert_ffn_size=16, num_shared_experts=1, expert_precision=precision)
        self.norm = nn.LayerNorm(hidden)
        self.moe = MoELayer(cfg)
        self.mlp = MLPStage(hidden)

    def forward(self, x: Tensor, skip: Tensor) -> tuple[Tensor, Tensor]:
        out, _ = self.moe(self.norm(x))
        return self.mlp(x + out, skip)


def make_stages(kind: str, num_stages: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> list[nn.Module]:
    """num_stages freshly initialised stages of kind mlp, moe or moe-fp8 (same seed -> same weights
    in every process)."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return [MLPStage(hidden).to(dtype) for _ in range(num_stages)]
    precision = "fp8" if kind == "moe-fp8" else "native"
    return [MoEStage(hidden, precision).to(dtype) for _ in range(num_stages)]


def criterion(out: Tensor, skip: Tensor, label: Tensor) -> Tensor:
    """Per-chunk loss over both boundary tensors."""
    return ((out - label) ** 2).mean() + 0.1 * skip.mean()


def make_data(batch: int, hidden: int, dtype: torch.dtype, seed: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """(x, skip, label) for the whole batch."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, hidden, generator=g).to(dtype) for _ in range(3))


def reference(stages: list[nn.Module], data: tuple[Tensor, Tensor, Tensor], num_chunks: int):
    """Single-process run over the same chunks: per-chunk losses, grads per stage, outputs.

    Runs on one thread like the pipeline's ranks, so reductions split the work the same way.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(copy.deepcopy(stages), data, num_chunks)
    finally:
        torch.set_num_threads(threads)


def _reference(stages: list[nn.Module], data: tuple[Tensor, Tensor, Tensor], num_chunks: int):
    losses, outs = [], []
    for x, skip, label in zip(*(t.chunk(num_chunks) for t in data)):
        h = (x, skip)
        for st in stages:
            h = st(*h)
        loss = criterion(*h, label)
        loss.backward()
        losses.append(loss.detach())
        outs.append(tuple(t.detach() for t in h))
    grads = [[p.grad.clone() for p in st.parameters()] for st in stages]
    outputs = tuple(torch.cat(p) for p in zip(*outs))
    return torch.stack(losses), grads, outputs


def calc_diff(x: Tensor, y: Tensor) -> float:
    """1 - 2*sum(x*y)/sum(x*x+y*y) in float64 (DeepSeek's similarity measure)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return 0.0 if denom == 0 else float(1 - 2 * (x * y).sum() / denom)
