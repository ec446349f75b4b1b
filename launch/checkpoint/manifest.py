"""Integrity of published checkpoint folders: per-file CRC-32 tables, manifest.json, atomic publication, checks.

A save goes to ROOT/.stepNNNNNNNN.tmp; `publish` (rank 0, with every rank's table of the files it wrote)
writes manifest.json last (the step, the file table, the id of the run that wrote it and its config), renames the
folder to ROOT/stepNNNNNNNN and keeps the newest `keep` folders of that run id (another run's are never deleted).
`verify` checks a folder's manifest and the files asked for (a rank: only those it reads; without crc, their
sizes only).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from launch.files import crc32, sync_dir, write_synced

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step(\d{8})$")


def step_folder(root: Path, step: int) -> Path:
    """Published folder of step's checkpoint."""
    return Path(root) / f"step{step:08d}"


def file_table(folder: Path, names: list[str]) -> dict[str, list[int]]:
    """{file name: [bytes, crc32]} of files in folder."""
    return {n: [(folder / n).stat().st_size, crc32(folder / n)] for n in names}


def publish(tmp: Path, root: Path, step: int, files: dict[str, list[int]], keep: int, run_id: str | None = None,
            config: dict | None = None) -> None:
    """Rank 0's part of a save: manifest.json (files plus .metadata's entry, the run id and config that wrote it)
    written last, the folder renamed into place, then the checkpoints of run_id beyond its newest keep dropped
    (another run's, or one from before run ids, are never deleted)."""
    files = files | file_table(tmp, [".metadata"])
    manifest = {"step": step, "files": files, "run_id": run_id, **({"config": config} if config is not None else {})}
    write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1))
    final = step_folder(root, step)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    sync_dir(root)
    for _, old in [(s, f) for s, f in published(root) if read_manifest(f).get("run_id") == run_id][keep:]:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(folder: Path) -> dict:
    """folder's manifest.json as written by publish ({} where it is missing or unreadable)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def verify(folder: Path, files: list[str] | None = None, crc: bool = True) -> str | None:
    """Why a published checkpoint folder cannot be used (missing manifest, one whose step is not the folder's name;
    missing, unlisted, truncated or (with crc) corrupted file), or None when the given files (default: every file
    of the manifest) match their entries."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing (the save did not finish)"
    try:
        content = json.loads(manifest.read_text())
        table, step = content["files"], content["step"]
    except (ValueError, KeyError, TypeError) as error:
        return f"{manifest} is unreadable ({error})"
    named = STEP_DIR.match(folder.name)
    if named and int(named.group(1)) != step:
        return (f"{manifest} says step {step}, the folder's name step {int(named.group(1))} (renamed?): rename it "
                f"to {step_folder(folder.parent, step).name} to use it")
    for name in table if files is None else files:
        path = folder / name
        if name not in table:
            return f"{path} is not in {manifest}"
        size, expected = table[name]
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)"
        if crc and crc32(path) != expected:
            return f"{path} fails its CRC-32 check (corrupted)"
    return None


def published(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every published checkpoint under root, newest first (unverified)."""
    root = Path(root)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))] if root.is_dir() else []
    return sorted(found, reverse=True)


def latest_valid(root: Path) -> Path | None:
    """The newest published checkpoint that passes verify(); each refused one is reported on stderr with its reason."""
    for _, folder in published(root):
        reason = verify(folder)
        if reason is None:
            return folder
        print(f"checkpoint {folder} refused: {reason}; trying the previous one", file=sys.stderr, flush=True)
    return None
