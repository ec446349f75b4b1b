"""Stage modules and single-process references for the pipeline equivalence tests."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeline.overlap import complete


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


class ContextStage(MLPStage):
    """An MLP stage that also takes a per-row context [B, 1] (not sent between stages) and scales its input by it."""

    def forward(self, x: Tensor, skip: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:  # noqa: D102
        return super().forward(x * scale, skip)


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


class AllToAllBlock(nn.Module):
    """Linear(h, 4h) -> GELU -> Linear(4h, h) whose hidden activations cross the group by an async
    all_to_all (a stand-in for expert dispatch); forward_steps yields while the exchange is in flight."""

    def __init__(self, hidden: int, group: dist.ProcessGroup | None = None, log: list[str] | None = None) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.group = group
        self.log = log if log is not None else []

    def forward_steps(self, x: Tensor):
        """Generator form of forward (see pipeline.overlap)."""
        h = self.up(x)
        send = h.detach().contiguous()
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        self.log.append("comm started")
        yield work
        work.wait()
        self.log.append("comm done")
        h = h + (recv - send)  # value: the exchanged rows; gradient: identity
        return self.down(nn.functional.gelu(h))

    def forward(self, x: Tensor) -> Tensor:
        """Same result as forward_steps, without pausing."""
        return complete(self.forward_steps(x))


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
