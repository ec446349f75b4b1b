"""A spawn shared by several tests: its results cached per test, and its failure too."""

from __future__ import annotations

from typing import Any, Callable, Hashable

from launch.parallel.spawn import WorkerError


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
