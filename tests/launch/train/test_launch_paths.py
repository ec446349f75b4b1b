"""The shipped default config through moe-train's own spawn, torchrun and mpiexec gives identical losses, learns
within 200 steps and tracks its 1-process twin; a launcher world unlike the layout is an error on every rank; a killed
rank ends the whole run and is named.

These run the real trainer as a user would (the README's commands): configs/tiny.toml as shipped, its BPE shards
prepared into each run directory, launched the three ways side by side (moe-train's run of 200 steps is also the
learning check; torchrun's and mpiexec's stop after 10 steps) beside configs/tiny-1proc.toml for 16 steps, and for
the refusals and the kill configs/tiny.toml (its `base`) with less text. moe-train's node flags and SLURM's
variables are read in tests/launch/train/test_launch_input.py; several nodes forming one world are run in
tests/launch/parallel/test_spawn.py.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from launch.checkpoint.manifest import latest_valid, step_folder
from launch.config.run import load_config
from launch.data.shards import Prepared
from launch.data.tokenizer import load_tokenizer
from launch.metrics.records import read_jsonl
from launch.parallel.spawn import parent_pid

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[3]
WORLD = 4  # configs/tiny.toml: pp=2 x dp=2
TINY = ROOT / "configs" / "tiny.toml"
TWIN = ROOT / "configs" / "tiny-1proc.toml"  # the same model, data and global batch on one process
TWIN_STEPS = 16  # the twin's run, inside the 20-step warmup (whose rates do not depend on train.steps), before
# step 18's batch of the shipped data: a spike (grad norm 62, clipped) that amplifies float32 ordering differences
# ~300-fold (4e-7 at step 16, 2e-3 at 18, 3e-5 at 19)
LAUNCHERS = ("moe-train", "torchrun", "mpiexec")
LEARN_STEPS = 200  # moe-train's run: the learning check (a run of 120 steps, its cosine decay over 120, ends at 3.90)
STEPS = 10  # torchrun's and mpiexec's runs: inside the 20-step warmup, whose rates do not depend on train.steps
LAUNCHES_S = 850  # the three launches side by side, moe-train's 200 steps the longest (~160 s on 2 cores)
MOE_TRAIN = [sys.executable, "-m", "launch.train_cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def short_default_config(tmp_path: Path, steps: int) -> str:
    """configs/tiny.toml with `steps` steps, no evaluation and 200 kB of text."""
    path = tmp_path / "tiny-short.toml"
    path.write_text(f'base = "{TINY}"\n[train]\nsteps = {steps}\neval_batches = 0\n'
                    "[data]\nmax_bytes = 200000\n")
    return str(path)


def _env() -> dict[str, str]:
    """This environment without a rendezvous address, one thread per rank on every path (equal float32 sums)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(command: list[str], tmp_path: Path, name: str) -> subprocess.Popen:
    """Start one launch of the config; its run dir and metrics file are its own, its output goes to NAME.log."""
    args = ["--run-dir", str(tmp_path / name), "--metrics-out", str(tmp_path / f"{name}.jsonl"), "--no-progress"]
    with (tmp_path / f"{name}.log").open("w") as log:  # the child keeps its own copy of the file
        return subprocess.Popen([*command, *args], cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)


def unigram_entropy(folder: Path) -> float:
    """Entropy (nats) of the prepared tokens' unigram distribution: the loss of a model that ignores context."""
    tokens = np.concatenate([np.fromfile(folder / f"{s['name']}.tokens", dtype="<u2")
                             for s in Prepared(folder).manifest["shards"]])
    p = np.bincount(tokens) / tokens.size
    return float(-(p[p > 0] * np.log(p[p > 0])).sum())


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> tuple[Path, dict[str, tuple[int, str, list[dict]]]]:
    """(the launches' folder, name -> (exit code, output, metric records)): configs/tiny.toml as shipped, started
    side by side by moe-train's own spawn (LEARN_STEPS steps), torchrun and mpiexec (STEPS steps), and "one process",
    configs/tiny-1proc.toml by moe-train (TWIN_STEPS steps); each run dir is the folder's NAME, each metrics file
    NAME.jsonl."""
    tmp_path = tmp_path_factory.mktemp("launches")
    moe_train = shutil.which("moe-train")
    assert moe_train, "moe-train is not on PATH: pip install -e ."
    launches = {
        "moe-train": [moe_train, "--config", str(TINY), "--steps", str(LEARN_STEPS)],
        "torchrun": [*TORCHRUN, "--nproc-per-node", str(WORLD), "--master-port", str(_free_port()),
                     "-m", "launch.train_cli", "--config", str(TINY), "--steps", str(STEPS)],
        "mpiexec": [shutil.which("mpiexec"), "-n", str(WORLD), moe_train, "--config", str(TINY), "--steps", str(STEPS)],
        "one process": [moe_train, "--config", str(TWIN), "--steps", str(TWIN_STEPS)],
    }
    procs = {name: _start(command, tmp_path, name) for name, command in launches.items()}  # side by side
    out = {}
    for name, proc in procs.items():
        code = proc.wait(timeout=LAUNCHES_S)
        metrics = tmp_path / f"{name}.jsonl"
        out[name] = (code, (tmp_path / f"{name}.log").read_text(), read_jsonl(metrics) if metrics.exists() else [])
    return tmp_path, out


