"""The quick subset stays free of spawns: a test that starts a process without the `slow` mark fails."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

INNER = '''
import multiprocessing
import subprocess

import pytest


def test_unmarked_subprocess():
    subprocess.run(["/nonexistent/program"])


def test_unmarked_multiprocessing():
    multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.slow
def test_marked_may_start_processes():
    with pytest.raises(FileNotFoundError):  # it got as far as looking for the program: the guard let it through
        subprocess.run(["/nonexistent/program"])
'''


@pytest.mark.slow  # lifts the guard of this outer test, so that the inner session's own guard is what is tested
def test_an_unmarked_test_that_starts_a_process_fails_naming_the_mark(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini('[pytest]\nmarkers =\n    slow: starts processes\n')
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*test_unmarked_subprocess starts a process (subprocess): mark it @pytest.mark.slow*",
                                 "*test_unmarked_multiprocessing starts a process (multiprocessing)*"])
