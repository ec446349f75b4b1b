"""launch.parallel.placement: any run of a stage tensor's flattened elements maps to rectangles of its single-process keys
that hold exactly those elements (whole tensors, TP rows in runs along dim 0 or 1, blocks of experts)."""

from __future__ import annotations

import math

import pytest
import torch

from launch.parallel.placement import Placement, rectangles, row_runs


def check_covered(full: dict[str, torch.Tensor], place: Placement, local: torch.Tensor) -> None:
    """Every run [a, b) of local's elements: its rectangles hold full's values there, b - a elements in all."""
    flat = local.flatten()
    for a in range(flat.numel() + 1):
        for b in range(a, flat.numel() + 1):
            count = 0
            for key, offsets, view in place.boxes(a, flat[a:b]):
                box = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
                assert torch.equal(full[key][box], view), (a, b, key, offsets)
                count += view.numel()
            assert count == b - a


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4), (4, 1, 5)])
def test_rectangles_cover_a_run_in_order(shape):
    numel = math.prod(shape)
    values = torch.arange(numel).view(shape)
    for a in range(numel + 1):
        for b in range(a, numel + 1):
            boxes = list(rectangles(shape, a, b))
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            got = [v for offsets, sizes in boxes
                   for v in values[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].flatten().tolist()]
            assert got == list(range(a, b))


def test_tp_rows_split_where_they_jump():
    full = torch.arange(8 * 5).view(8, 5)
    rows = torch.tensor([0, 1, 4, 5, 6])  # e.g. a fused qkv shard: q rows, then k/v rows further down
    assert row_runs(rows) == ((0, 0, 2), (2, 4, 3))
    check_covered({"w": full}, Placement("w", (5, 5), (8, 5), runs=row_runs(rows)), full.index_select(0, rows))
    wide = torch.arange(8 * 9).view(8, 9)
    cols = torch.tensor([2, 3, 7])  # a row-parallel shard: columns of the full weight
    check_covered({"w": wide}, Placement("w", (8, 3), (8, 9), dim=1, runs=row_runs(cols)), wide.index_select(1, cols))


def test_an_expert_block_splits_per_expert():
    experts = torch.arange(4 * 2 * 3).view(4, 2, 3)
    full = {f"e.{j}": experts[j] for j in range(4)}
    check_covered(full, Placement("e", (2, 2, 3), (2, 3), first_expert=2), experts[2:4])
