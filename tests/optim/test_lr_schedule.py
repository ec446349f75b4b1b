"""warmup_cosine: linear warmup to 1, cosine decay to min_ratio, flat after total."""

from __future__ import annotations

import math

import pytest

from optim import warmup_cosine


def test_warmup_then_cosine_to_min_ratio() -> None:
    assert warmup_cosine(0, 4, 20, 0.1) == pytest.approx(0.25)
    assert warmup_cosine(3, 4, 20, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(4, 4, 20, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(12, 4, 20, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert warmup_cosine(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(50, 4, 20, 0.1) == pytest.approx(0.1)
    values = [warmup_cosine(s, 4, 20, 0.1) for s in range(4, 21)]
    assert values == sorted(values, reverse=True)
