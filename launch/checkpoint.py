"""Atomic checkpoints: written to a temporary file in the same folder, then renamed into place."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write state to path atomically (a crash leaves the previous checkpoint intact)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by save_checkpoint."""
    return torch.load(Path(path), map_location="cpu", weights_only=False)


def consolidate(folder: str | Path) -> dict[str, torch.Tensor]:
    """The single-process MoETransformer state dict assembled from a trainer checkpoint's rank files
    (stages placed by name, expert blocks put back in place; replicas are identical, the first wins)."""
    folder = Path(folder)
    marker = load_checkpoint(folder / "complete.pt")
    full: dict[str, torch.Tensor] = {}
    for rank in range(marker["world_size"]):
        state = load_checkpoint(folder / f"rank{rank:05d}.pt")
        ep_rank, ep_size = state["expert_block"]
        for stage in state["stages"]:
            for name, value in stage.items():
                if ".experts." not in name:
                    full.setdefault(name, value)
                    continue
                count = value.shape[0]
                whole = full.setdefault(name, value.new_zeros((count * ep_size, *value.shape[1:])))
                whole[ep_rank * count:(ep_rank + 1) * count] = value
    return full
