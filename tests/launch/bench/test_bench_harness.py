"""The shared timing harness (launch.bench.harness): rounds alternate the contenders, warm-up rounds are not
timed, ratios are taken round by round (a machine's drift cancels out of them), and every suite's JSON rows
carry the harness's fields for their timed metrics."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from launch.bench.cli import available
from launch.bench.harness import Timing, check_row, fields, ratio_fields, rounds, slowest, timed_metric

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_rounds_alternate_the_contenders_and_time_only_after_the_warmup():
    calls: list[str] = []
    clock = iter(range(1, 100))
    contenders = {name: (lambda n=name: calls.append(n) or float(next(clock))) for name in "ABC"}
    timed = rounds(contenders, warmup=1, repeats=2)
    assert calls == list("ABCABCABC")
    assert timed["A"]["time"].samples == [4.0, 7.0] and timed["C"]["time"].samples == [6.0, 9.0]
    calls.clear()
    rounds(contenders, warmup=0, repeats=3, rotate=True)
    assert calls == list("ABCBCACAB")


def test_a_call_may_report_several_quantities_or_be_timed_by_the_harness():
    timed = rounds({"x": lambda: {"step": 0.5, "opt": 0.125}, "y": lambda: None}, warmup=0, repeats=2)
    assert timed["x"]["step"].samples == [0.5, 0.5] and timed["x"]["opt"].samples == [0.125, 0.125]
    assert all(0 <= s < 1 for s in timed["y"]["time"].samples)
    with pytest.raises(ValueError, match="repeats = 0 must be >= 1"):
        rounds({"x": lambda: None}, warmup=0, repeats=0)


def test_median_spread_and_the_ratio_round_by_round_cancel_a_drift():
    drift = [1.0, 1.3, 0.8, 1.6, 1.1]  # the machine slows and speeds up between rounds
    a, b = Timing([0.2 * d for d in drift]), Timing([0.5 * d for d in drift])
    assert a.median == pytest.approx(0.2 * statistics.median(drift)) and a.repeats == 5
    q1, _, q3 = statistics.quantiles(a.samples, n=4, method="inclusive")
    assert a.spread == pytest.approx((q3 - q1) / a.median) and a.spread > 0.2
    ratio = b / a
    assert ratio.median == pytest.approx(2.5) and ratio.spread == pytest.approx(0.0, abs=1e-12)
    assert (a + b).samples == pytest.approx([0.7 * d for d in drift])
    assert Timing([3.0]).spread == 0.0
    with pytest.raises(ValueError, match="same rounds"):
        Timing([1.0]) / Timing([1.0, 2.0])
    assert slowest([Timing([1.0, 5.0]), Timing([2.0, 3.0])]).samples == [2.0, 5.0]


def test_row_fields_and_their_check():
    row = {**fields("step_ms", Timing([0.010, 0.012, 0.011])), **ratio_fields("vs_peer", Timing([1.0, 1.2, 1.1]))}
    assert row["step_ms"] == pytest.approx(11.0) and row["repeats"] == 3 and "step_ms_spread" in row
    assert row["vs_peer"] == pytest.approx(1.1) and "vs_peer_spread" in row
    assert check_row(row, {"step_ms": "lower"}) == []
    assert check_row({"step_ms": 3.0}, {"step_ms": "lower", "tflops": "higher"}) == ["step_ms_spread", "repeats"]
    assert check_row({"tflops": None, "step_ms": None}, {"step_ms": "lower"}) == []  # nothing timed (no GPU)
    assert check_row({"tokens_per_s": 5.0, "load_s": 1.0}, {"tokens_per_s": "higher", "load_s": "lower"}) == [
        "load_s_spread", "repeats"]  # a rate per second is not a time


TINY = {  # the smallest run of every timed suite
    "optim": ["--layers", "1", "--hidden", "16", "--batch", "4", "--steps", "2", "--warmup", "0", "--adamw",
              "for-loop", "--quiet"],
    "dispatch": ["--nproc", "2", "--gpus-per-node", "1", "--tokens", "8", "--hidden", "16", "--experts", "4",
                 "--top-k", "2", "--repeats", "2", "--warmup", "0", "--comm", "gloo", "--quiet"],
    "pipeline": ["--layers", "4", "--hidden", "16", "--batch", "8", "--chunks", "4", "--steps", "2", "--warmup", "0",
                 "--only", "1 process", "ours DualPipeV", "torch DualPipeV", "--quiet"],
    "kernels": [],
    "clock": ["--seconds", "1", "--rest", "0"],
    "train": ["--config", "{tmp}/train.toml", "--rounds", "2", "--steps", "1", "--warmup", "0", "--only",
              "pp=2 dualpipev"],
    "tp": ["--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--seq", "16",
           "--steps", "2", "--warmup", "0", "--quiet"],
    "checkpoint": ["--config", str(CONFIGS / "tiny-1proc.toml"), "--as-is", "--repeats", "2"],
    "cp": ["--seq", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--steps", "2", "--warmup", "0",
           "--quiet"],
    "data": ["--mbytes", "0.1", "--steps", "2", "--seq-len", "32", "--dp", "2", "--quiet"],
    "layer": ["--ep", "1", "--rounds", "1", "--repeats", "2", "--warmup", "0", "--peers", "", "--quiet"],
    "imbalance": ["--ranks", "2", "--experts", "4", "--tokens", "16", "--hidden", "8", "--ffn", "8", "--spares", "0",
                  "1", "--steps", "2", "--warmup", "0", "--quiet"],
}
UNTIMED = {"compare", "gpu"}  # compare reads other suites' files; gpu needs CUDA (its CPU checks: test_bench_gpu.py)
# the train suite's config ({tmp} is the test's tmp_path): the 1-process default on short sequences and little text
TRAIN_CONFIG = f'base = "{CONFIGS / "tiny-1proc.toml"}"\n[train]\nseq_len = 32\n[data]\nmax_bytes = 20000\n'


def test_every_registered_suite_has_a_tiny_run_here():
    assert set(available()) - UNTIMED == set(TINY), "add the new suite's smallest run to TINY"


# One process runs every suite's tiny run in turn, as `moe-bench SUITE ... --json FILE` would (kernels first: it sets
# Triton's interpreter up before anything imports a kernel); each suite's stderr follows a line "=== SUITE", and its
# exit code (1 for an exception, its traceback on stderr) is the last line of its own section.
DRIVER = """
import json, sys, traceback
from launch.bench.cli import main
for suite, args in json.loads(sys.argv[1]).items():
    print("=== " + suite, file=sys.stderr, flush=True)
    try:
        code = main([suite, *args])
    except BaseException:
        traceback.print_exc()
        code = 1
    print(f"exit {code}", file=sys.stderr, flush=True)
