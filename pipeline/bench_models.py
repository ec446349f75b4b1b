"""Models for the pipeline benchmark: blocks, their partition into stages, the loss."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from pipeline.overlap import complete


class MLPBlock(nn.Module):
    """Linear(h, 4h) -> GELU -> Linear(4h, h)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., h] -> [..., h]."""
        return self.down(nn.functional.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Pre-norm residual MoE layer (dropless); imported lazily so pipeline stays MoE-agnostic."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        from moe.config import ModelConfig
        from moe.layer import MoELayer
        self.norm = nn.LayerNorm(hidden)
        self.moe = MoELayer(ModelConfig(hidden_size=hidden, num_heads=4, num_kv_heads=4, num_experts=8,
                                        top_k=2, expert_ffn_size=hidden, num_shared_experts=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, h] -> [T, h]."""
        return x + self.moe(self.norm(x))[0]


class AllToAllBlock(MLPBlock):
    """MLP block whose hidden activations cross the EP group by an async all_to_all (the stand-in
    for expert dispatch); forward_steps yields while the exchange is in flight."""

    def __init__(self, hidden: int, group: dist.ProcessGroup | None = None, log: list[str] | None = None) -> None:
        super().__init__(hidden)
        self.group = group
        self.log = log

    def _note(self, event: str) -> None:
        if self.log is not None:
            self.log.append(event)

    def forward_steps(self, x: torch.Tensor):
        """Generator form of forward (see pipeline.overlap)."""
        h = self.up(x)
        send = h.detach().contiguous()
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        self._note("comm started")
        yield work
        work.wait()
        self._note("comm done")
        h = h + (recv - send)  # value: the exchanged rows; gradient: identity
        return self.down(nn.functional.gelu(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same result as forward_steps, without pausing."""
        return complete(self.forward_steps(x))


def build_layers(model: str, layers: int, hidden: int, seed: int = 0) -> list[nn.Module]:
    """The benchmark model as a list of blocks, identical in every process."""
    torch.manual_seed(seed)
    block = {"mlp": MLPBlock, "moe": MoEBlock, "a2a": AllToAllBlock}[model]
    return [block(hidden) for _ in range(layers)]


def partition(layers: list[nn.Module], num_stages: int, cls: type = nn.Sequential) -> list[nn.Sequential]:
    """Contiguous, equal groups of fresh copies of the layers."""
    if len(layers) % num_stages:
        raise ValueError(f"--layers {len(layers)} must be divisible by the {num_stages} stages of a schedule")
    per = len(layers) // num_stages
    return [cls(*copy.deepcopy(layers[i * per:(i + 1) * per])) for i in range(num_stages)]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Loss of one micro-batch."""
    return nn.functional.mse_loss(out, target)
