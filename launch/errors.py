"""How the five CLIs end on a user's mistake or an environment fault: one line naming the file, key or resource, and
an exit code (2: bad input, 1: a runtime fault, 130: interrupted), never a traceback.

Every CLI's main is wrapped by `cli(prog)`; the exceptions it knows are turned into that line by `describe`:
ValueError (the project's bad-input error: a config key, a flag, a file's contents) exits 2; an OSError naming a
path the user chose (missing, a folder, read-only, not permitted) exits 2; a full disk (ENOSPC; DiskFull says
the path and the bytes it needed) and other OSErrors exit 1; an exception class may state its own `exit_code`
(e.g. launch.parallel.spawn.WorkerError). Anything else is a bug and keeps its traceback. MOE_TRACEBACK=1 keeps
the traceback of every error (for a bug report).
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

BAD_INPUT = 2
FAULT = 1
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command it interrupted
USER_PATH_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EROFS, errno.EEXIST,
                    errno.ENAMETOOLONG}


class DiskFull(OSError):
    """A write ran out of space (ENOSPC): names the path and the bytes the write needed, and what is free there."""

    def __init__(self, path: str | Path, needed: int, what: str = "writing", note: str = "") -> None:
        free = free_bytes(path)
        super().__init__(errno.ENOSPC, f"no space left on device {what} {path}: {needed:,} bytes needed{note}, "
                                       f"{'?' if free is None else f'{free:,}'} free there; free some space and run "
                                       f"again", str(path))

    def __str__(self) -> str:
        return self.strerror


def free_bytes(path: str | Path) -> int | None:
    """Bytes free on path's filesystem (its nearest existing folder), None where that cannot be read."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def disk_full(error: BaseException | None) -> bool:
    """Whether error, or an exception it wraps (its cause or context; torch.distributed.checkpoint's failures of
    each rank), is ENOSPC."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict) and any(disk_full(f[0] if isinstance(f, tuple) else f) for f in failures.values()):
            return True
        error = error.__cause__ or error.__context__
    return False


def describe(error: BaseException) -> tuple[str, int] | None:
    """(the one-line message, the exit code) of an error a user or the environment caused; None for a bug."""
    code = getattr(error, "exit_code", None)
    if isinstance(code, int):
        return str(error), code
    if isinstance(error, DiskFull):
        return str(error), FAULT
    if isinstance(error, OSError):
        where = f"{error.filename}: " if error.filename else ""
        words = error.strerror or str(error)
        if error.errno == errno.ENOSPC:
            return f"no space left on device writing {where or 'a file: '}free some space and run again", FAULT
        return f"{where}{words}", BAD_INPUT if error.filename and error.errno in USER_PATH_ERRNOS else FAULT
    if isinstance(error, ValueError):
        return str(error), BAD_INPUT
    return None


def cli(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a CLI's main(argv, ...) -> exit code: a known error prints "PROG: message" on stderr and returns its code
    (describe); Ctrl-C (KeyboardInterrupt) returns INTERRUPTED after one line; a bug propagates."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                if os.environ.get("MOE_TRACEBACK"):
                    raise
                print(f"\n{prog}: interrupted", file=sys.stderr, flush=True)
                return INTERRUPTED
            except Exception as error:
                known = None if os.environ.get("MOE_TRACEBACK") else describe(error)
                if known is None:
                    raise
                print(f"{prog}: {known[0]}", file=sys.stderr, flush=True)
                return known[1]

        return run

    return wrap


class Interrupted(Exception):
    """Ctrl-C (SIGINT) stopped a command that says what it left behind (e.g. a resumable output)."""

    exit_code = INTERRUPTED
