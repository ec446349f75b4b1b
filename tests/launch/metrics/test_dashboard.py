"""moe-dashboard without a browser: binned series against numpy means of the records, bad input, the page's
size at DeepSeek-V3 scale, and --serve rebuilding the page while a run writes."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from html.parser import HTMLParser

import numpy as np
import pytest

from launch.metrics.dashboard.cli import main
from launch.metrics.dashboard.page import build_html, page_data, view_ids
from launch.metrics.dashboard.runs import RunError, load_run
from launch.metrics.dashboard.serve import make_server
from launch.metrics.dashboard.synthetic import SyntheticShape, synthetic_records
from launch.metrics.records import JsonlWriter, moe_layer_metrics, step_record, traffic_metrics

EXPERTS = 4


def loads_of(step: int) -> np.ndarray:
    """Per-expert loads of two MoE layers at a step (expert 3 of layer 0 dead from step 5 on)."""
    return np.array([[step + 1, 2, 3, 0 if step >= 5 else 4], [4, 4, 4, 4 + step]], dtype=np.int64)


def records(steps: int) -> list[dict]:
    out = []
    for step in range(steps):
        moe = moe_layer_metrics(loads_of(step), np.full((2, EXPERTS), 0.01 * step), [step % 3, 0],
                                [{"z": 0.1 * step}, {"z": 0.2 * step}])
        traffic = traffic_metrics([[0, step, 1, 2], [3, 0, 4, 5], [6, 7, 0, 8], [9, 10, 11, 0]], gpus_per_node=2)
        out.append(step_record(step, {"loss": 5.0 - 0.1 * step, "lr": 1e-3, "grad_norm": 1.0 + step}, moe, traffic))
    return out


def write_run(folder, recs: list[dict], tail: str = "") -> str:
    writer = JsonlWriter(folder / "metrics.jsonl")
    for record in recs:
        writer.write(record)
    writer.close()
    if tail:
        with (folder / "metrics.jsonl").open("a") as handle:
            handle.write(tail)
    return str(folder)


def test_bins_are_the_mean_of_their_records(tmp_path):
    recs = records(20)
    run = load_run(write_run(tmp_path, recs), line_points=5, heat_bytes=3 * 2 * EXPERTS * 4)
    steps, loss = run.scalars["loss"].series()
    assert steps.tolist() == [1.5, 5.5, 9.5, 13.5, 17.5]  # 20 steps in 5 bins of 4
    assert loss == pytest.approx([np.mean([r["loss"] for r in recs[i:i + 4]]) for i in range(0, 20, 4)])
    steps, load = run.load.series()  # 3 bins of 7 steps: load / mean of each layer, averaged over the bin
    ratios = [loads_of(s) / loads_of(s).mean(axis=1, keepdims=True) for s in range(20)]
    assert steps.tolist() == [3.0, 10.0, 16.5]
    assert load == pytest.approx(np.stack([np.mean(ratios[i:i + 7], axis=0) for i in (0, 7, 14)]))
    _, dead = run.layers["dead"].series()
    assert dead[:, 0].tolist() == [0.0, 0.75, 1.0, 1.0, 1.0] and dead[:, 1].tolist() == [0.0] * 5
    assert run.rank_bytes.tolist() == (np.array([[0, 0, 1, 2], [3, 0, 4, 5], [6, 7, 0, 8], [9, 10, 11, 0]]) * 20
                                       + np.array([[0, sum(range(20)), 0, 0]] + [[0] * 4] * 3)).tolist()
    _, z = run.losses["z"].series()
    assert z[0] == pytest.approx([0.1 * 1.5, 0.2 * 1.5])
    assert run.notes == []


def test_bad_input_gives_a_message_or_a_partial_view(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "x.html")]) == 2
    assert "no metrics.jsonl in this run directory" in capsys.readouterr().err
    (tmp_path / "half").mkdir()
    write_run(tmp_path / "half", [], tail='{"step": 0, "lo')
    assert main([str(tmp_path / "half"), "--out", str(tmp_path / "x.html")]) == 2
    assert "no readable metrics records yet (1 malformed lines)" in capsys.readouterr().err

    (tmp_path / "live").mkdir()
    live = write_run(tmp_path / "live", records(3), tail='{"schema": 2, "step": 3, "moe": {"load": {"dty')
    assert main([live, "--out", str(tmp_path / "live.html")]) == 0
    out = capsys.readouterr().out
    assert "live: 3 records" in out and "the last line (record 4) is incomplete" in out

    (tmp_path / "old").mkdir()
    old = [{"step": s, "loss": 3.0, "expert_load_max_over_mean": [1.5, 2.0], "dead_experts": [0, 1]} for s in range(4)]
    run = load_run(write_run(tmp_path / "old", old))
    assert run.layers["max_over_mean"].series()[1].tolist() == [[1.5, 2.0]] * 4 and run.load is None
    assert any("schema 1" in note and "per-expert loads" in note for note in run.notes)
    data = page_data([run])
    charts = {chart["id"]: chart["figure"] for chart in data["charts"]}
    assert charts["imbalance-0"]["data"] and not charts["traffic-0"]["data"]  # traffic: a 'missing' chart
    assert "no dispatch traffic" in charts["traffic-0"]["layout"]["annotations"][0]["text"]
    (tmp_path / "odd").mkdir()
    odd = [*records(2), {"schema": 2, "step": 2, "moe": {"load": {"dtype": "int32", "shape": [3], "base64": "AA"}}},
           {"schema": 2, "step": 3, "loss": 9.0, "moe": {"max_over_mean": ["high"]}}, *records(5)[4:]]
    run = load_run(write_run(tmp_path / "odd", odd))
    assert run.records == 3 and "2 malformed lines left out (first: record 3)" in run.notes
    assert run.scalars["loss"].series()[1].tolist() == [5.0, 4.9, 4.6]  # nothing of the bad records kept
    (tmp_path / "new").mkdir()
    run = load_run(write_run(tmp_path / "new", [{**r, "schema": 3} for r in records(2)]))
    assert run.records == 2 and any("newer schema 3" in note for note in run.notes)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        assert main([live, "--serve", "--port", str(taken.getsockname()[1])]) == 2
    assert "cannot serve on port" in capsys.readouterr().err


class ResourceTags(HTMLParser):
    """Counts <script> tags and collects those that would load something (src / href attributes)."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts, self.external = 0, []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.scripts += tag == "script"
        self.external += [(tag, name, value) for name, value in attrs if name in ("src", "href")]


