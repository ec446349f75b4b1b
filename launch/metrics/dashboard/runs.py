"""Reading a run's metrics.jsonl into step-binned series small enough for one HTML page."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from launch.metrics.records import SCHEMA_VERSION, decode_array

METRICS_FILE = "metrics.jsonl"
SCALARS = ("loss", "lm_loss", "aux_loss", "eval_lm_loss", "grad_norm", "lr", "tokens_per_s", "mfu", "dropped_tokens",
           "straggler_share")
LAYER_FIGURES = ("max_over_mean", "min_over_mean", "cv", "dead", "entropy", "dropped")
"""Per-layer lists of the "moe" section the dashboard bins (the "stragglers" section adds busiest_over_mean)."""
SCHEMA_ONE_KEYS = {"max_over_mean": "expert_load_max_over_mean", "min_over_mean": "expert_load_min_over_mean",
                   "dead": "dead_experts", "entropy": "expert_load_entropy"}


class RunError(ValueError):
    """A run directory the dashboard cannot show (no metrics, nothing readable)."""


class Bins:
    """Running means of one series over fixed-width step bins."""

    def __init__(self, first_step: int, width: int) -> None:
        self.first_step, self.width = first_step, width
        self.sums: dict[int, list] = {}

    def add(self, step: int, value: float | np.ndarray) -> None:
        """Add one step's value (a number or an array of fixed shape) to its bin."""
        key = max(step - self.first_step, 0) // self.width
        entry = self.sums.setdefault(key, [0.0, 0, 0])
        entry[0] = entry[0] + np.asarray(value, dtype=np.float64)
        entry[1] += 1
        entry[2] += step

    def series(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean step of each bin, mean value of each bin [bins, ...]) in step order."""
        keys = sorted(self.sums)
        steps = np.array([self.sums[k][2] / self.sums[k][1] for k in keys])
        values = np.array([self.sums[k][0] / self.sums[k][1] for k in keys])
        return steps, values


@dataclass
class Run:
    """What the dashboard shows of one run: binned scalar and per-layer series, traffic and per-rank figures."""

    name: str
    path: Path
    schemas: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    records: int = 0
    first_step: int = 0
    last_step: int = 0
    line_points: int = 2000
    heat_bytes: int = 4_500_000
    bias_bytes: int = 1_800_000
    num_layers: int = 0
    scalars: dict[str, Bins] = field(default_factory=dict)
    layers: dict[str, Bins] = field(default_factory=dict)
    losses: dict[str, Bins] = field(default_factory=dict)
    load: Bins | None = None
    bias: Bins | None = None
    num_experts: int = 0
    rank_bytes: np.ndarray | None = None
    node_bytes: np.ndarray | None = None
    ranks: dict[str, np.ndarray] = field(default_factory=dict)
    position_rows: Bins | None = None  # [layers, ep] rows each EP position received over their layer's mean


def metrics_path(run_dir: str | Path) -> Path:
    """The metrics file of a run directory (or the file itself when given one); RunError when there is none."""
    path = Path(run_dir)
    if path.is_file():
        return path
    if not path.is_dir():
        raise RunError(f"{run_dir}: no such run directory")
    if not (path / METRICS_FILE).is_file():
        raise RunError(f"{run_dir}: no {METRICS_FILE} in this run directory (moe-train writes one per run; "
                       f"has the run started?)")
    return path / METRICS_FILE


def _edge_steps(path: Path) -> tuple[int, int]:
    """Steps of the first and last complete records, read from the file's two ends."""
    steps = []
    with path.open("rb") as handle:
        steps.append(_first_step(handle.readline()))
        size = handle.seek(0, os.SEEK_END)
        chunk = min(size, 8 << 20)
        handle.seek(size - chunk)
        tail = handle.read(chunk).splitlines()
    for line in reversed(tail):
        step = _first_step(line)
        if step is not None:
            steps.append(step)
            break
    found = [s for s in steps if s is not None]
    return (min(found), max(found)) if found else (0, 0)


def _first_step(line: bytes) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _width(first: int, last: int, bins: int) -> int:
    return max(1, math.ceil((last - first + 1) / max(bins, 1)))


def load_run(run_dir: str | Path, name: str | None = None, **budget: int) -> Run:
    """Read a run's metrics into bins (see Run for the size budget: line_points per curve, heat_bytes and
    bias_bytes of float32 for the per-layer load and bias heatmaps, ~75 and ~30 bins at 58 layers x 256 experts)."""
    path = metrics_path(run_dir)
    first, last = _edge_steps(path)
    run = Run(name or Path(run_dir).name, path, first_step=first, last_step=last, **budget)
    bad, count = [], 0
    with path.open("rb") as handle:
        for line in handle:
            if not line.strip():
                continue
            count += 1
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    raise ValueError("no integer 'step'")
                add_record(run, record)
            except (ValueError, KeyError, TypeError):  # not JSON, or fields of unexpected types or shapes
                bad.append(count)
    _note_problems(run, bad, count)
    if not run.records:
        raise RunError(f"{path}: no readable metrics records yet" + (f" ({len(bad)} malformed lines)" if bad else ""))
    return run


