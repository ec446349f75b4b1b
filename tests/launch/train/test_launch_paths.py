"""The default 4-process config through moe-train's own spawn, torchrun and mpiexec gives identical losses;
a launcher world unlike the layout is an error on every rank; a killed rank ends the whole run and is named.

These run the real trainer as a user would (the README's commands), on a config that is
configs/tiny.toml (its `base`) with fewer steps and less text. moe-train's node flags and SLURM's
variables are read in tests/launch/train/test_launch_input.py; several nodes forming one world are run in
tests/launch/parallel/test_spawn.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.parallel.spawn import parent_pid

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[3]
WORLD = 4  # configs/tiny.toml: pp=2 x dp=2
STEPS = 10
MOE_TRAIN = [sys.executable, "-m", "launch.train_cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def short_default_config(tmp_path: Path, steps: int) -> str:
    """configs/tiny.toml with `steps` steps, no evaluation and 200 kB of text."""
    path = tmp_path / "tiny-short.toml"
    path.write_text(f'base = "{ROOT / "configs" / "tiny.toml"}"\n[train]\nsteps = {steps}\neval_batches = 0\n'
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


def test_own_spawn_torchrun_and_mpiexec_give_identical_losses(tmp_path):
    config = short_default_config(tmp_path, STEPS)
    moe_train = shutil.which("moe-train")
    assert moe_train, "moe-train is not on PATH: pip install -e ."
    launches = {
        "moe-train": [moe_train, "--config", config],
        "torchrun": [*TORCHRUN, "--nproc-per-node", str(WORLD), "--master-port", str(_free_port()),
                     "-m", "launch.train_cli", "--config", config],
        "mpiexec": [shutil.which("mpiexec"), "-n", str(WORLD), moe_train, "--config", config],
    }
    procs = {name: _start(command, tmp_path, name) for name, command in launches.items()}  # side by side
    outputs = {name: (proc.wait(timeout=600), (tmp_path / f"{name}.log").read_text()) for name, proc in procs.items()}
    assert all(code == 0 for code, _ in outputs.values()), {n: out[-3000:] for n, (code, out) in outputs.items() if code}
    for name, (_, output) in outputs.items():  # rank 0 of one 4-rank world prints the layout, once
        assert output.count("layout: pp=2 dp=2 tp=1 ep=2 on 4 node(s) of 1") == 1, (name, output[-3000:])
    losses = {}
    for name in launches:
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(STEPS)), name
        losses[name] = [r["lm_loss"] for r in records]
    assert losses["torchrun"] == losses["moe-train"] and losses["mpiexec"] == losses["moe-train"], losses
    # it learns: halfway through the 20-step warmup the default's BPE loss is ~9% below ln 512 (6.25 -> 5.69)
    assert losses["moe-train"][-1] < 0.95 * losses["moe-train"][0]


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
