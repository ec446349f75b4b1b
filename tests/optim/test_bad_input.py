"""ZeroOptimizer refuses bad input with clear errors before touching torch.distributed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optim import ZeroOptimizer


def test_param_in_two_groups() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(ValueError, match="in param group 0 and again in group 1"):
        ZeroOptimizer([{"params": a.parameters()}, {"params": [b.weight, a.bias]}])


def test_empty_group() -> None:
    with pytest.raises(ValueError, match="param group 1 is empty"):
        ZeroOptimizer([{"params": nn.Linear(2, 2).parameters()}, {"params": []}])


def test_empty_params() -> None:
    with pytest.raises(ValueError, match="params is empty"):
        ZeroOptimizer([])


def test_frozen_param() -> None:
    layer = nn.Linear(2, 2)
    layer.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad=True"):
        ZeroOptimizer(layer.parameters())


def test_mixed_dtypes_in_a_group() -> None:
    with pytest.raises(ValueError, match="mixes dtypes"):
        ZeroOptimizer([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])


def test_optimizer_class_and_bucket_cap() -> None:
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match="optimizer_class"):
        ZeroOptimizer(params, optimizer_class=dict)
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        ZeroOptimizer(params, bucket_cap_mb=0)


def test_needs_initialised_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        ZeroOptimizer(nn.Linear(2, 2).parameters())


def test_unknown_collectives() -> None:
    with pytest.raises(ValueError, match="collectives must be one of"):
        ZeroOptimizer(nn.Linear(2, 2).parameters(), collectives="ring")
