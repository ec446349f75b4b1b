"""Sweep plots: one metric per row of panels against the first swept option, a line per contender (plotly HTML,
and a PNG of that page through the project's headless Chromium when one is installed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from launch.bench.sweep import point_label
from launch.metrics.dashboard.browser import screenshot


def _line_styles(contenders: list[str]) -> dict[str, dict[str, str]]:
    """Plotly line style per contender: colour by family (all words but the last), dash by variant (the last)."""
    families = list(dict.fromkeys(name.rsplit(" ", 1)[0] for name in contenders))
    variants = list(dict.fromkeys(name.rsplit(" ", 1)[-1] for name in contenders))
    dashes = ("solid", "dash", "dot", "dashdot")
    return {name: {"color": f"hsl({360 * families.index(name.rsplit(' ', 1)[0]) // len(families)},70%,42%)",
                   "dash": dashes[variants.index(name.rsplit(" ", 1)[-1]) % len(dashes)]} for name in contenders}


def sweep_figure(rows: list[dict], x_axis: str, metrics: list[tuple[str, str]], title: str) -> go.Figure:
    """Rows carry "point" (the swept values, in sweep order), "contender" and the metrics; x_axis is the first
    swept option, its values in the order given.

    One column of panels per combination of the other swept options, one row per (metric key, axis title).
    A contender named "FAMILY VARIANT" (e.g. "flat fp8") gets its family's colour and its variant's dash.
    """
    others = sorted({point_label({k: v for k, v in r["point"].items() if k != x_axis}) for r in rows})
    fig = make_subplots(rows=len(metrics), cols=len(others), shared_xaxes=True, column_titles=others,
                        vertical_spacing=0.08)
    styles = _line_styles(list(dict.fromkeys(r["contender"] for r in rows)))
    for col, other in enumerate(others, start=1):
        for row, (key, axis_title) in enumerate(metrics, start=1):
            for name, line in styles.items():
                mine = [r for r in rows if r["contender"] == name
                        and point_label({k: v for k, v in r["point"].items() if k != x_axis}) == other]
                fig.add_trace(go.Scatter(x=[r["point"][x_axis] for r in mine], y=[r[key] for r in mine],
                                         mode="lines+markers", name=name, legendgroup=name, line=line,
                                         showlegend=row == 1 and col == 1), row=row, col=col)
            fig.update_yaxes(title_text=axis_title if col == 1 else None, row=row, col=col)
        fig.update_xaxes(title_text=x_axis, type="category", row=len(metrics), col=col)
    fig.update_layout(title=title, height=320 * len(metrics) + 80, width=max(700, 480 * len(others)),
                      template="plotly_white")
    return fig


def write_figure(fig: go.Figure, base: Path) -> tuple[Path, Path | None, str | None]:
    """(HTML path, PNG path or None, why no PNG): base.html always (plotly.js inlined: opens offline), base.png
    rendered from it by headless Chromium (Debian: apt-get install chromium; or set $MOE_CHROMIUM)."""
    html, png = base.with_suffix(".html"), base.with_suffix(".png")
    fig.write_html(html, include_plotlyjs=True, config={"responsive": False})
    try:
        screenshot(html.resolve().as_uri(), png, width=int(fig.layout.width) + 40, height=int(fig.layout.height) + 40)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        return html, None, f"no PNG ({str(err).splitlines()[0][:200]})"
    return html, png, None
