"""One writer for every suite: the fixed-width table and the JSON file with the common header.

The JSON file is {"header": {...}, "key": [...], "metrics": {...}, "rows": [...]}: the header says
where and how the rows were taken (machine, versions, command line, git commit), key names the
fields that identify a row and metrics the timed fields with their better direction, so any
suite's results can be compared later (launch.bench.compare).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

LOWER, HIGHER = "lower", "higher"
Column = tuple[str, str, str]  # (title, row key, format spec)


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """CPU model and cores, load average, GPUs and driver when present."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) if shutil.which(
        "nvidia-smi") else None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "gpus": gpus, "gpu_driver": driver.splitlines()[0] if driver else None,
            "cuda": torch.version.cuda if gpus else None}


def _installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Python, torch, triton (from its metadata: importing it would fix its settings) and this project's version."""
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": _installed("triton"),
            "moe_pretrain": _installed("moe-pretrain")}


def git_commit() -> str | None:
    """HEAD of the checkout this code runs from, '+dirty' when tracked files differ from it."""
    head = _run(["git", "rev-parse", "HEAD"])
    if head is None:
        return None
    return head + ("+dirty" if _run(["git", "status", "--porcelain", "--untracked-files=no"]) else "")


def header(suite: str, argv: list[str], notes: list[str] | None = None) -> dict[str, Any]:
    """The common header of every suite's JSON: suite, time, command line, machine, versions, commit, notes."""
    return {"suite": suite, "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["moe-bench", suite, *argv]), "machine": machine(), "versions": versions(),
            "git_commit": git_commit(), "notes": list(notes or [])}


def commit_text(head: dict[str, Any]) -> str:
    """'commit 1234abcd5678[+dirty]', or the installed project version outside a git checkout."""
    commit = head.get("git_commit")
    if commit is None:
        return f"not run from a git checkout (moe-pretrain {head.get('versions', {}).get('moe_pretrain')})"
    return f"commit {commit[:12]}{'+dirty' if commit.endswith('+dirty') else ''}"


def header_line(head: dict[str, Any]) -> str:
    """One printed line: machine, load, versions, commit."""
    m, v = head["machine"], head["versions"]
    gpu = ", ".join(m["gpus"]) + f" (driver {m['gpu_driver']})" if m["gpus"] else "no GPU"
    return (f"machine: {m['cpu']}, {m['cores']} cores, load {m['load_average'][0]:.2f}, {gpu}; torch {v['torch']}, "
            f"triton {v['triton']}; {commit_text(head)}")


def table(rows: list[dict], columns: list[Column], left: int = 2) -> str:
    """Fixed-width table, one line per row (the first `left` columns left-aligned); None prints as '-'."""
    def cell(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    cells = [[title for title, _, _ in columns]] + [[cell(r.get(key), spec) for _, key, spec in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(v.ljust(w) if i < left else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths)))
             for line in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def write_json(path: str | Path, head: dict[str, Any], rows: list[dict], key: list[str],
               metrics: dict[str, str]) -> None:
    """Write header, row key, metric directions and rows."""
    bad = {name: way for name, way in metrics.items() if way not in (LOWER, HIGHER)}
    if bad:
        raise ValueError(f"metrics {bad}: direction must be {LOWER!r} or {HIGHER!r}")
    doc = {"header": head, "key": key, "metrics": metrics, "rows": rows}
    Path(path).write_text(json.dumps(doc, indent=1, default=str))


def emit(head: dict[str, Any], rows: list[dict], columns: list[Column], json_path: str | None, key: list[str],
         metrics: dict[str, str], left: int = 1) -> None:
    """Print the header line and the table, and write the JSON file when json_path is given."""
    print(header_line(head))
    print(table(rows, columns, left=left))
    if json_path:
        write_json(json_path, head, rows, key=key, metrics=metrics)


def read_json(path: str | Path) -> dict[str, Any]:
    """A suite's JSON file, checked for the fields compare needs."""
    doc = json.loads(Path(path).read_text())
    missing = [field for field in ("header", "key", "metrics", "rows") if not isinstance(doc, dict) or field not in doc]
    if missing:
        raise ValueError(f"{path}: not a moe-bench result file (missing {', '.join(missing)}); "
                         "re-run the suite with --json to get one")
    return doc

