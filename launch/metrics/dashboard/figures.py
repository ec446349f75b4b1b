"""Plotly figures of the dashboard's views, as JSON-ready dicts (arrays as base64 typed arrays)."""

from __future__ import annotations

import base64
import json

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from launch.metrics.dashboard.runs import Run

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
BASE_LAYOUT = {"template": go.layout.Template(), "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
               "font": {"size": 11}}
CURVE_CELLS = {"lm_loss": (1, 1), "eval_lm_loss": (1, 1), "lr": (1, 2), "grad_norm": (2, 1), "tokens_per_s": (2, 2)}
"""Subplot (row, column) of each scalar in the training-curves view."""


def as_dict(figure: go.Figure) -> dict:
    """A figure as the plain dict plotly.js takes (numpy arrays become base64 typed arrays)."""
    return json.loads(figure.to_json())


def typed_array(values: np.ndarray) -> dict:
    """A float32 array in plotly.js's typed-array form (base64 bytes, dtype, shape)."""
    array = np.ascontiguousarray(values, dtype="<f4")
    return {"dtype": "f4", "bdata": base64.b64encode(array.tobytes()).decode(),
            "shape": ", ".join(map(str, array.shape))}


def empty_figure(title: str, message: str) -> dict:
    """A chart that says what is missing instead of plotting it."""
    figure = go.Figure(layout={**BASE_LAYOUT, "title": title, "height": 220,
                               "xaxis": {"visible": False}, "yaxis": {"visible": False}})
    figure.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    return as_dict(figure)


def curves_figure(runs: list[Run]) -> dict:
    """Loss (with eval), LR, grad norm and tokens/s over steps, every run overlaid."""
    figure = make_subplots(rows=2, cols=2, subplot_titles=("LM loss (dashed: eval)", "learning rate",
                                                           "grad norm", "tokens/s"), vertical_spacing=0.14)
    for index, run in enumerate(runs):
        color = COLORS[index % len(COLORS)]
        for key, (row, col) in CURVE_CELLS.items():
            if key not in run.scalars:
                continue
            steps, values = run.scalars[key].series()
            figure.add_trace(go.Scatter(x=steps.astype(np.float32), y=values.astype(np.float32), mode="lines",
                                        name=f"{run.name}: {key}", legendgroup=run.name,
                                        line={"color": color, "dash": "dash" if key.startswith("eval") else "solid"}),
                             row=row, col=col)
    figure.update_layout(**BASE_LAYOUT, title="training curves", height=520, legend={"orientation": "h"})
    return as_dict(figure)


def imbalance_figure(run: Run) -> dict:
    """Per layer over steps: max/mean load and dead experts (heatmaps, layers x steps)."""
    if "max_over_mean" not in run.layers:
        return empty_figure(f"{run.name}: imbalance", "no per-layer expert-load figures in this run's metrics")
    figure = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                           subplot_titles=("max/mean expert load", "dead experts"))
    for row, (name, scale, floor) in enumerate((("max_over_mean", "Reds", 1.0), ("dead", "Greys", 0.0)), 1):
        if name not in run.layers:
            continue
        steps, values = run.layers[name].series()
        top = max(float(np.nanmax(values, initial=floor)), floor + 1.0)  # a flat series keeps a readable scale
        figure.add_trace(go.Heatmap(z=values.T.astype(np.float32), x=steps.astype(np.float32), colorscale=scale,
                                    zmin=floor, zmax=top, colorbar={"len": 0.45, "y": 0.78 if row == 1 else 0.22},
                                    hovertemplate="step %{x:.0f}<br>MoE layer %{y}<br>%{z:.3f}<extra></extra>"),
                         row=row, col=1)
        figure.update_yaxes(title_text="MoE layer", dtick=_dtick(run.num_layers), row=row, col=1)
    figure.update_layout(**BASE_LAYOUT, title=f"{run.name}: imbalance and dead experts", height=460)
    return as_dict(figure)


def stragglers_figure(run: Run) -> dict:
    """Rows each EP rank's experts received over their layer's mean (heatmap over steps, one row per MoE layer
    and EP rank), the busiest rank's largest share of one exchange per layer, and the straggler share of the step."""
    if run.position_rows is None:
        return empty_figure(f"{run.name}: stragglers", "no per-rank expert rows in this run's metrics")
    figure = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06, row_heights=[0.6, 0.2, 0.2],
                           subplot_titles=("rows per EP rank / layer mean (y: MoE layer . EP rank)",
                                           "busiest rank / mean, worst exchange (per layer)",
                                           "straggler share of the step"))
    steps, values = run.position_rows.series()  # [bins, layers, ep]
    bins, layers, ep = values.shape
    labels = [f"{layer}.{rank}" for layer in range(layers) for rank in range(ep)]
    top = max(float(np.nanmax(values, initial=1.0)), 1.5)
    figure.add_trace(go.Heatmap(z=values.reshape(bins, layers * ep).T.astype(np.float32), x=steps.astype(np.float32),
                                y=labels, colorscale="Reds", zmin=0.0, zmax=top, colorbar={"len": 0.55, "y": 0.72},
                                hovertemplate="step %{x:.0f}<br>layer.rank %{y}<br>%{z:.3f}<extra></extra>"),
                     row=1, col=1)
    if "busiest_over_mean" in run.layers:
        steps_b, busiest = run.layers["busiest_over_mean"].series()
        for layer in range(busiest.shape[1]):
            figure.add_trace(go.Scatter(x=steps_b.astype(np.float32), y=busiest[:, layer].astype(np.float32),
                                        mode="lines", name=f"layer {layer}"), row=2, col=1)
    if "straggler_share" in run.scalars:
        steps_s, share = run.scalars["straggler_share"].series()
        figure.add_trace(go.Scatter(x=steps_s.astype(np.float32), y=share.astype(np.float32), mode="lines",
                                    name="straggler share", line={"color": "black"}), row=3, col=1)
    figure.update_layout(**BASE_LAYOUT, title=f"{run.name}: routing stragglers", height=620, showlegend=False)
    return as_dict(figure)


