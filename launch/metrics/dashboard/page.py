"""One self-contained HTML page (plotly.js inlined, no network) showing one or more runs."""

from __future__ import annotations

import html
import json
from importlib import resources

from plotly.offline import get_plotlyjs

from launch.metrics.dashboard.figures import (balance_figure, curves_figure, imbalance_figure, layer_arrays, ranks_figure,
                                      stragglers_figure, traffic_figure)
from launch.metrics.dashboard.runs import Run

PER_RUN_VIEWS = (("imbalance", imbalance_figure), ("balance", balance_figure), ("stragglers", stragglers_figure),
                 ("traffic", traffic_figure), ("ranks", ranks_figure))
LAYER_VIEWS = ("load", "bias")

ERROR_TRAP = """
window.dashboardErrors = [];
function dashboardError(text) {
  window.dashboardErrors.push(text);
  if (document.body) document.body.dataset.status = "error";
  const pre = document.getElementById("dashboard-errors");
  if (pre) pre.textContent = window.dashboardErrors.join("\\n");
}
window.addEventListener("error", e => dashboardError("error: " + (e.message || e)));
window.addEventListener("unhandledrejection", e => dashboardError("unhandled rejection: " + e.reason));
const consoleError = console.error;
console.error = function (...args) {
  dashboardError("console.error: " + args.join(" "));
  consoleError.apply(console, args);
};
"""

STYLE = """
body { font-family: sans-serif; margin: 12px 20px; color: #222; }
.runs { display: grid; gap: 8px; }
.chart { min-height: 200px; border: 1px solid #eee; }
.notes { background: #fff6d5; padding: 4px 8px; margin: 4px 0; }
h2 { font-size: 15px; margin: 18px 0 6px; }
#dashboard-errors:empty { display: none; }
#dashboard-errors { color: #a00; }
body.single-view h1, body.single-view h2, body.single-view .notes, body.single-view .controls,
body.single-view .summary { display: none; }
body.single-view .runs { grid-template-columns: 1fr !important; }
"""


def view_ids(runs: list[Run]) -> list[str]:
    """Ids of every chart on the page (one element each), in page order."""
    per_run = [name for name, _ in PER_RUN_VIEWS[:1]] + list(LAYER_VIEWS) + [name for name, _ in PER_RUN_VIEWS[1:]]
    return ["curves"] + [f"{name}-{index}" for name in per_run for index in range(len(runs))]


def page_data(runs: list[Run], live_seconds: float = 0, version: str = "") -> dict:
    """Everything the page's script draws: finished figures and the per-layer arrays behind the layer selector."""
    charts = [{"id": "curves", "figure": curves_figure(runs)}]
    for name, build in PER_RUN_VIEWS:
        charts += [{"id": f"{name}-{index}", "figure": build(run)} for index, run in enumerate(runs)]
    return {"charts": charts, "live": live_seconds, "version": version,
            "runs": [{"name": run.name, "layer_arrays": layer_arrays(run)} for run in runs]}


def _section(title: str, name: str, runs: list[Run]) -> str:
    cells = "".join(f'<div class="chart" id="{name}-{index}"></div>' for index in range(len(runs)))
    return (f'<h2>{html.escape(title)}</h2><div class="runs" style="grid-template-columns: repeat({len(runs)}, 1fr)">'
            f"{cells}</div>")


def build_html(runs: list[Run], live_seconds: float = 0, version: str = "") -> str:
    """The dashboard page of runs (side by side when several); live_seconds > 0 polls a server for updates."""
    data = json.dumps(page_data(runs, live_seconds, version), separators=(",", ":")).replace("</", "<\\/")
    layers = max(run.num_layers for run in runs)
    options = "".join(f'<option value="{i}">MoE layer {i}</option>' for i in range(max(layers, 1)))
    notes = "".join(f'<div class="notes">{html.escape(run.name)}: {html.escape(note)}</div>'
                    for run in runs for note in run.notes)
    names = ", ".join(html.escape(run.name) for run in runs)
    summary = "; ".join(f"{html.escape(run.name)}: {run.records} records, steps {run.first_step}..{run.last_step}"
                        for run in runs)
    script = resources.files("launch.metrics.dashboard").joinpath("page.js").read_text()
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>MoE dashboard: {names}</title>
<script>{ERROR_TRAP}</script>
<script>{get_plotlyjs()}</script>
<style>{STYLE}</style></head>
<body data-status="loading">
<h1>MoE dashboard: {names}</h1>
<div class="summary">{summary}</div>
{notes}
<pre id="dashboard-errors"></pre>
<div class="chart" id="curves"></div>
{_section("Imbalance and dead experts per MoE layer", "imbalance", runs)}
<div class="controls"><label>Layer for the per-expert views: <select id="layer">{options}</select></label></div>
{_section("Expert load over steps (selected layer)", "load", runs)}
{_section("Expert-bias trajectories (selected layer)", "bias", runs)}
{_section("Balance losses and dropped slots", "balance", runs)}
{_section("Routing stragglers: rows per EP rank and layer, straggler share", "stragglers", runs)}
{_section("Dispatch traffic", "traffic", runs)}
{_section("Per rank: peak memory and pipeline idle", "ranks", runs)}
<script type="application/json" id="dashboard-data">{data}</script>
<script>{script}</script>
</body></html>
"""
