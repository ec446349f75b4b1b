"""Dependencies point one way, as docs/architecture.md's layers say, and no modules import each other round a loop.

Every import counts: at the top, inside a function, under TYPE_CHECKING, relative ones resolved. `from pkg import
name` is an edge to the module pkg.name where that is a module, else to pkg itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("launch", "moe", "pipeline", "optim", "dispatch", "kernels")
LAYERS = re.compile(r"<!-- layers: top first -->\s*```text\n(.*?)```", re.S)


def layers(root: Path = ROOT) -> list[list[str]]:
    """docs/architecture.md's layers, bottom first: each a list of sibling packages (or modules)."""
    block = LAYERS.search((root / "docs" / "architecture.md").read_text())
    assert block, "docs/architecture.md has no layers block"
    return [[name.strip() for name in line.split("|")] for line in reversed(block.group(1).strip().splitlines())]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module of the project's packages (a package is its __init__)."""
    found = {}
    for top in PROJECT:
        for path in sorted((root / top).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, name: str, known: dict[str, Path]) -> set[tuple[str, int]]:
    """(imported project module, line) of every import in the module name at path."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add((target, node.lineno))
    return found


def graph(root: Path = ROOT) -> dict[str, set[tuple[str, int]]]:
    known = modules(root)
    return {name: imports(path, name, known) for name, path in known.items()}


def unit(name: str, placed: dict[str, int]) -> str | None:
    """The longest layer entry name belongs to (itself or a package above it)."""
    while name and name not in placed:
        name = name.rpartition(".")[0]
    return name or None


def upward_imports(root: Path = ROOT) -> list[str]:
    """'module:line imports module' for each import of a layer above, or of a sibling; and each module no layer holds
    (a package's own __init__ that imports nothing is allowed, like launch's)."""
    placed = {entry: level for level, line in enumerate(layers(root)) for entry in line}
    wrong = []
    for name, deps in sorted(graph(root).items()):
        mine = unit(name, placed)
        if mine is None:
            if deps:
                wrong.append(f"{name} is in no layer of docs/architecture.md")
            continue
        for dep, line in sorted(deps):
            theirs = unit(dep, placed)
            if theirs is not None and theirs != mine and placed[theirs] >= placed[mine]:
                wrong.append(f"{name}:{line} imports {dep}")
    return wrong


def cycles(root: Path = ROOT) -> list[list[str]]:
    """Each set of modules that import each other round a loop (strongly connected, Tarjan), sorted."""
    edges = {name: {dep for dep, _ in deps} for name, deps in graph(root).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            loop = []
            while not loop or loop[-1] != v:
                loop.append(stack.pop())
            if len(loop) > 1:
                found.append(sorted(loop))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_module_imports_a_layer_above_it_or_a_sibling() -> None:
    assert upward_imports() == []


def test_no_import_cycle() -> None:
    assert cycles() == []


def test_every_module_is_in_a_layer() -> None:
    placed = {entry: level for level, line in enumerate(layers()) for entry in line}
    assert [name for name in modules() if unit(name, placed) is None] == ["launch"]  # launch's __init__: a docstring
    assert all(entry in modules() for entry in placed), "a layer names a module that does not exist"


def test_tests_mirror_the_packages() -> None:
    for folder in (ROOT / "tests").rglob("__init__.py"):
        mirrored = folder.parent.relative_to(ROOT / "tests")
        assert mirrored == Path() or (ROOT / mirrored).is_dir(), f"tests/{mirrored} mirrors no package"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(
        "<!-- layers: top first -->\n```text\nlaunch.train\nlaunch.data | launch.faults\nmoe\nkernels\n```\n")
    for top in PROJECT:
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text("")
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_planted_upward_sibling_lazy_or_type_checking_import_is_caught(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "launch/data/__init__.py": "", "launch/faults/__init__.py": "", "launch/train/__init__.py": "",
        "launch/data/feed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from launch.train import loop\n",
        "launch/faults/guard.py": "def f():\n    from launch.data.feed import x\n",
        "launch/train/loop.py": "from launch.data import feed\nfrom ..faults import guard\nimport moe\n",
        "kernels/k.py": "import moe.layer\n", "moe/layer.py": "from kernels import k\n"})
    assert upward_imports(root) == ["kernels.k:1 imports moe.layer", "launch.data.feed:3 imports launch.train.loop",
                                    "launch.faults.guard:2 imports launch.data.feed"]
    assert cycles(root) == [["kernels.k", "moe.layer"], ["launch.data.feed", "launch.faults.guard", "launch.train.loop"]]


def test_a_planted_cycle_inside_one_package_is_caught(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"moe/a.py": "from moe import b\n", "moe/b.py": "def f():\n    from .a import g\n"})
    assert upward_imports(root) == []
    assert cycles(root) == [["moe.a", "moe.b"]]
