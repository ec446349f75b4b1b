"""No two public classes of the project share a name (a reader meeting one never has to ask which)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.test_imports import ROOT, modules


def public_classes(root: Path = ROOT) -> dict[str, list[str]]:
    """Class name -> the modules defining it at their top level, for names not starting with '_'."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, path in modules(root).items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found[node.name].append(name)
    return found


def test_no_two_public_classes_share_a_name() -> None:
    assert {name: where for name, where in public_classes().items() if len(where) > 1} == {}


def test_a_planted_second_class_of_one_name_is_caught(tmp_path: Path) -> None:
    for top in ("launch", "moe", "pipeline", "optim", "dispatch", "kernels"):
        (tmp_path / top).mkdir()
    (tmp_path / "pipeline" / "schedules.py").write_text("class Layout:\n    pass\n")
    (tmp_path / "launch" / "mesh.py").write_text("class Layout:\n    pass\nclass _Private:\n    pass\n")
    (tmp_path / "moe" / "x.py").write_text("class _Private:\n    pass\n")
    assert {n: w for n, w in public_classes(tmp_path).items() if len(w) > 1} == {
        "Layout": ["launch.mesh", "pipeline.schedules"]}
