"""Files written whole or not at all, and their checksums: the helpers every writer in launch/ shares
(token shards, tokenizers, checkpoint manifests)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import zlib
from pathlib import Path
from typing import Callable


def crc32(path: Path) -> int:
    """CRC-32 of a file, read in 16 MiB blocks."""
    value = 0
    with path.open("rb") as handle:
        while block := handle.read(1 << 24):
            value = zlib.crc32(block, value)
    return value


def write_atomically(path: Path, write: Callable[[object], None]) -> None:
    """write(f) into a temporary file beside path, then rename it over path (never half-written)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_synced(path: Path, text: str) -> None:
    """Write text and fsync it."""
    with path.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def sync_dir(folder: Path) -> None:
    """fsync a folder so a rename inside it is durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(path: str | Path, what: str, make_folder: bool = False) -> None:
    """ValueError naming what (e.g. "--metrics-out") and path unless a file can be written there: path is no folder,
    its folder exists (with make_folder: is made), and a file can be created in it (tried, then removed) and path,
    if it exists, is writable."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; give a file path")
    if not path.parent.is_dir() and not make_folder:
        raise ValueError(f"{what} {path}: the folder {path.parent} does not exist")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        else:
            fd, probe = tempfile.mkstemp(dir=path.parent, prefix=".write-probe.")
            os.close(fd)
            os.unlink(probe)
    except OSError as error:
        raise ValueError(f"{what} {path}: cannot write there ({error.strerror or error})") from None