"""
GROUP_S = 1500  # the whole group's bound: the sum of the suites' tiny runs, several ranks' start-ups among them


@pytest.fixture(scope="module")
def suite_runs(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """suite -> (exit code, its stderr, its JSON file): the tiny run of every suite in TINY, all in one process
    (each process of its own paid the interpreter's and torch's start-up again, ~3 s of the ~10 s a suite took)."""
    tmp = tmp_path_factory.mktemp("bench")
    (tmp / "train.toml").write_text(TRAIN_CONFIG)
    order = ["kernels", *sorted(set(TINY) - {"kernels"})]
    runs = {suite: [*(arg.replace("{tmp}", str(tmp)) for arg in TINY[suite]), "--json", str(tmp / f"{suite}.json")]
            for suite in order}
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(runs)], check=False,
                          capture_output=True, text=True, timeout=GROUP_S)
    parts = re.split(r"^=== (\w+)\n", done.stderr, flags=re.MULTILINE)
    sections = dict(zip(parts[1::2], parts[2::2]))
    out = {}
    for suite in order:
        text = sections.get(suite, f"(the driver never started it: exit {done.returncode})\n" + done.stderr[-2000:])
        last = text.rstrip().rsplit("\n", 1)[-1]
        out[suite] = (int(last[5:]) if last.startswith("exit ") else -1, text, tmp / f"{suite}.json")
    return out


@pytest.mark.timeout(GROUP_S + 60)
@pytest.mark.parametrize("suite", sorted(TINY))
def test_every_suite_json_carries_the_harness_fields(suite, suite_runs):
    code, stderr, path = suite_runs[suite]
    assert code == 0, stderr[-2000:]
    doc = json.loads(path.read_text())
    assert doc["rows"]
    for row in doc["rows"]:
        assert check_row(row, doc["metrics"]) == [], (suite, row)
    timed = [m for m in doc["metrics"] if timed_metric(m)]
    if suite != "kernels":  # CPU: correctness only, nothing timed
        assert timed and all(row.get("repeats", 0) >= 2 for row in doc["rows"] if row.get(timed[0]) is not None)
