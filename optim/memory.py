"""Bytes an optimizer holds per rank: the fp32 params it updates plus its state tensors."""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from optim.zero1 import ZeRO1


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """This rank's optimizer bytes: (master) params it updates + state tensors, for any optimizer.

    ZeRO1 counts its fp32 master shards; ZeroRedundancyOptimizer counts its local optimizer
    (the params of its partition); a plain optimizer counts all of its params.
    """
    if isinstance(optimizer, ZeRO1):
        return optimizer.state_bytes()["total"]
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in params + state)


def held_optimizer_bytes(optimizer: ZeRO1) -> int:
    """Bytes ZeRO-1 holds beyond the model's params: its state tensors plus fp32 masters kept apart from
    the params (an fp32 param is its own master; its bytes are the model's)."""
    state = optimizer.state_bytes()
    return state["total"] - state["master"] + optimizer.buffer_bytes()["masters"]
