"""`moe-plan [CONFIG] --measure-gpu RESULTS.json`: moe-plan's per-phase compute times and memory beside what a GPU
measured, as ratios measured / predicted.

RESULTS.json is a `moe-bench gpu --json` result (its rows holding a real-device rehearsal, "rehearsal", and its
trainer rows, which carry moe-plan's step and peak for their config) or a rehearsal report (`moe-train --rehearse
--device cuda --json`). With CONFIG (the rehearsed config), today's planner prices the rehearsal again from the
phase marks the report kept (launch.plan.phases), so a changed planner meets an old measurement; without, the
figures the report carries (moe-plan as it was when the GPU ran) are compared.

A trainer row holding both its profiled step's time by kind of work ("breakdown": launch.bench.breakdown) and
moe-plan's step by the same kinds ("plan_breakdown": launch.plan.kinds.step_kinds) gets one line per kind: measured
ms, moe-plan ms and their ratio ("-" where moe-plan prices no such work: the optimizer step, the profile's "other"),
with torchtitan's ms per kind beside them where the result holds its row (PEER) profiled the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from launch.config.run import RunConfig
from launch.plan.compute import WORK_KINDS
from launch.plan.phases import Phase
from launch.plan.report import table

GIB = 2 ** 30
MEMORY = ("params", "grads", "optimizer", "activations")
PEER = "trainer-torchtitan"  # the `moe-bench gpu` row of torchtitan's model, profiled as ours, moe-plan not beside it


def read_results(path: str | Path) -> tuple[list[dict], list[dict], dict | None]:
    """(rehearsal reports, trainer rows, torchtitan's profiled row or None) in a result file; ValueError naming the
    file when it holds neither a report nor a trainer row."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--measure-gpu {path}: not JSON ({err})") from None
    if isinstance(doc, dict) and doc.get("kind") == "rehearsal":
        return [doc], [], None
    rows = [r for r in doc.get("rows", []) if isinstance(r, dict)] if isinstance(doc, dict) else []
    reports = [r["rehearsal"] for r in rows if isinstance(r.get("rehearsal"), dict)]
    trainers = [r for r in rows if r.get("plan_step_ms") and r.get("step_ms")]
    peer = next((r for r in rows if r.get("row") == PEER and isinstance(r.get("breakdown"), dict)), None)
    if not reports and not trainers:
        raise ValueError(f"--measure-gpu {path}: no rehearsal report and no trainer row with moe-plan's figures in it "
                         f"(give `moe-bench gpu --json` output or `moe-train --rehearse --device cuda --json` output)")
    return reports, trainers, peer


def _ratio(measured: float | None, planned: float | None) -> str:
    return f"{measured / planned:.3f}" if measured is not None and planned else "-"


def rehearsal_rows(report: dict, config: RunConfig | None = None) -> list[list[object]]:
    """Table rows (figure, measured, moe-plan, ratio) of one rehearsal report, re-planned with config when given."""
    memory, phases = report["memory"], [Phase(**p) for p in report["phases"]]
    planned_memory, comm, step = memory["planned"], report["planned_comm_s"], report["planned_step_s"]
    if config is not None:
        from launch.plan.rehearse import planned_memory as plan_memory, predicted_phases, real_device_config

        cfg = real_device_config(config, report["micro_batches"])
        planned_memory = plan_memory(cfg)[0][cfg.layout.coords(report["rank"])[0]]
        phases, comm, step = predicted_phases(cfg, report["rank"], [tuple(i) for i in report["intervals"]],
                                              report["planned_gpu"])
    rows = [[f"memory {cat} GiB", memory["measured"][cat] / GIB, planned_memory[cat] / GIB,
             _ratio(memory["measured"][cat], planned_memory[cat])] for cat in MEMORY]
    total = sum(planned_memory[cat] for cat in MEMORY)
    rows.append(["memory total GiB", sum(memory["measured"][cat] for cat in MEMORY) / GIB, total / GIB,
                 _ratio(sum(memory["measured"][cat] for cat in MEMORY), total)])
    if memory.get("device_peak") is not None:
        rows.append(["max_memory_allocated GiB", memory["device_peak"] / GIB, total / GIB,
                     _ratio(memory["device_peak"], total)])
    for p in phases:
        rows.append([f"{p.name} ms ({p.count}x)", p.seconds * 1e3, None if p.planned is None else p.planned * 1e3,
                     _ratio(p.seconds, p.planned)])
    planned_compute = sum(p.planned for p in phases if p.planned is not None and not p.inside)
    measured_compute = sum(p.seconds for p in phases if p.planned is not None and not p.inside)
    rows.append(["compute of the priced phases ms", measured_compute * 1e3, planned_compute * 1e3,
                 _ratio(measured_compute, planned_compute)])
    rows.append(["step: measured compute + planned comm ms", (report["measured_compute_s"] + comm) * 1e3,
                 step * 1e3, _ratio(report["measured_compute_s"] + comm, step)])
    return rows


