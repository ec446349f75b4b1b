"""Optimizers: ZeRO-1/2/3 distributed optimizer (optionally offloaded to the host), global gradient clipping, LR
schedules."""

from optim.lr_schedule import warmup_cosine
from optim.memory import optimizer_state_bytes
from optim.zero import ZeroOptimizer

__all__ = ["ZeroOptimizer", "optimizer_state_bytes", "warmup_cosine"]
