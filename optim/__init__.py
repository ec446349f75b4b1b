"""Optimizers: ZeRO-1 distributed optimizer, global gradient clipping, LR schedules."""
