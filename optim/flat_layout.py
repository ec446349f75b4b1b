"""Flat, bucketed, padded layout of a list of tensors sharded evenly over the ranks of a group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Bucket:
    """A run of whole tensors in the flat buffer, padded to a multiple of the world size."""

    start: int
    numel: int
    shard_start: int
    world_size: int
    rank: int

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns in this bucket."""
        return self.numel // self.world_size

    @property
    def full(self) -> slice:
        """This bucket's range in the flat buffer."""
        return slice(self.start, self.start + self.numel)

    @property
    def shard(self) -> slice:
        """This rank's piece of the bucket, as a range of the local shard."""
        return slice(self.shard_start, self.shard_start + self.shard_numel)

    @property
    def owned(self) -> slice:
        """This rank's piece of the bucket, as a range of the flat buffer."""
        return self.piece(self.rank)

    def piece(self, rank: int) -> slice:
        """The piece of the bucket that rank owns, as a range of the flat buffer."""
        begin = self.start + rank * self.shard_numel
        return slice(begin, begin + self.shard_numel)

    def local_piece(self, rank: int) -> slice:
        """The piece of the bucket that rank owns, as a range of the bucket's own buffer."""
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor lives in the flat buffer and which contiguous pieces this rank owns.

    Tensors are packed in order into buckets of at most bucket_cap elements (a larger tensor
    gets a bucket of its own); each bucket is padded with zeros to a multiple of world_size,
    and rank r owns the r-th equal slice of every bucket. The local shard is those slices
    concatenated, so one reduce-scatter / all-gather per bucket moves everything.
    """

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    bucket_of: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    total: int
    shard_numel: int

    @classmethod
    def build(cls, shapes: Sequence[torch.Size], world_size: int, rank: int,
              bucket_cap: int) -> "FlatLayout":
        """Pack tensors of the given shapes for a group of world_size ranks, seen from rank."""
        if bucket_cap < 1:
            raise ValueError(f"bucket_cap must be >= 1 element, got {bucket_cap}")
        sizes = [torch.Size(s).numel() for s in shapes]
        offsets: list[int] = []
        bucket_of: list[int] = []
        buckets: list[Bucket] = []
        start = shard_start = 0
        i = 0
        while i < len(sizes):
            used = 0
            while i < len(sizes) and (used == 0 or used + sizes[i] <= bucket_cap):
                offsets.append(start + used)
                bucket_of.append(len(buckets))
                used += sizes[i]
                i += 1
            padded = -(-max(used, 1) // world_size) * world_size
            buckets.append(Bucket(start, padded, shard_start, world_size, rank))
            start += padded
            shard_start += padded // world_size
        return cls(tuple(torch.Size(s) for s in shapes), tuple(offsets), tuple(bucket_of),
                   tuple(buckets), start, shard_start)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of flat shaped like each tensor (no copy)."""
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def bucket_views(self, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views shaped like each tensor of per-bucket buffers (buffers[b] holds bucket b's numel elements)."""
        views = []
        for offset, shape, b in zip(self.offsets, self.shapes, self.bucket_of):
            at = offset - self.buckets[b].start
            views.append(buffers[b][at:at + shape.numel()].view(shape))
        return views

    def flatten(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A new zero-padded flat buffer holding the given tensors."""
        flat = torch.zeros(self.total, dtype=dtype, device=tensors[0].device)
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)
        return flat

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's pieces of a full flat buffer, concatenated (a new tensor)."""
        return torch.cat([flat[b.owned] for b in self.buckets])

    def owned_runs(self) -> list[tuple[int, int, int, int]]:
        """(tensor index, first element in the flattened tensor, position in the local shard, length) of
        every run of a tensor's elements this rank owns, in shard order (padding belongs to no tensor)."""
        runs = []
        for i, (offset, shape, b) in enumerate(zip(self.offsets, self.shapes, self.bucket_of)):
            bucket = self.buckets[b]
            owned = bucket.owned
            lo, hi = max(offset, owned.start), min(offset + shape.numel(), owned.stop)
            if lo < hi:
                runs.append((i, lo - offset, bucket.shard_start + lo - owned.start, hi - lo))
        return runs
