"""Models for the pipeline benchmark: the product's blocks (MLP, the real MoELayer, local or expert-parallel),
their partition into stages, the loss."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from dispatch import EPDispatcher
from moe.config import ModelConfig
from moe.layer import MoELayer
from pipeline.overlap import complete

MOE_EXPERTS, MOE_TOP_K = 8, 2


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
    """Pre-norm residual moe.layer.MoELayer (dropless, one shared expert), all experts on this rank until
    expert_parallel() hands it an EPDispatcher."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.moe = MoELayer(ModelConfig(hidden_size=hidden, num_heads=4, num_kv_heads=4, num_experts=MOE_EXPERTS,
                                        top_k=MOE_TOP_K, expert_ffn_size=hidden, num_shared_experts=1))

    def expert_parallel(self, group: dist.ProcessGroup) -> MoEBlock:
        """Keep this rank's experts; tokens reach the others through the product's EPDispatcher over group."""
        self.moe.to_expert_parallel(EPDispatcher(MOE_EXPERTS, group=group))
        return self

    def forward_steps(self, x: torch.Tensor):
        """Generator form of forward: pauses where the MoE layer's own forward_steps pauses (if it has one)."""
        normed = self.norm(x)
        steps = getattr(self.moe, "forward_steps", None)
        out = (yield from steps(normed)) if steps is not None else self.moe(normed)
        return x + out[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, h] -> [T, h]."""
        return complete(self.forward_steps(x))


def build_layers(model: str, layers: int, hidden: int, seed: int = 0) -> list[nn.Module]:
    """The benchmark model as a list of blocks, identical in every process."""
    torch.manual_seed(seed)
    block = {"mlp": MLPBlock, "moe": MoEBlock}[model]
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
