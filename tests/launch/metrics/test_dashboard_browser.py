"""The dashboard in headless Chromium: a real tiny training run beside a synthetic schema-2 run renders every
chart (checked through the DOM), the console stays silent, a screenshot and the --png views are saved.

Skipped only where no Chromium is installed (.ci/run installs the Debian `chromium` package and sets
MOE_REQUIRE_BROWSER=1, which turns a missing browser into a failure)."""

from __future__ import annotations

import json
import os
import re
import threading
from html.parser import HTMLParser
from pathlib import Path

import pytest

from launch.config.run import build_config
from launch.metrics.dashboard.browser import console_lines, dump_dom, find_chromium, screenshot
from launch.metrics.dashboard.cli import load_runs, main
from launch.metrics.dashboard.page import build_html, view_ids
from launch.metrics.dashboard.serve import make_server
from launch.metrics.dashboard.synthetic import SyntheticShape, synthetic_records
from launch.metrics.records import JsonlWriter
from launch.train.loop import train

pytestmark = pytest.mark.slow  # starts Chromium (tests/conftest.py)

try:
    find_chromium()
except RuntimeError as missing:
    if os.environ.get("MOE_REQUIRE_BROWSER") == "1":
        raise
    pytestmark = pytest.mark.skip(reason=f"no browser installed: {missing}")

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Charts(HTMLParser):
    """Per chart div (by id): its plotly SVG layers, scatter/bar traces and heatmap images."""

    def __init__(self, ids: list[str]) -> None:
        super().__init__()
        self.ids, self.open, self.found = set(ids), [], {}

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = dict(attrs)
        if attrs.get("id") in self.ids:
            self.found[attrs["id"]] = {"svg": 0, "scatter": 0, "bars": 0, "heatmap": 0}
            self.open.append([attrs["id"], 0])
        classes = (attrs.get("class") or "").split()
        for chart, _ in self.open:
            counts = self.found[chart]
            counts["svg"] += "main-svg" in classes
            counts["scatter"] += classes[:2] == ["trace", "scatter"]
            counts["bars"] += classes[:2] == ["trace", "bars"]
            counts["heatmap"] += tag == "g" and "hm" in classes
        if tag not in VOID:
            for entry in self.open:
                entry[1] += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        for entry in self.open:
            entry[1] -= 1
        self.open = [entry for entry in self.open if entry[1] > 0]


def render(html_file: Path) -> tuple[str, dict, list[str]]:
    """(the page's status, chart contents by id, console lines) after headless Chromium loaded the page."""
    dom, log = dump_dom(html_file.resolve().as_uri())
    status = re.search(r'<body[^>]*data-status="(\w+)"', dom)
    errors = re.search(r'<pre id="dashboard-errors">(.*?)</pre>', dom, re.S)
    charts = Charts(ids=CHART_IDS)
    charts.feed(dom)
    problems = console_lines(log) + ([errors.group(1)] if errors and errors.group(1) else [])
    return status.group(1) if status else "missing", charts.found, problems


CHART_IDS = ["curves"] + [f"{view}-{run}" for view in ("imbalance", "load", "bias", "balance", "stragglers", "traffic",
                                                        "ranks")
                          for run in (0, 1)]


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> tuple[str, str]:
    """A real 6-step single-process training run and a small synthetic schema-2 run with every section."""
    root = tmp_path_factory.mktemp("runs")
    model = {"hidden_size": 64, "num_layers": 3, "first_k_dense": 1, "num_heads": 4, "num_kv_heads": 2,
             "dense_ffn_size": 128, "num_experts": 4, "expert_ffn_size": 32, "top_k": 2, "max_seq_len": 64,
             "capacity_factor": 1.0, "aux_loss_coeff": 0.01, "bias_update_rate": 0.001}
    settings = {"steps": 6, "micro_batch_size": 4, "seq_len": 32, "warmup_steps": 2, "eval_every": 3,
                "run_dir": str(root / "tiny")}
    train(build_config({"model": model, "train": settings, "data": {"max_bytes": 100_000}}), progress=False)
    writer = JsonlWriter(root / "synthetic" / "metrics.jsonl")
    for record in synthetic_records(SyntheticShape(steps=60, num_layers=5, first_k_dense=1, num_experts=16, ep=4,
                                                   gpus_per_node=2, world=8)):
        writer.write(record)
    writer.close()
    return str(root / "tiny"), str(root / "synthetic")


