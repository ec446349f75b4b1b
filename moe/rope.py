"""Rotary position embeddings on interleaved pairs: dims (2i, 2i+1) rotate by the i-th frequency."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin tables [seq_len, head_dim/2] for rotary position embeddings."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (even, odd) of x [B, heads, S, D] by the position angles: cos and sin [S, D/2], or [B, S, D/2]
    where every row has positions of its own (moe.documents)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