def test_page_is_self_contained_and_lays_runs_side_by_side(tmp_path):
    runs = [load_run(write_run(tmp_path, records(6)), name="a"), load_run(str(tmp_path), name="b")]
    page = build_html(runs)
    tags = ResourceTags()
    tags.feed(page)
    assert tags.external == [] and tags.scripts == 4  # error trap, plotly.js, data, page script: all inline
    for view in view_ids(runs):
        assert f'id="{view}"' in page
    assert {"load-0", "load-1", "traffic-0", "traffic-1"} <= set(view_ids(runs))
    assert 'grid-template-columns: repeat(2, 1fr)' in page


def test_deepseek_v3_scale_page_stays_under_20_mb(tmp_path):
    shape = SyntheticShape()  # 61 layers (58 MoE) x 256 experts, 20,000 steps; every 200th step written
    write_run(tmp_path, list(synthetic_records(shape, every=200)))
    run = load_run(str(tmp_path))
    assert run.load.series()[1].shape[1:] == (58, 256) and run.last_step == 19_800
    html = build_html([run])
    assert len(html.encode()) < 20 * 2**20
    # the binned heatmaps stay within their byte budget whatever the run's length
    assert len(run.load.sums) * 58 * 256 * 4 <= run.heat_bytes and len(run.bias.sums) * 58 * 256 * 4 <= run.bias_bytes


def test_serve_rebuilds_the_page_when_the_run_grows(tmp_path):
    from launch.metrics.dashboard.cli import load_runs

    run_dir = write_run(tmp_path, records(3))
    server = make_server([run_dir], 0, 0.5, load_runs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}/"
    try:
        first, version = urllib.request.urlopen(base).read().decode(), urllib.request.urlopen(base + "version").read()
        assert "3 records" in first and '"live":0.5' in first
        with (tmp_path / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(records(4)[3]) + "\n")
        assert urllib.request.urlopen(base + "version").read() != version
        assert "4 records" in urllib.request.urlopen(base).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(RunError):
        load_run(str(tmp_path / "nothing"))