def test_two_runs_render_every_chart_without_console_output(run_dirs, tmp_path):
    runs = load_runs(list(run_dirs))
    assert view_ids(runs) and set(view_ids(runs)) == set(CHART_IDS)
    page = tmp_path / "dashboard.html"
    page.write_text(build_html(runs))
    status, charts, problems = render(page)
    assert problems == [] and status == "rendered"
    assert set(charts) == set(CHART_IDS) and all(c["svg"] >= 1 for c in charts.values()), charts
    assert charts["curves"]["scatter"] >= 9  # tiny: loss, eval loss, lr, grad norm, tokens/s; synthetic: 4 of them
    for index, run_dir in enumerate(run_dirs):  # a view with data in the run's last record has its plot
        last = json.loads((Path(run_dir) / "metrics.jsonl").read_text().splitlines()[-1])
        moe, traffic = last.get("moe", {}), last.get("traffic", {})
        assert charts[f"imbalance-{index}"]["heatmap"] == 2
        assert charts[f"load-{index}"]["heatmap"] == ("load" in moe)
        assert charts[f"bias-{index}"]["scatter"] == (moe["num_experts"] if "bias" in moe else 0)
        ep_ranks = traffic["rank_bytes"]["shape"][0] if "rank_bytes" in traffic else 0
        assert charts[f"traffic-{index}"]["heatmap"] == (2 if ep_ranks > 1 else 0)  # node and rank matrices
        assert charts[f"ranks-{index}"]["bars"] == len([k for k in last.get("ranks", {}) if k != "expert_rows"])
        assert charts[f"stragglers-{index}"]["heatmap"] == 1  # the rank x layer rows over steps
        assert charts[f"stragglers-{index}"]["scatter"] == len(last["stragglers"]["busiest_over_mean"]) + 1
    assert charts["load-1"]["heatmap"] and charts["traffic-1"]["heatmap"] and charts["ranks-1"]["bars"] == 2
    artifacts = Path(os.environ.get("MOE_TEST_ARTIFACTS", tmp_path))
    shot = screenshot(page.resolve().as_uri(), artifacts / "dashboard-two-runs.png", width=1400, height=2600)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
    print(f"screenshot: {shot}")


def test_a_missing_chart_or_a_throwing_page_fails_the_check(run_dirs, tmp_path):
    page = build_html(load_runs([run_dirs[1]]))
    broken = tmp_path / "broken.html"
    broken.write_text(page.replace('<div class="chart" id="traffic-0"></div>', "")
                      .replace("</body>", "<script>null.boom()</script></body>"))
    status, charts, problems = render(broken)
    assert "traffic-0" not in charts and status == "error"
    assert any("null" in line for line in problems)


def test_png_export_of_every_view_and_the_check(run_dirs, tmp_path, capsys):
    out = tmp_path / "png"
    assert main([run_dirs[0], "--out", str(tmp_path / "tiny.html"), "--png", str(out), "--check"]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(f"{view}.png" for view in view_ids(load_runs([run_dirs[0]])))
    assert all((out / name).read_bytes()[:4] == b"\x89PNG" for name in files)
    printed = capsys.readouterr().out
    assert f"wrote {len(files)} PNGs" in printed and f"headless Chromium: rendered, {len(files)} charts" in printed


def test_served_page_reloads_itself_when_the_run_grows(run_dirs, tmp_path):
    lines = (Path(run_dirs[0]) / "metrics.jsonl").read_text().splitlines(keepends=True)
    live = tmp_path / "metrics.jsonl"
    live.write_text("".join(lines[:3]))
    built = []

    def load_and_grow(dirs: list[str]) -> list:
        """The first page shows 3 records; then the run writes a fourth."""
        runs = load_runs(dirs)
        built.append(runs[0].records)
        if len(built) == 1:
            with live.open("a") as handle:
                handle.write(lines[3])
        return runs

    server = make_server([str(tmp_path)], 0, 0.2, load_and_grow)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:  # 5 s of page time: the page polls /version every 0.2 s, sees the change and reloads
        dom, log = dump_dom(f"http://127.0.0.1:{server.server_port}/", "--virtual-time-budget=5000")
    finally:
        server.shutdown()
        server.server_close()
    assert built == [3, 4] and console_lines(log) == []
    assert re.search(r'<div class="summary">[^<]*: 4 records, steps 0\.\.3', dom) and 'data-status="rendered"' in dom
