"""The flat layout: whole tensors per bucket, padding to the world size, even contiguous shards."""

from __future__ import annotations

import pytest
import torch

from optim.flat_layout import FlatLayout

SHAPES = [torch.Size([3, 5]), torch.Size([7]), torch.Size([40]), torch.Size([2, 2])]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_buckets_pad_to_world_and_shards_tile_the_buffer(world: int) -> None:
    layouts = [FlatLayout.build(SHAPES, world, r, bucket_cap=24) for r in range(world)]
    layout = layouts[0]
    assert [b.numel % world for b in layout.buckets] == [0] * len(layout.buckets)
    assert layout.offsets == (0, 15, layout.buckets[1].start, layout.buckets[2].start)
    assert layout.total == sum(b.numel for b in layout.buckets)
    assert layout.total - sum(s.numel() for s in SHAPES) < world * len(layout.buckets)
    tensors = [torch.randn(s) for s in SHAPES]
    flat = layout.flatten(tensors, torch.float64)
    shards = [lay.shard_of(flat) for lay in layouts]
    assert all(s.numel() == layout.shard_numel == layout.total // world for s in shards)
    rebuilt = torch.zeros_like(flat)
    for lay, shard in zip(layouts, shards):
        for b in lay.buckets:
            rebuilt[b.owned] = shard[b.shard]
    assert torch.equal(rebuilt, flat)
    for view, t in zip(layout.views(rebuilt), tensors):
        assert torch.equal(view, t)


def test_tensor_larger_than_cap_gets_its_own_bucket() -> None:
    layout = FlatLayout.build([torch.Size([100]), torch.Size([3])], 2, 0, bucket_cap=10)
    assert [(b.start, b.numel) for b in layout.buckets] == [(0, 100), (100, 4)]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_owned_runs_tile_every_tensor_once(world: int) -> None:
    seen = {i: [] for i in range(len(SHAPES))}
    for rank in range(world):
        layout = FlatLayout.build(SHAPES, world, rank, bucket_cap=24)
        runs = layout.owned_runs()
        assert [at for _, _, at, _ in runs] == sorted(at for _, _, at, _ in runs)
        assert sum(n for *_, n in runs) <= layout.shard_numel
        for index, start, at, length in runs:
            bucket = layout.buckets[layout.bucket_of[index]]
            assert bucket.owned.start + at - bucket.shard_start == layout.offsets[index] + start
            seen[index].append((start, length))
    for index, runs in seen.items():
        covered = [e for start, length in runs for e in range(start, start + length)]
        assert sorted(covered) == list(range(SHAPES[index].numel())), index
