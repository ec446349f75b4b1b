"""Fixtures of the optimizer tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def one_rank():
    """A 1-rank fake process group for in-process ZeroOptimizer tests (no collective moves anything)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
