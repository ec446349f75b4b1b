"""Dependencies point one way: launch -> {moe, pipeline, optim} -> dispatch -> kernels (every import, even lazy)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("launch", "moe", "pipeline", "optim", "dispatch", "kernels")
ALLOWED = {
    "moe": {"moe", "dispatch", "kernels"},
    "pipeline": {"pipeline", "dispatch", "kernels"},
    "optim": {"optim", "dispatch", "kernels"},
    "dispatch": {"dispatch", "kernels"},
    "kernels": {"kernels"},
}


def imported_packages(path: Path, package: str) -> set[tuple[str, int]]:
    """(top-level project package, line) of every import in package's file, relative ones resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [package if node.level else node.module or ""]
        else:
            continue
        found |= {(name.split(".")[0], node.lineno) for name in names if name.split(".")[0] in PROJECT}
    return found


def violations(package: str, root: Path = ROOT) -> list[str]:
    """'file:line imports pkg' for each import of a package that package may not use."""
    return [f"{path.relative_to(root)}:{line} imports {name}"
            for path in sorted((root / package).rglob("*.py"))
            for name, line in sorted(imported_packages(path, package)) if name not in ALLOWED[package]]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_module_imports_a_package_above_it(package: str) -> None:
    assert violations(package) == []


def test_the_walk_sees_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    fake = tmp_path / "kernels"
    fake.mkdir()
    (fake / "m.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import launch.x\n"
                               "def f():\n    from moe.layer import MoELayer\nfrom . import ops\nimport torch\n")
    assert violations("kernels", tmp_path) == ["kernels/m.py:3 imports launch", "kernels/m.py:5 imports moe"]