def _note_problems(run: Run, bad: list[int], count: int) -> None:
    if bad == [count]:
        run.notes.append(f"the last line (record {count}) is incomplete (the run may still be writing): left out")
    elif bad:
        run.notes.append(f"{len(bad)} malformed lines left out (first: record {bad[0]})")
    older = sorted(s for s in run.schemas if s < SCHEMA_VERSION)
    newer = sorted(s for s in run.schemas if s > SCHEMA_VERSION)
    if older:
        run.notes.append(f"records of schema {', '.join(map(str, older))} (this dashboard reads {SCHEMA_VERSION}): "
                         f"per-expert loads, bias, traffic and per-rank views are not in them")
    if newer:
        run.notes.append(f"records of a newer schema {', '.join(map(str, newer))}: showing the fields of schema "
                         f"{SCHEMA_VERSION}")


def add_record(run: Run, record: dict) -> None:
    """Add one metrics record (any schema) to the run's bins. Every field is read before anything is added:
    a field of an unexpected type or shape raises ValueError, KeyError or TypeError and leaves the run as it was."""
    step, first, last = record["step"], run.first_step, run.last_step
    moe = record.get("moe") if isinstance(record.get("moe"), dict) else {}
    scalars = {key: record[key] for key in SCALARS if isinstance(record.get(key), (int, float))
               and not isinstance(record[key], bool) and math.isfinite(record[key])}
    layers = {name: _numbers(values) for name in LAYER_FIGURES
              if isinstance(values := moe.get(name, record.get(SCHEMA_ONE_KEYS.get(name, ""))), list) and values}
    losses = {kind: _numbers(values) for kind, values in (moe.get("losses") or {}).items()
              if isinstance(values, list) and values}
    load = _matrix(moe["load"]) if "load" in moe else None
    bias = _matrix(moe["bias"]) if "bias" in moe else None
    traffic = record.get("traffic") if isinstance(record.get("traffic"), dict) else {}
    rank_bytes = _matrix(traffic["rank_bytes"]).astype(np.int64) if "rank_bytes" in traffic else None
    total = 0 if rank_bytes is None else rank_bytes.sum()
    node_bytes = np.asarray(traffic.get("node_bytes", [[total]]), dtype=np.int64)
    stragglers = record.get("stragglers") if isinstance(record.get("stragglers"), dict) else {}
    position_rows = _matrix(stragglers["rows"]) if "rows" in stragglers else None
    busiest = stragglers.get("busiest_over_mean")
    if isinstance(busiest, list) and busiest:
        layers["busiest_over_mean"] = _numbers(busiest)
    share = stragglers.get("share")
    if isinstance(share, (int, float)) and not isinstance(share, bool) and math.isfinite(share):
        scalars["straggler_share"] = share

    schema = record.get("schema", 1)
    run.schemas.add(schema if isinstance(schema, int) else 0)
    run.records += 1
    line_width = _width(first, last, run.line_points)
    for key, value in scalars.items():
        run.scalars.setdefault(key, Bins(first, line_width)).add(step, value)
    for name, values in layers.items():
        run.num_layers = max(run.num_layers, len(values))
        run.layers.setdefault(name, Bins(first, line_width)).add(step, values)
    for kind, values in losses.items():
        run.losses.setdefault(kind, Bins(first, line_width)).add(step, values)
    if load is not None:
        run.num_experts = load.shape[1]
        if run.load is None:
            run.load = Bins(first, _width(first, last, run.heat_bytes // (load.size * 4)))
        run.load.add(step, load / np.maximum(load.mean(axis=1, keepdims=True), 1e-12))
    if bias is not None:
        if run.bias is None:
            run.bias = Bins(first, _width(first, last, run.bias_bytes // (bias.size * 4)))
        run.bias.add(step, bias)
    if position_rows is not None:
        if run.position_rows is None:
            run.position_rows = Bins(first, _width(first, last, run.heat_bytes // (position_rows.size * 4)))
        run.position_rows.add(step, position_rows / np.maximum(position_rows.mean(axis=1, keepdims=True), 1e-12))
    if rank_bytes is not None:
        _add_traffic(run, rank_bytes, node_bytes)
    if isinstance(record.get("ranks"), dict):
        _add_ranks(run, record["ranks"])


def _numbers(values: list) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def _matrix(encoded: dict) -> np.ndarray:
    """A [rows, columns] array from its encode_array form; ValueError for another shape."""
    array = decode_array(encoded).astype(np.float64)
    if array.ndim != 2:
        raise ValueError(f"expected a 2-d array, got shape {list(array.shape)}")
    return array


def _add_traffic(run: Run, ranks: np.ndarray, nodes: np.ndarray) -> None:
    """Sum the byte matrices over the run (a layout change mid-run keeps the latest layout's sums)."""
    if run.rank_bytes is None or run.rank_bytes.shape != ranks.shape or run.node_bytes.shape != nodes.shape:
        run.rank_bytes, run.node_bytes = np.zeros_like(ranks), np.zeros_like(nodes)
    run.rank_bytes += ranks
    run.node_bytes += nodes


def _add_ranks(run: Run, ranks: dict) -> None:
    """Peak memory: the largest seen per rank; pipeline idle: the latest step's fractions."""
    memory = ranks.get("peak_memory_bytes")
    if isinstance(memory, list):
        memory = np.asarray(memory, dtype=np.float64)
        seen = run.ranks.get("peak_memory_bytes")
        same_layout = seen is not None and seen.shape == memory.shape
        run.ranks["peak_memory_bytes"] = np.maximum(seen, memory) if same_layout else memory
    if isinstance(ranks.get("pipeline_idle_fraction"), list):
        run.ranks["pipeline_idle_fraction"] = np.asarray(ranks["pipeline_idle_fraction"], dtype=np.float64)
