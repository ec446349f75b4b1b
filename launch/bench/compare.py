"""`moe-bench compare OLD.json NEW.json [--threshold 0.1]`: per-row ratios of every timed metric of two runs of
any suite, flagging rows that got slower by more than the threshold (exit status 1 when any did)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from launch.bench.report import LOWER, read_json, table


def row_id(row: dict[str, Any], key: list[str]) -> str:
    """The row's identity: its key fields that are set, as text."""
    parts = []
    for name in key:
        value = row.get(name)
        if value not in (None, "", {}, []):
            parts.append(json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value))
    return " ".join(parts)


def slowdown(old: float, new: float, direction: str) -> float:
    """How many times slower new is than old (> 1: slower): time ratio, or the inverse for a higher-is-better metric."""
    return new / old if direction == LOWER else old / new


def compare(old: dict[str, Any], new: dict[str, Any], threshold: float) -> tuple[list[dict], list[str]]:
    """(one record per (row, metric) in both runs, notes on rows or metrics only one run has)."""
    suites = (old["header"].get("suite"), new["header"].get("suite"))
    if suites[0] != suites[1]:
        raise ValueError(f"the files hold different suites: {suites[0]!r} and {suites[1]!r}")
    metrics = {name: way for name, way in new["metrics"].items() if old["metrics"].get(name) == way}
    before = {row_id(r, old["key"]): r for r in old["rows"]}
    after = {row_id(r, new["key"]): r for r in new["rows"]}
    records = []
    for rid, row in after.items():
        if rid not in before:
            continue
        for name, way in metrics.items():
            a, b = before[rid].get(name), row.get(name)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0:
                factor = slowdown(a, b, way)
                records.append({"row": rid, "metric": name, "better": way, "old": a, "new": b, "ratio": b / a,
                                "slowdown": factor, "flag": "SLOWER" if factor > 1 + threshold else ""})
    notes = [f"only in OLD: {rid}" for rid in before if rid not in after]
    notes += [f"only in NEW: {rid}" for rid in after if rid not in before]
    notes += [f"metric not compared (missing or direction differs): {name}"
              for name in sorted(set(old["metrics"]) ^ set(metrics) | set(new["metrics"]) - set(metrics))]
    return records, notes


def _describe(doc: dict[str, Any], label: str) -> str:
    head, machine = doc["header"], doc["header"].get("machine", {})
    return (f"{label}: {head.get('command')} | {machine.get('cpu')}, {machine.get('cores')} cores, "
            f"GPUs {machine.get('gpus') or 'none'} | torch {head.get('versions', {}).get('torch')} | "
            f"commit {(head.get('git_commit') or 'unknown')[:12]} | {head.get('time_utc')}")


COLUMNS = [("row", "row", ""), ("metric", "metric", ""), ("better", "better", ""), ("old", "old", ".4g"),
           ("new", "new", ".4g"), ("new/old", "ratio", ".3f"), ("slowdown", "slowdown", ".3f"), ("", "flag", "")]


def main(argv: list[str]) -> int:
    """Print the comparison; 1 when any row got slower than the threshold, 2 on unusable input."""
    p = argparse.ArgumentParser(prog="moe-bench compare", description=__doc__.splitlines()[0])
    p.add_argument("old", help="JSON of the earlier run (any suite's --json)")
    p.add_argument("new", help="JSON of the later run, same suite")
    p.add_argument("--threshold", type=float, default=0.1,
                   help="flag a metric when it is more than this fraction slower (default 0.1 = 10%%)")
    args = p.parse_args(argv)
    if not args.threshold >= 0:
        p.error(f"--threshold must be >= 0, got {args.threshold}")
    try:
        old, new = read_json(args.old), read_json(args.new)
        records, notes = compare(old, new, args.threshold)
    except (OSError, ValueError) as err:
        print(f"moe-bench compare: {err}")
        return 2
    print(_describe(old, "OLD"))
    print(_describe(new, "NEW"))
    if old["header"].get("machine", {}).get("cpu") != new["header"].get("machine", {}).get("cpu"):
        print("note: the two runs come from different machines")
    print(table(records, COLUMNS, left=3) if records else "no row and metric in common")
    print("\n".join(notes))
    flagged = [r for r in records if r["flag"]]
    print(f"{len(flagged)} of {len(records)} (row, metric) pairs more than {args.threshold:.0%} slower")
    return 1 if flagged else 0
