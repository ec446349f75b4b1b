"""torch.distributed.checkpoint (DCP) glue for tensors of which each rank holds some rectangles.

`Chunks` is a state-dict value standing for one global tensor (its full size and dtype) of which this
rank holds rectangles (offsets, a tensor each). DCP writes each rectangle as one chunk of the key
(ChunkStorageMetadata) without any collective, and on load intersects the rectangles a rank asks for with
the saved ones, so a rank reads only what it needs, from a checkpoint written in any layout.
`SavePlanner` / `LoadPlanner` resolve Chunks, `Writer` hands the files it wrote to a callback, `Reader`
reads .metadata once, `HostStager` copies a state dict to reused (pinned) host buffers for an asynchronous
save, and `files_read` names the files a load will read.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager


class Chunks:
    """Rectangles of one global tensor held by this rank: offsets -> tensor (None while only planning)."""

    def __init__(self, size: tuple[int, ...], dtype: torch.dtype) -> None:
        self.global_size = torch.Size(size)
        self.dtype = dtype
        self.parts: dict[tuple[int, ...], tuple[torch.Size, Tensor | None]] = {}

    def add(self, offsets: tuple[int, ...], sizes: tuple[int, ...], tensor: Tensor | None = None) -> None:
        """Hold the rectangle at offsets (disjoint from the others held here)."""
        if offsets in self.parts:
            raise ValueError(f"two rectangles at {offsets}: a rank's pieces of one tensor must be disjoint")
        self.parts[tuple(offsets)] = (torch.Size(sizes), tensor)

    @property
    def nbytes(self) -> int:
        """Bytes of the rectangles held here (what a save of them writes)."""
        return sum(sizes.numel() for sizes, _ in self.parts.values()) * self.dtype.itemsize

    def size(self) -> torch.Size:
        """The global tensor's size (DCP compares it with the checkpoint's)."""
        return self.global_size

    def find(self, offsets: torch.Size) -> Tensor:
        """The tensor of the rectangle at offsets."""
        tensor = self.parts[tuple(offsets)][1]
        if tensor is None:
            raise ValueError(f"the rectangle at {tuple(offsets)} has no tensor bound (planning only)")
        return tensor

    def __create_write_items__(self, fqn: str, _obj: Any) -> list[WriteItem]:
        """DCP's write items: one chunk per rectangle held here."""
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), sizes),
                                                      properties=properties, size=self.global_size))
                for offsets, (sizes, _) in self.parts.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """DCP's chunks to read: the rectangles held here."""
        return [ChunkStorageMetadata(torch.Size(offsets), sizes) for offsets, (sizes, _) in self.parts.items()]


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, resolving Chunks rectangles by offset."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        """The tensor (or object) DCP writes for index."""
        value = self.state_dict.get(index.fqn)
        return value.find(index.offset) if isinstance(value, Chunks) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for a flat state dict holding Chunks (left as they are, not re-initialised)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """Take the flat state dict as it is (DCP's default would replace values it does not know by None)."""
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        """The tensor DCP reads index into."""
        value = self.state_dict[index.fqn]
        return value.find(index.offset) if isinstance(value, Chunks) else super().lookup_tensor(index)


class Writer(FileSystemWriter):
    """DCP's file writer (one file per rank) that hands the names of the files this rank wrote to written()
    once they are on disk (on DCP's thread for an asynchronous save) and keeps what it returns as result."""

    def __init__(self, path: str, written: Callable[[list[str]], Any]) -> None:
        super().__init__(path, thread_count=1)
        self.written = written
        self.result: Any = None

    def write_data(self, plan, planner):
        """Write this rank's items (DCP's FileSystemWriter), then hand the files to written()."""
        future = super().write_data(plan, planner)
        self.result = self.written(sorted({r.storage_data.relative_path for r in future.wait()}))
        return future


class Reader(FileSystemReader):
    """DCP's file reader, reading the checkpoint's .metadata once."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, read on the first call."""
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class HostStager(AsyncStager):
    """dcp.async_save's stager: copies every tensor of a state dict into host buffers kept from one
    save to the next (pinned when the tensor is on a GPU), on the calling thread; that copy is all the
    training thread waits for, DCP plans and writes on its own thread.

    The buffers are reused, so the save reading them must be done before they are staged again: its caller hands
    the save's future to `saving`, and stage() refuses (RuntimeError) while that future is not done."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...]], Tensor] = {}
        self.saving: Future | None = None  # the asynchronous save reading the buffers, once started

    def _host(self, key: tuple[str, tuple[int, ...]], tensor: Tensor) -> Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        return buffer.copy_(tensor, non_blocking=tensor.is_cuda)

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of state_dict whose tensors (and Chunks rectangles) live in this stager's host buffers."""
        if self.saving is not None and not self.saving.done():
            raise RuntimeError("the previous asynchronous checkpoint save still reads the host staging buffers: "
                               "wait for it (Checkpointer.finish) before staging the next")
        staged: dict[str, Any] = {}
        for fqn, value in state_dict.items():
            if isinstance(value, Chunks):
                staged[fqn] = Chunks(value.global_size, value.dtype)
                for offsets, (sizes, tensor) in value.parts.items():
                    staged[fqn].add(offsets, sizes, self._host((fqn, offsets), tensor))
            elif isinstance(value, Tensor):
                staged[fqn] = self._host((fqn, ()), value)
            else:
                staged[fqn] = value
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return staged


def files_read(state_dict: dict[str, Any], metadata: Metadata) -> list[str]:
    """The checkpoint files (relative paths) that loading state_dict (Chunks and tensors) reads."""
    plan = create_default_local_load_plan(state_dict, metadata, strict=True)
    return sorted({metadata.storage_data[item.storage_index].relative_path for item in plan.items})
