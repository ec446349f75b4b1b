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
