"""README.md is the project's map: short, its test command the one CI runs, every path it names present and every
command and config section at the module that implements it; the docs pages it links exist, and what they name
exists too."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from launch.config.run import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 250
MAP = re.compile(r"<!-- map: (?P<name>[a-z]+) -->\n(?P<body>.*?)<!-- end of map: (?P=name) -->", re.S)
# A repository path as the pages write it: a folder or file under one of these, no placeholders (an upper-case
# segment such as optim/NAME/exp_avg is a checkpoint key's pattern, not a path).
REPO_PATH = re.compile(r"^(?:kernels|dispatch|moe|pipeline|optim|launch|tests|configs|docs|\.ci)"
                       r"(?:/(?![A-Z_]+(?:/|$))[\w.-]+)*/?$")
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def readme() -> str:
    return (ROOT / "README.md").read_text()


def maps() -> dict[str, str]:
    """The README's marked map tables, by name."""
    return {m.group("name"): m.group("body") for m in MAP.finditer(readme())}


def rows(table: str) -> list[list[str]]:
    """The cells of a Markdown table's body rows, backticks kept."""
    lines = [line for line in table.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def code(cell: str) -> list[str]:
    """The backticked spans of a table cell."""
    return re.findall(r"`([^`]+)`", cell)


def test_readme_is_at_most_250_lines():
    assert len(readme().splitlines()) <= MAX_LINES


def test_readme_test_command_is_the_one_ci_runs():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith("pip install") and "pytest" in line]
    assert len(ci) == 1, ci
    shown = [line.strip() for line in readme().splitlines() if line.startswith("    ") and "pytest" in line]
    assert shown == ci


def test_readme_keeps_its_train_command():
    assert '    pip install torch==2.13.0 -e ".[test]" && moe-train --config configs/tiny.toml\n' in readme()


def test_every_path_the_map_names_exists():
    blocks = maps()
    assert set(blocks) == {"packages", "commands", "config"}
    named = [span for body in blocks.values() for row in rows(body) for cell in row for span in code(cell)
             if REPO_PATH.match(span)]
    assert len(named) >= 25
    assert [path for path in named if not (ROOT / path).exists()] == []


def test_the_map_holds_every_package_of_the_architecture_page():
    """Each package or module docs/architecture.md's table gives a job is in the README's map too, and every
    subpackage of launch/ is."""
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    table = architecture[architecture.index("| package | its job |"):]
    listed = {code(row[0])[0] for row in rows(table.split("\n\n")[0])}
    mapped = {code(row[0])[0] for row in rows(maps()["packages"])}
    assert listed and listed <= mapped, listed - mapped
    subpackages = {f"{p.parent.relative_to(ROOT).as_posix()}/" for p in (ROOT / "launch").glob("*/__init__.py")}
    assert subpackages <= mapped, subpackages - mapped


def test_each_command_names_the_module_that_implements_it():
    """The commands table holds every console script of pyproject.toml with the file of its entry point, and an
    example that calls that command."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    table = {code(row[0])[0]: (code(row[1])[0], code(row[2])[0]) for row in rows(maps()["commands"])}
    assert set(table) == set(scripts)
    for name, entry in scripts.items():
        example, module = table[name]
        assert module == entry.split(":")[0].replace(".", "/") + ".py", name
        assert example.startswith(name + " "), name


def test_each_config_section_names_the_module_that_defines_it():
    table = {code(row[0])[0]: code(row[2])[0] for row in rows(maps()["config"])}
    assert set(table) == {f"[{name}]" for name in SECTIONS}
    for name, cls in SECTIONS.items():
        assert table[f"[{name}]"] == cls.__module__.replace(".", "/") + ".py", name


def test_readme_links_every_docs_page_and_only_pages_that_exist():
    links = {m.group("target").split("#")[0] for m in LINK.finditer(readme())}
    pages = {link for link in links if link.startswith("docs/")}
    assert {p for p in pages if not (ROOT / p).is_file()} == set()
    written = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert written <= pages, written - pages


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    slugs = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return slugs


def test_docs_pages_link_only_to_pages_and_headings_that_exist():
    broken = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for m in LINK.finditer(page.read_text()):
            target = m.group("target")
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.is_file():
                broken.append(f"{page.name}: {target}")
            elif anchor and anchor not in anchors(path):
                broken.append(f"{page.name}: {target}")
    assert broken == []


def test_paths_the_docs_pages_name_exist():
    """Every repository path a docs page writes in backticks (a module, a test file, a config) exists, so a move
    that leaves a page behind fails here."""
    missing = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for span in re.findall(r"`([^`\n]+)`", page.read_text()):
            if REPO_PATH.match(span) and not (ROOT / span).exists():
                missing.append(f"{page.name}: {span}")
    assert missing == []
