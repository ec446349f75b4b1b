"""Optimizers: ZeRO-1/2/3 distributed optimizer (optionally offloaded to the host), global gradient clipping, LR
schedules."""

from optim.lr_schedule import warmup_cosine
from optim.memory import optimizer_state_bytes
from optim.zero1 import ZeRO1

__all__ = ["ZeRO1", "optimizer_state_bytes", "warmup_cosine"]