def balance_figure(run: Run) -> dict:
    """Balance losses by kind (mean over layers, unweighted) and dropped slots (sum over layers) over steps."""
    dropped = run.layers.get("dropped") or run.scalars.get("dropped_tokens")
    if not run.losses and dropped is None:
        return empty_figure(f"{run.name}: balance losses", "no balance losses or dropped slots in this run's metrics")
    figure = make_subplots(rows=1, cols=2, subplot_titles=("balance losses (unweighted, mean over layers)",
                                                           "dropped slots (all layers)"))
    for kind, bins in sorted(run.losses.items()):
        steps, values = bins.series()
        figure.add_trace(go.Scatter(x=steps.astype(np.float32), y=np.nanmean(values, axis=1).astype(np.float32),
                                    mode="lines", name=kind), row=1, col=1)
    if dropped is not None:
        steps, values = dropped.series()
        total = values.sum(axis=1) if values.ndim == 2 else values
        figure.add_trace(go.Scatter(x=steps.astype(np.float32), y=total.astype(np.float32), mode="lines",
                                    name="dropped"), row=1, col=2)
    figure.update_layout(**BASE_LAYOUT, title=f"{run.name}: balance", height=300)
    return as_dict(figure)


def traffic_figure(run: Run) -> dict:
    """Bytes sent node to node and rank to rank, summed over the run (heatmaps, sender rows)."""
    if run.rank_bytes is None:
        return empty_figure(f"{run.name}: traffic", "no dispatch traffic in this run's metrics")
    if len(run.rank_bytes) == 1:
        return empty_figure(f"{run.name}: traffic", "one EP rank: no dispatch traffic between ranks")
    figure = make_subplots(rows=1, cols=2, subplot_titles=("node to node (bytes)", "rank to rank (bytes)"))
    for col, matrix in enumerate((run.node_bytes, run.rank_bytes), 1):
        figure.add_trace(go.Heatmap(z=matrix.astype(np.float64), colorscale="Blues", showscale=col == 2,
                                    hovertemplate="from %{y} to %{x}<br>%{z:.3s}B<extra></extra>"), row=1, col=col)
        figure.update_xaxes(title_text="to", dtick=_dtick(len(matrix)), row=1, col=col)
        figure.update_yaxes(title_text="from", dtick=_dtick(len(matrix)), autorange="reversed", row=1, col=col)
    figure.update_layout(**BASE_LAYOUT, title=f"{run.name}: dispatch traffic (whole run)", height=360)
    return as_dict(figure)


def ranks_figure(run: Run) -> dict:
    """Peak memory (largest seen) and pipeline idle fraction (latest step) per rank."""
    if not run.ranks:
        return empty_figure(f"{run.name}: ranks", "no per-rank memory or pipeline idle in this run's metrics")
    figure = make_subplots(rows=1, cols=2, subplot_titles=("peak memory (GiB)", "pipeline idle (fraction of step)"))
    for col, (key, scale) in enumerate((("peak_memory_bytes", 2**-30), ("pipeline_idle_fraction", 1.0)), 1):
        values = run.ranks.get(key)
        if values is not None:
            figure.add_trace(go.Bar(x=np.arange(len(values)), y=(values * scale).astype(np.float32), name=key),
                             row=1, col=col)
            figure.update_xaxes(dtick=_dtick(len(values)), row=1, col=col)
        figure.update_xaxes(title_text="rank", row=1, col=col)
    figure.update_layout(**BASE_LAYOUT, title=f"{run.name}: per rank", height=300, showlegend=False)
    return as_dict(figure)


def _dtick(count: int) -> int | None:
    """A tick per rank or node while they are few, plotly's own spacing beyond."""
    return 1 if count <= 32 else None


def layer_arrays(run: Run) -> dict:
    """Per-layer load/mean [experts x bins] and bias [bins x experts] for the page's layer selector."""
    out: dict = {"experts": run.num_experts}
    for key, bins, transpose in (("load", run.load, True), ("bias", run.bias, False)):
        if bins is None:
            continue
        steps, values = bins.series()
        out[key] = {"steps": typed_array(steps),
                    "layers": [typed_array(v.T if transpose else v) for v in values.transpose(1, 0, 2)]}
    return out