def trainer_rows(row: dict) -> list[list[object]]:
    """Table rows of one `moe-bench gpu` trainer row: its step and peak memory beside moe-plan's."""
    name = row["row"]
    out = [[f"{name}: step ms", row["step_ms"], row["plan_step_ms"], _ratio(row["step_ms"], row["plan_step_ms"])]]
    if row.get("peak_memory_gib") is not None and row.get("plan_peak_gib"):
        out.append([f"{name}: peak GiB", row["peak_memory_gib"], row["plan_peak_gib"],
                    _ratio(row["peak_memory_gib"], row["plan_peak_gib"])])
    return out


def kind_rows(row: dict, peer: dict | None = None) -> list[list[object]]:
    """Table rows (kind, measured ms, moe-plan ms, measured / plan[, torchtitan ms, ours / torchtitan]) of one
    trainer row's profiled step beside moe-plan's step by kind of work, then their totals; peer: torchtitan's row
    (its profiled step's ms per kind). A kind appears where anything measured or predicted it."""
    measured, planned = row["breakdown"]["ms"], row["plan_breakdown"]
    theirs = peer["breakdown"]["ms"] if peer is not None else {}
    extra = [k for k in (*measured, *theirs) if k not in WORK_KINDS]  # the profile's "other"
    out = []
    for kind in dict.fromkeys((*WORK_KINDS, *extra)):
        if not (kind in measured or kind in theirs or planned.get(kind)):
            continue
        ours, plan = measured.get(kind), planned.get(kind)
        cells = [kind, ours, plan, _ratio(ours, plan)]
        out.append(cells + ([theirs.get(kind), _ratio(ours, theirs.get(kind))] if peer is not None else []))
    ours, plan = row["breakdown"]["total_ms"], sum(planned.values())
    total = ["total", ours, plan, _ratio(ours, plan)]
    out.append(total + ([peer["breakdown"]["total_ms"], _ratio(ours, peer["breakdown"]["total_ms"])]
                        if peer is not None else []))
    return out


def _cell(value: object) -> object:
    return f"{value:,.3f}" if isinstance(value, float) else ("-" if value is None else value)


def measure_gpu(path: str | Path, config: RunConfig | None = None) -> dict:
    """Print the ratios of every rehearsal and trainer row in the result file; return them (JSON-ready)."""
    reports, trainers, peer = read_results(path)
    out: dict[str, list] = {"rehearsals": [], "trainers": [], "kinds": []}
    for report in reports:
        rows = rehearsal_rows(report, config)
        print(f"rank {report['rank']} of {report['world_size']} on {report['device']}, {report['micro_batches']} "
              f"micro-batches; moe-plan {'re-planned now' if config is not None else 'as the report carries it'} "
              f"for {report['planned_for']}")
        print(table(["figure", "measured", "moe-plan", "measured / plan"], [[_cell(v) for v in r] for r in rows]))
        out["rehearsals"].append(rows)
    for row in trainers:
        rows = trainer_rows(row)
        print(table(["figure", "measured", "moe-plan", "measured / plan"], [[_cell(v) for v in r] for r in rows]))
        out["trainers"].append(rows)
        if isinstance(row.get("breakdown"), dict) and isinstance(row.get("plan_breakdown"), dict):
            kinds = kind_rows(row, peer)
            print(f"{row['row']}: its profiled step by kind of work ({row['breakdown'].get('measured', 'measured')}) "
                  f"beside moe-plan's step (-: moe-plan prices no such work)"
                  + (f" and {PEER}'s profiled step" if peer is not None else ""))
            header = ["kind", "measured ms", "moe-plan ms", "measured / plan"]
            print(table(header + (["torchtitan ms", "ours / torchtitan"] if peer is not None else []),
                        [[_cell(v) for v in r] for r in kinds]))
            out["kinds"].append(kinds)
    return out
