"""Where a rank's stage tensors sit in the single-process model: the keys checkpoints and initial values use.

A stage tensor stands for one or more single-process keys: its own name; its TP source's name when it
holds rows of a larger tensor (TPSpec; a fused qkv shard's rows come in several runs); one key per
routed expert it holds (`...experts.w_down.5`, global expert id). `Placement.boxes` maps any run of a
stage tensor's flattened elements to rectangles of those keys' full tensors, so checkpoints write and
read exactly a rank's pieces and materialisation draws exactly what the rank holds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterator

from torch import Tensor, nn

from moe.tp.layout import TPSpec, full_name

EXPERT_KEY = re.compile(r"^(.*\.experts\.[^.]+)\.(\d+)$")
Box = tuple[str, tuple[int, ...], Tensor]  # (key, offsets in the key's full tensor, view of the elements)


def expert_offset(stage: nn.Module, name: str, count: int) -> int:
    """Global id of the first expert in stage tensor name (a block of count experts): its EP rank times count."""
    layer = stage.get_submodule(name.split(".experts.")[0])
    return getattr(layer.dispatcher, "rank", 0) * count


def sharded_spec(tensor: Tensor) -> TPSpec | None:
    """The TPSpec of a tensor holding rows of a larger single-process tensor (None: it is whole)."""
    spec = getattr(tensor, "tp_spec", None)
    return spec if spec is not None and spec.indices is not None else None


def row_runs(indices: Tensor) -> tuple[tuple[int, int, int], ...]:
    """(local start, full start, length) of each run of consecutive positions in a TP shard's indices."""
    runs: list[list[int]] = []
    for local, full in enumerate(indices.tolist()):
        if runs and runs[-1][1] + runs[-1][2] == full:
            runs[-1][2] += 1
        else:
            runs.append([local, full, 1])
    return tuple(tuple(run) for run in runs)


def rectangles(shape: tuple[int, ...], start: int, stop: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of at most 2 * ndim - 1 rectangles covering elements [start, stop) of a row-major
    tensor of shape, in order: each one a contiguous run of the flattened tensor."""
    if not shape:
        if start < stop:
            yield (), ()
        return
    inner = math.prod(shape[1:])
    zeros = (0,) * (len(shape) - 1)
    if start % inner:
        row = start // inner
        end = min(stop, (row + 1) * inner)
        for offsets, sizes in rectangles(shape[1:], start - row * inner, end - row * inner):
            yield (row, *offsets), (1, *sizes)
        start = end
    if stop - start >= inner:
        yield (start // inner, *zeros), ((stop - start) // inner, *shape[1:])
        start += (stop - start) // inner * inner
    if start < stop:
        row = start // inner
        for offsets, sizes in rectangles(shape[1:], 0, stop - start):
            yield (row, *offsets), (1, *sizes)


@dataclass(frozen=True)
class Placement:
    """Where one stage tensor's elements sit among the single-process keys (see the module docstring)."""

    key: str                          # the single-process key (experts: the block's name; ids appended)
    shape: tuple[int, ...]            # the stage tensor's shape
    full_shape: tuple[int, ...]       # each key's full tensor
    first_expert: int | None = None   # a block of routed experts: global id of its first one
    dim: int = 0                      # TP rows: the dim they are taken along
    runs: tuple[tuple[int, int, int], ...] = ()  # TP rows: row_runs of this rank's indices

    def boxes(self, start: int, data: Tensor) -> Iterator[Box]:
        """Rectangles of the keys covering data, the 1-D run of this tensor's flattened elements that begins at
        start: (key, offsets in the key's full tensor, view of data shaped like the rectangle)."""
        for offsets, sizes in rectangles(self.shape, start, start + data.numel()):
            first = sum(o * s for o, s in zip(offsets, _strides(self.shape))) - start
            view = data[first:first + math.prod(sizes)].view(sizes)
            if self.first_expert is not None:
                for j in range(sizes[0]):
                    yield f"{self.key}.{self.first_expert + offsets[0] + j}", offsets[1:], view[j]
            elif self.runs:
                yield from self._tp_boxes(offsets, view)
            else:
                yield self.key, offsets, view

    def _tp_boxes(self, offsets: tuple[int, ...], view: Tensor) -> Iterator[Box]:
        """The rectangles of a TP shard's rectangle: its rows along dim split where the full positions jump."""
        lo, hi = offsets[self.dim], offsets[self.dim] + view.shape[self.dim]
        for local, full, length in self.runs:
            a, b = max(lo, local), min(hi, local + length)
            if a < b:
                moved = list(offsets)
                moved[self.dim] = full + a - local
                yield self.key, tuple(moved), view.narrow(self.dim, a - lo, b - a)


def _strides(shape: tuple[int, ...]) -> list[int]:
    """Row-major strides of shape, in elements."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def placement(stage: nn.Module, name: str, tensor: Tensor) -> Placement:
    """The Placement of stage tensor name (a param or buffer of stage)."""
    shape = tuple(tensor.shape)
    spec = sharded_spec(tensor)
    if spec is not None:
        full = list(shape)
        full[spec.dim] = spec.full_size
        rank = stage.tp.rank if getattr(stage, "tp", None) is not None else 0
        return Placement(full_name(name, spec), shape, tuple(full), dim=spec.dim, runs=row_runs(spec.indices[rank]))
    if ".experts." in name:
        return Placement(name, shape, shape[1:], first_expert=expert_offset(stage, name, shape[0]))
    return Placement(name, shape, shape)


def placements(stages: list[nn.Module]) -> dict[str, Placement]:
    """Stage-local name -> Placement of every param and buffer of the stages."""
    return {name: placement(stage, name, tensor) for stage in stages
            for name, tensor in stage.state_dict(keep_vars=True).items()}
