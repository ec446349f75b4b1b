"""`moe-bench kernels` on CPU: checks every op's accuracy, says timings need a GPU, writes the JSON rows."""

import json

from launch.bench_cli import main as moe_bench


def test_cpu_run_checks_correctness_and_writes_null_timings(tmp_path, capsys):
    path = tmp_path / "kernels.json"
    assert moe_bench(["kernels", "--json", str(path)]) == 0
    assert "timings need a GPU" in capsys.readouterr().out
    rows = json.loads(path.read_text())
    assert {(r["op"], r["backend"]) for r in rows} == {(op, b) for op in ("forward", "dgrad", "wgrad")
                                                       for b in ("torch", "triton")}
    for row in rows:
        assert {"op", "shape", "tflops", "peer", "peer_tflops"} <= set(row)
        assert row["tflops"] is None and row["peer_tflops"] is None
        assert 0 < row["calc_diff"] < 1e-3
        assert row["shape"] == {"group_sizes": [0, 130, 1, 200, 0, 67], "N": 128, "K": 256}
