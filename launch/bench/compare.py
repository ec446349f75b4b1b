"""`moe-bench compare OLD.json NEW.json [--threshold 0.1]`: per-row ratios of every timed metric of two runs of
any suite, flagging rows that got slower by more than the threshold (exit status 1 when any did)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from launch.bench.report import LOWER, commit_text, read_json, table


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)


def row_id(row: dict[str, Any], key: list[str]) -> str:
    """The row's identity: all its key fields."""
    return json.dumps([row.get(name) for name in key], sort_keys=True, default=str)


def row_labels(rows: list[dict[str, Any]], key: list[str]) -> dict[str, str]:
    """{row_id: the values of the key fields that differ between rows (all set ones when none differ)}."""
    varying = [name for name in key if len({_text(r.get(name)) for r in rows}) > 1] or key
    return {row_id(r, key): " ".join(_text(r[name]) for name in varying if r.get(name) not in (None, "", {}, []))
            for r in rows}


def slowdown(old: float, new: float, direction: str) -> float:
    """How many times slower new is than old (> 1: slower): time ratio, or the inverse for a higher-is-better metric."""
    return new / old if direction == LOWER else old / new


def compare(old: dict[str, Any], new: dict[str, Any], threshold: float) -> tuple[list[dict], list[str]]:
    """(one record per (row, metric) in both runs, notes on rows or metrics only one run has)."""
    suites = (old["header"].get("suite"), new["header"].get("suite"))
    if suites[0] != suites[1]:
        raise ValueError(f"the files hold different suites: {suites[0]!r} and {suites[1]!r}")
    if old["key"] != new["key"]:
        raise ValueError(f"the files identify rows differently: key {old['key']} and {new['key']}")
    metrics = {name: way for name, way in new["metrics"].items() if old["metrics"].get(name) == way}
    before = {row_id(r, old["key"]): r for r in old["rows"]}
    after = {row_id(r, new["key"]): r for r in new["rows"]}
    label = row_labels(old["rows"] + new["rows"], new["key"])
    records = []
    for rid, row in after.items():
        if rid not in before:
            continue
        for name, way in metrics.items():
            a, b = before[rid].get(name), row.get(name)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0:
                factor = slowdown(a, b, way)
                records.append({"row": label[rid], "metric": name, "better": way, "old": a, "new": b,
                                "ratio": b / a, "slowdown": factor, "flag": "SLOWER" if factor > 1 + threshold else ""})
    notes = [f"only in OLD: {label[rid]}" for rid in before if rid not in after]
    notes += [f"only in NEW: {label[rid]}" for rid in after if rid not in before]
    notes += [f"metric not compared (missing or direction differs): {name}"
              for name in sorted(set(old["metrics"]) ^ set(metrics) | set(new["metrics"]) - set(metrics))]
    return records, notes


def header_notes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Warnings about the two runs' conditions: other machine, other options, a much busier machine."""
    (a, b), notes = (old["header"], new["header"]), []
    if a.get("machine", {}).get("cpu") != b.get("machine", {}).get("cpu") or \
            a.get("machine", {}).get("gpus") != b.get("machine", {}).get("gpus"):
        notes.append("note: the two runs come from different machines")
    options = [" ".join(arg for arg in h.get("command", "").split() if not arg.endswith(".json")) for h in (a, b)]
    if options[0] != options[1]:
        notes.append(f"note: the options differ: OLD {options[0]!r}, NEW {options[1]!r}")
    loads = [h.get("machine", {}).get("load_average", [0.0])[0] for h in (a, b)]
    cores = b.get("machine", {}).get("cores") or 1
    if max(loads) > cores and max(loads) > 1.5 * min(loads):
        notes.append(f"note: 1-minute load average {loads[0]:.1f} (OLD) vs {loads[1]:.1f} (NEW) on {cores} cores: "
                     "the busier run's timings are not comparable")
    return notes


def _describe(doc: dict[str, Any], label: str) -> str:
    head, machine = doc["header"], doc["header"].get("machine", {})
    return (f"{label}: {head.get('command')} | {machine.get('cpu')}, {machine.get('cores')} cores, "
            f"GPUs {machine.get('gpus') or 'none'} | torch {head.get('versions', {}).get('torch')} | "
            f"{commit_text(head)} | {head.get('time_utc')}")


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
    for line in header_notes(old, new) + [table(records, COLUMNS, left=3) if records else "no row and metric in common",
                                          *notes]:
        print(line)
    flagged = [r for r in records if r["flag"]]
    print(f"{len(flagged)} of {len(records)} (row, metric) pairs more than {args.threshold:.0%} slower")
    return 1 if flagged else 0
