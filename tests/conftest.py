"""Suite-wide settings: Triton's interpreter, and the `slow` marker that keeps the quick subset quick.

The suite runs the Triton kernels on CPU tensors through Triton's interpreter. It is set here, before any test
module imports a kernel: a @triton.jit function takes its mode when it is decorated, so a kernel module imported
first without it (any subset of the suite that does not start with tests/kernels) fails later under the interpreter.

`python -m pytest -q -m "not slow" tests` is the inner loop's quick subset. A test marked `slow` starts processes
or takes seconds; a test that starts a process (a spawned rank, a CLI subprocess) without the mark fails, in every
run, so the quick subset never grows a spawn unnoticed."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

os.environ["TRITON_INTERPRET"] = "1"


class UnmarkedSpawn(RuntimeError):
    """A test without the `slow` mark started a process."""


def _refuse(what: str, item: pytest.Item):
    def refuse(*args, **kwargs):
        raise UnmarkedSpawn(f"{item.nodeid} starts a process ({what}): mark it @pytest.mark.slow, so that the quick "
                            f"subset (-m 'not slow') stays free of spawns")
    return refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _guarded(item):
        yield


class _guarded:
    """Inside a test (and its fixtures' setup) not marked slow, starting a process raises UnmarkedSpawn."""

    def __init__(self, item: pytest.Item) -> None:
        self.patch = item.get_closest_marker("slow") is None
        self.item = item

    def __enter__(self) -> None:
        if self.patch:
            self.saved = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__
            multiprocessing.process.BaseProcess.start = _refuse("multiprocessing", self.item)
            subprocess.Popen.__init__ = _refuse("subprocess", self.item)

    def __exit__(self, *exc) -> None:
        if self.patch:
            multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__ = self.saved
