"""Who owns a run directory: one run at a time, held by a lock; a run id that survives resumes and restarts.

RUN_DIR/run.lock names the process holding the directory (host, pid, when it took the lock, its start time); it is made
whole before it appears (a hard link of a written file, so no reader sees it half-written) and removed when
that process leaves. A lock left by a process that died on this host (its pid gone, or reused by a process
that started later) is recognised, named and taken over; a lock of another host is never broken here (this
host cannot see whether that process lives): the message says which file to remove once that run is gone.

RUN_DIR/run.json holds the run id. A plain run into a directory that holds another run's checkpoints or metrics
is refused: `--resume` continues that run (its id kept), `--start-over` moves its files into
RUN_DIR/previous/RUN_ID (never deleting them) and begins a new id. RUN_DIR/data (the prepared corpus, which
depends only on the data settings) stays where it is. Checkpoints record the id that wrote them, and retention
(launch.checkpoint.manifest.publish) deletes only that id's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from launch.checkpoint.manifest import published, read_manifest, verify
from launch.config.run import RunConfig, current_names
from launch.files import write_atomically
from launch.parallel.spawn import proc_stat

LOCK = "run.lock"
IDENTITY = "run.json"
ASIDE = "previous"
KEPT = (LOCK, ASIDE, "data")  # a start-over leaves these in place (data: the prepared corpus, reusable)
METRICS = "metrics.jsonl"


@dataclass(frozen=True)
class Holder:
    """The process a run.lock names."""

    host: str
    pid: int
    started: float  # time.time() when it took the lock
    proc_start: str  # its start time in the kernel's clock ticks (/proc/PID/stat), "" where unknown

    def describe(self) -> str:
        """'pid N on host H (holding it since DATE)'."""
        return (f"pid {self.pid} on host {self.host} (holding it since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))})")

    def alive(self) -> bool:
        """Whether the process still runs (this host only: the pid exists and started when the lock says)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process of that pid: it lives
            pass
        return not self.proc_start or _proc_start(self.pid) in (self.proc_start, "")


def _proc_start(pid: int) -> str:
    """Process pid's start time in clock ticks since boot (Linux), "" where unknown."""
    try:
        return proc_stat(pid)[19]
    except (OSError, IndexError):
        return ""


def _read_holder(path: Path) -> Holder | None:
    try:
        return Holder(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"{path} is unreadable ({error}): if no run uses this directory, remove it") from None


