"""docs/config.md is the page `python -m launch.config.reference` generates, and every config key has a docstring."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from launch.config.reference import missing_docs, render, section_keys, with_values

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "config.md"
HALF = 0  # a named value for Sample.documented


@dataclass
class Sample:
    """[sample]: a section of two keys, one documented."""

    documented: Literal["a", "b"] = "a"
    """A key with a docstring naming `HALF`."""
    undocumented: int = HALF


def test_every_key_has_a_docstring():
    assert missing_docs() == []


def test_docs_config_md_is_the_generated_page():
    assert PAGE.read_text() == render(), "docs/config.md is stale: python -m launch.config.reference > docs/config.md"


@pytest.mark.slow  # starts a process (tests/conftest.py)
def test_the_command_prints_the_page():
    result = subprocess.run([sys.executable, "-m", "launch.config.reference"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == render(), result.stderr


def test_a_key_without_a_docstring_is_named():
    assert missing_docs({"sample": Sample}) == ["sample.undocumented"]
    keys = section_keys(Sample)
    assert [(k.name, k.default, k.written_as, k.doc) for k in keys] == [
        ("documented", "a", "", "A key with a docstring naming `HALF`."), ("undocumented", 0, "HALF", "")]


def test_a_row_shows_the_allowed_values_the_default_and_named_values():
    page = render({"sample": Sample})
    assert "| `documented` | `\"a\"` or `\"b\"` | `\"a\"` | A key with a docstring naming `HALF` (`0`). |" in page
    assert "| `undocumented` | integer | `0` (`HALF`) |  |" in page
    assert "## [sample]\n\nA section of two keys, one documented." in page


def test_a_docstring_naming_a_missing_constant_is_refused():
    with pytest.raises(ValueError, match=f"{__name__} has no constant NOPE"):
        with_values("see `NOPE`", sys.modules[__name__])
