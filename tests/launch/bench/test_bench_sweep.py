"""`moe-bench dispatch --sweep` over two options: a correct row per (point, contender), JSON, HTML and PNG."""

from __future__ import annotations

import json
import pytest

from launch.bench.dispatch import main
from launch.metrics.dashboard.browser import find_chromium

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

CONTENDERS = 8


def test_sweep_over_two_options_writes_json_html_and_png(tmp_path, capsys):
    path = tmp_path / "sweep.json"
    assert main(["--nproc", "2", "--gpus-per-node", "1", "--hidden", "128", "--experts", "4", "--repeats", "1",
                 "--warmup", "0", "--comm", "gloo", "--quiet", "--sweep", "tokens=8,16", "top-k=1,2",
                 "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["header"]["command"].startswith("moe-bench dispatch --nproc 2")
    rows = doc["rows"]
    points = [{"tokens": t, "top-k": k} for t in ("8", "16") for k in ("1", "2")]
    assert [r["point"] for r in rows] == [p for p in points for _ in range(CONTENDERS)]
    for r in rows:
        assert (r["tokens"], r["top_k"]) == (int(r["point"]["tokens"]), int(r["point"]["top-k"]))
        assert r["correct"] is True and r["algbw_gbps"] > 0 and r["bytes_per_token"] > 0
    html = (tmp_path / "sweep.html").read_text().replace("\\u002f", "/")  # plotly's JSON escapes '/'
    assert "dispatch GB/s" in html and "bytes per token" in html and "per-expert bf16" in html
    try:
        find_chromium()
    except RuntimeError as err:
        pytest.skip(f"no PNG export here: {err}")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(tmp_path / "sweep.png") in capsys.readouterr().out