@pytest.mark.timeout(LAUNCHES_S + 50)
def test_own_spawn_torchrun_and_mpiexec_give_identical_losses(launches):
    outputs = {name: launches[1][name] for name in LAUNCHERS}
    assert all(code == 0 for code, _, _ in outputs.values()), {n: out[-3000:] for n, (code, out, _) in outputs.items()
                                                               if code}
    for name, (_, output, _) in outputs.items():  # rank 0 of one 4-rank world prints the layout, once
        assert output.count("layout: pp=2 dp=2 tp=1 ep=2 on 4 node(s) of 1") == 1, (name, output[-3000:])
    losses = {}
    for name, (_, _, records) in outputs.items():
        assert [r["step"] for r in records] == list(range(LEARN_STEPS if name == "moe-train" else STEPS)), name
        losses[name] = [r["lm_loss"] for r in records[:STEPS]]
    assert losses["torchrun"] == losses["moe-train"] and losses["mpiexec"] == losses["moe-train"], losses
    # it learns: halfway through the 20-step warmup the default's BPE loss is ~9% below ln 512 (6.25 -> 5.69)
    assert losses["moe-train"][-1] < 0.95 * losses["moe-train"][0]


@pytest.mark.timeout(LAUNCHES_S + 50)
def test_the_default_layout_tracks_its_one_process_twin_in_float32(launches):
    """The shipped 4-process default (DualPipeV x DP x hierarchical EP) and configs/tiny-1proc.toml agree within 1e-4
    (relative) over the first TWIN_STEPS steps: float32 sums in other orders on the same batches, measured at most
    9e-8 apart (was tests/launch/train/test_train.py's own 4-process and 1-process runs of 20 steps on less text)."""
    code, output, twin = launches[1]["one process"]
    assert code == 0, output[-3000:]
    default = launches[1]["moe-train"][2][:TWIN_STEPS]
    assert [r["step"] for r in twin] == [r["step"] for r in default] == list(range(TWIN_STEPS))
    for a, b in zip(default, twin):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-4), a["step"]


@pytest.mark.timeout(LAUNCHES_S + 50)
def test_tiny_config_cuts_lm_loss_by_40_percent_in_200_steps(launches):
    """From ln(vocab) (6.24 for the shipped 512-id BPE) the mean LM loss of the last 10 of 200 steps falls by
    40% (3.74): over a nat below what the tokens' unigram statistics alone give, so the model uses context.
    (Was tests/launch/train/test_tiny_default.py, its own CLI run of the same 200 steps.)"""
    folder, outputs = launches
    code, output, records = outputs["moe-train"]
    assert code == 0, output[-3000:]
    assert [r["step"] for r in records] == list(range(LEARN_STEPS))
    cfg = load_config(TINY)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    assert tokenizer.vocab_size == cfg.model.vocab_size == 512
    data = Prepared(folder / "moe-train" / "data", tokenizer.digest)  # the run read BPE shards of the shipped tokenizer
    assert records[0]["lm_loss"] == pytest.approx(math.log(512), abs=0.1)
    late = float(np.mean([r["lm_loss"] for r in records[-10:]]))
    assert late <= 0.6 * math.log(512) and late <= unigram_entropy(data.folder) - 1
    root = folder / "moe-train" / "checkpoint"
    assert latest_valid(root) == step_folder(root, LEARN_STEPS)


@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_a_launcher_world_unlike_the_layout_is_an_error_on_every_rank(tmp_path, launcher):
    start = ([*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(_free_port()), "-m", "launch.train_cli"]
             if launcher == "torchrun" else [shutil.which("mpiexec"), "-n", "2", *MOE_TRAIN])
    result = subprocess.run([*start, "--config", str(ROOT / "configs" / "tiny.toml"), "--run-dir",
                             str(tmp_path / "run"), "--no-progress"], cwd=ROOT, env=_env(), capture_output=True,
                            text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "parallel.pp x dp x cp x tp = 2 x 2 x 1 x 1 = 4" in output, output[-3000:]
    for rank in (0, 1):  # neither launcher stops a rank before it printed its refusal
        assert f"{launcher} started 2 processes (this is rank {rank})" in output, output[-3000:]
    assert "layout:" not in output and not (tmp_path / "run").exists()


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """The ranks moe-train started: rank -> pid (a rank's stdout is its log file rank{r}.out; its parent is the
    launcher's fork server, or the launcher itself under spawn)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = parent_pid(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    family = {launcher_pid} | {pid for pid, parent in parents.items() if parent == launcher_pid}
    pids = {}
    for pid, parent in parents.items():
        try:
            log = os.readlink(f"/proc/{pid}/fd/1") if parent in family else ""
        except OSError:
            continue
        if Path(log).name.startswith("rank") and log.endswith(".out"):
            pids[int(Path(log).name[4:-4])] = pid
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_killing_one_rank_mid_run_ends_every_process_and_names_the_rank(tmp_path):
    victim = 2  # the second pipeline rank: its peers wait on it in pipeline, DP and EP collectives
    launcher = _start([*MOE_TRAIN, "--config", short_default_config(tmp_path, 100_000)], tmp_path, "run")
    metrics = tmp_path / "run.jsonl"
    start_by = time.monotonic() + 600
    try:
        while launcher.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < start_by, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)  # two steps written: every rank is inside the training loop
        pids = rank_pids(launcher.pid)
        assert launcher.poll() is None and sorted(pids) == list(range(WORLD)), (tmp_path / "run.log").read_text()
        os.kill(pids[victim], signal.SIGKILL)
        code = launcher.wait(timeout=60)
    finally:
        launcher.kill()
    output = (tmp_path / "run.log").read_text()
    assert code == 1, output[-3000:]
    assert f"rank {victim} died with exit code -9 (SIGKILL)" in output, output[-3000:]
    deadline = time.monotonic() + 10  # the launcher has reaped its ranks; allow /proc to catch up
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids.values() if _alive(p)]