def _take(path: Path, me: Holder) -> Holder | None:
    """Create the lock file naming me (None), or return the holder of the existing one."""
    fd, tmp = None, path.with_name(f".{LOCK}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.write(fd, json.dumps(asdict(me)).encode())
        os.fsync(fd)
        try:
            os.link(tmp, path)  # atomic: the lock appears whole, or not at all if it exists
            return None
        except FileExistsError:
            return _read_holder(path) or _take(path, me)  # gone in between: try again
    finally:
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def acquire(run_dir: Path) -> Holder:
    """Lock run_dir for this process; ValueError naming the holder when a live process (or another host) holds it.
    A dead holder on this host is named on stderr and replaced."""
    path = run_dir / LOCK
    me = Holder(socket.gethostname(), os.getpid(), time.time(), _proc_start(os.getpid()))
    while (holder := _take(path, me)) is not None:
        if holder.host != me.host:
            raise ValueError(f"train.run_dir = {str(run_dir)!r} is held by the run of {holder.describe()} (lock "
                             f"{path}); a lock of another host is never broken automatically: if that run has "
                             f"ended, remove {path}")
        if holder.alive():
            raise ValueError(f"train.run_dir = {str(run_dir)!r} is in use by the run of {holder.describe()} (lock "
                             f"{path}): wait for it to end, or give another --run-dir")
        print(f"moe-train: {path} names {holder.describe()}, which is no longer running: a stale lock of a run "
              f"that died; taking it over", file=sys.stderr, flush=True)
        stale = path.with_name(f".{LOCK}.stale.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):  # another process took it over first: its lock then wins
            os.rename(path, stale)
            stale.unlink()
    return me


def release(run_dir: Path, me: Holder) -> None:
    """Remove run_dir's lock if it is still me's."""
    path = run_dir / LOCK
    with contextlib.suppress(OSError, ValueError):
        if _read_holder(path) == me:
            path.unlink()


def run_identity(run_dir: str | Path) -> str:
    """The id of the run run_dir holds (RUN_DIR/run.json), made and recorded when there is none."""
    path = Path(run_dir) / IDENTITY
    try:
        return str(json.loads(path.read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return _new_identity(Path(run_dir))


def _new_identity(run_dir: Path) -> str:
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(run_dir / IDENTITY, lambda f: f.write(json.dumps({"run_id": run_id}).encode()))
    return run_id


def run_files(run_dir: Path, metrics_out: str | Path | None) -> list[str]:
    """What of a previous run run_dir holds: its published checkpoints and its non-empty metrics file."""
    found = [f"{len(steps)} checkpoint(s) (steps {', '.join(str(s) for s, _ in steps[:3])}"
             f"{', ...' if len(steps) > 3 else ''}) in {run_dir / 'checkpoint'}"
             for steps in [published(run_dir / "checkpoint")] if steps]
    metrics = Path(metrics_out) if metrics_out else run_dir / METRICS
    if metrics.is_file() and metrics.stat().st_size:
        found.append(f"metrics in {metrics}")
    return found


def _move_aside(run_dir: Path, metrics_out: str | Path | None) -> Path:
    """Move the previous run's files (all but KEPT, plus an explicit metrics file) into RUN_DIR/previous/RUN_ID."""
    old = run_identity(run_dir) if (run_dir / IDENTITY).is_file() else "unnamed"
    aside = run_dir / ASIDE / old
    while aside.exists():
        aside = aside.with_name(f"{aside.name}+")
    aside.mkdir(parents=True)
    for entry in run_dir.iterdir():
        if entry.name not in KEPT:
            os.replace(entry, aside / entry.name)
    if metrics_out and Path(metrics_out).is_file():
        shutil.move(metrics_out, aside / Path(metrics_out).name)
    return aside


@contextlib.contextmanager
def own_run_dir(run_dir: str | Path, resume: bool, start_over: bool = False,
                metrics_out: str | Path | None = None) -> Iterator[str]:
    """Hold run_dir for the duration (yields the run id): refused (ValueError naming the lock's holder, or the
    previous run's files and the flags that accept them) unless the directory is free and, without resume, empty
    of another run's checkpoints and metrics; start_over moves those aside first. The lock goes on any exit."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    me = acquire(run_dir)
    try:
        found = run_files(run_dir, metrics_out)
        if resume:
            run_id = run_identity(run_dir)
        else:
            if found and not start_over:
                raise ValueError(f"train.run_dir = {str(run_dir)!r} holds another run's files ({'; '.join(found)}): "
                                 f"continue that run with --resume, move it aside with --start-over (into "
                                 f"{run_dir / ASIDE}), or give another --run-dir")
            if found:
                aside = _move_aside(run_dir, metrics_out)
                print(f"moe-train: --start-over moved the previous run's files to {aside}", file=sys.stderr,
                      flush=True)
            run_id = _new_identity(run_dir)
        yield run_id
    finally:
        release(run_dir, me)


def rewind_metrics(path: Path, step: int) -> None:
    """Keep only path's records of steps before step (a resume from step's checkpoint writes the rest again), and a
    line a crash cut short is dropped; the file is replaced atomically (the old one stays whole until the new one
    is). Says on stderr what it dropped."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    with path.open("rb") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if line.endswith(b"\n") and isinstance(record, dict) and isinstance(record.get("step"), int) \
                    and record["step"] < step:
                kept.append(line)
            else:
                dropped += 1
    if dropped:
        write_atomically(path, lambda f: f.writelines(kept))
        print(f"moe-train: {path} rewound to step {step} (the checkpoint resumed): {dropped} later or partial "
              f"record(s) dropped, {len(kept)} kept", file=sys.stderr, flush=True)


MAY_CHANGE = {"model": ("capacity_factor", "drop_policy", "aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff",
                        "bias_update_rate", "expert_precision", "mtp_loss_coeff", "init_std", "init_from")}
"""[model] keys a resume may change (they steer training, not the weights' shapes or meaning): warned about."""
DATA_KEYS = {"data": ("corpus", "max_bytes", "eval_fraction", "tokenizer", "sources", "eval_sources"),
             "train": ("seq_len", "seed")}
"""Keys that make the token stream and its order: a resume that changes one needs allow_data_change."""
OPTIMIZER_KEYS = {"train": ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip",
                            "dtype"), "optim": ()}  # (): every key of the section
"""Optimizer settings a resume may change: warned about, naming the keys."""


def _differences(saved: dict, now: dict, sections: dict[str, tuple[str, ...]], but: dict | None = None) -> list[str]:
    """'section.key = SAVED in the checkpoint, NOW here' for each key of sections (() = the whole section; but:
    keys left out) whose values differ."""
    found = []
    for section, keys in sections.items():
        before = current_names(section, saved.get(section, {}))
        after = now.get(section, {})
        for key in keys or sorted(set(before) | set(after)):
            if key in (but or {}).get(section, ()) or key not in before:
                continue
            if before[key] != after.get(key):
                found.append(f"{section}.{key} = {before[key]!r} in the checkpoint, {after.get(key)!r} here")
    return found


def check_resume(cfg: RunConfig, required: bool, allow_data_change: bool) -> None:
    """Before any rank starts, what a resume of cfg's run will meet: ValueError (naming each candidate checkpoint
    and why it was refused) when none is valid and required; naming the keys when the newest valid one was saved
    from another model, or other data without allow_data_change, or at or past train.steps. Changed optimizer
    settings are warned about on stderr. Checks sizes only: each rank checks the CRCs of what it reads."""
    root = Path(cfg.train.run_dir) / "checkpoint"
    refused = []
    for _, folder in published(root):
        reason = verify(folder, crc=False)
        if reason is None:
            break
        refused.append(f"{folder}: {reason}")
        print(f"checkpoint {folder} refused: {reason}; trying the previous one", file=sys.stderr, flush=True)
    else:
        where = ("each candidate was refused: " + "; ".join(refused) if refused
                 else "none was published" if root.is_dir() else "the folder does not exist")
        if required:
            raise ValueError(f"--resume: no valid checkpoint under {root} ({where}); give --resume-if-possible to "
                             f"start afresh when there is none, or drop --resume")
        print(f"moe-train: --resume-if-possible: no valid checkpoint under {root} ({where}); starting at step 0",
              file=sys.stderr, flush=True)
        return
    manifest = read_manifest(folder)
    if manifest["step"] >= cfg.train.steps:
        raise ValueError(f"--resume: the latest checkpoint {folder} is at step {manifest['step']}, "
                         f"{'past' if manifest['step'] > cfg.train.steps else 'already at'} train.steps = "
                         f"{cfg.train.steps}: nothing is left to train; raise --steps above {manifest['step']} to "
                         f"continue the run")
    saved = manifest.get("config")
    if not isinstance(saved, dict):
        return  # saved before manifests held the config: the ranks still refuse another model's shapes
    now = json.loads(json.dumps(asdict(cfg)))
    model = _differences(saved, now, {"model": ()}, but=MAY_CHANGE)
    if model:
        raise ValueError(f"--resume: checkpoint {folder} was saved from another model: {'; '.join(model)}; a "
                         f"checkpoint continues only its own model (give another --run-dir, or --start-over)")
    data = _differences(saved, now, DATA_KEYS)
    if data and not allow_data_change:
        raise ValueError(f"--resume: checkpoint {folder} was saved reading other data: {'; '.join(data)}; give "
                         f"--allow-data-change to continue on this data (read from its start)")
    changed = _differences(saved, now, {**OPTIMIZER_KEYS, **MAY_CHANGE}) + (data if allow_data_change else [])
    if changed:
        print(f"moe-train: --resume from {folder}: settings changed since it was saved: {'; '.join(changed)}",
              file=sys.stderr, flush=True)
