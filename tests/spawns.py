"""A spawn shared by several tests: its results cached per test, and its failure too."""

from __future__ import annotations

import contextlib
import ctypes.util
import os
from typing import Any, Callable, Hashable, Iterator

from launch.parallel.spawn import WorkerError

# glibc's heap checks (issue 51): its debugging malloc preloaded, MALLOC_CHECK_=3 (a heap inconsistency aborts the
# process), MALLOC_PERTURB_=165 (freed and new blocks filled with a byte pattern, so a read or write after a free
# shows), fatal messages on stderr (not the terminal). glibc reads them when a process starts.
MALLOC_ENV = {"LD_PRELOAD": ctypes.util.find_library("c_malloc_debug") or "libc_malloc_debug.so.0",
              "MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165", "LIBC_FATAL_STDERR_": "1"}


def from_shared_spawn(cache: dict, key: Hashable, keys: list, spawn: Callable[[], list]) -> Any:
    """cache[key], spawning on first use: spawn() gives the results of all keys (key among them, in order); a
    WorkerError it raises is cached for each of them, so the tests sharing the spawn fail with it, not by spawning
    again (each up to its timeout)."""
    if key not in cache:
        try:
            cache.update(zip(keys, spawn(), strict=True))
        except WorkerError as error:
            cache.update((k, error) for k in keys)
    if isinstance(cache[key], WorkerError):
        raise cache[key]
    return cache[key]


@contextlib.contextmanager
def malloc_checked() -> Iterator[None]:
    """Processes started inside run under MALLOC_ENV. The ranks of launch.parallel.spawn.run_processes then start
    as fresh interpreters (an LD_PRELOAD unlike the fork server's makes it pick "spawn"), a second or two each."""
    saved = {k: os.environ.get(k) for k in MALLOC_ENV}
    os.environ.update(MALLOC_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
