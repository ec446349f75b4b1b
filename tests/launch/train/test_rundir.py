"""Run-directory ownership and --resume semantics (issue 51, points 1 and 4): one run per directory under a lock,
another run's files never overwritten, a run id kept across resumes, retention of its own checkpoints only;
--resume refused (exit 2, each candidate named) when nothing valid is left, another model or other data refused,
metrics.jsonl rewound to the resumed step. Every case runs moe-train's main(argv) in this process; a stand-in
trainer replaces training where the refusal comes before it. One real run (a 1-rank float64 model, 6 steps,
checkpoints at 2, 4, 6) is trained once and copied per test."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.checkpoint.manifest import publish, published, verify
from launch.metrics.records import read_jsonl
from launch.parallel.spawn import RankRefusal
from launch.train.rundir import ASIDE, IDENTITY, LOCK, rewind_metrics, run_identity
from launch.train_cli import main

ROOT = Path(__file__).resolve().parents[3]
STEPS = 6


def toml_config(path: Path, corpus: str, run_dir: Path, steps: int = STEPS) -> Path:
    """A 1-rank float64 config (2 layers, 4 experts), checkpoints every 2 steps, written to path."""
    path.write_text(f"""
[model]
vocab_size = 256
hidden_size = 16
num_layers = 2
num_heads = 2
num_kv_heads = 1
max_seq_len = 16
dense_ffn_size = 32
num_experts = 4
expert_ffn_size = 8
top_k = 2
[train]
steps = {steps}
micro_batch_size = 2
seq_len = 16
warmup_steps = 2
checkpoint_every = 2
eval_batches = 0
dtype = "float64"
device = "cpu"
run_dir = "{run_dir}"
[data]
corpus = "{corpus}"
max_bytes = 20000
""")
    return path


class Stand:
    """A trainer stand-in: records the keyword arguments it was called with, returns no records."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[dict] = []
        self.fail = fail

    def __call__(self, cfg, **kwargs) -> list[dict]:
        self.calls.append(kwargs)
        if self.fail is not None:
            raise self.fail
        return []


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> tuple[Path, list[dict]]:
    """(a finished run's folder: checkpoints at steps 2, 4, 6 and metrics of steps 0-5, its records)."""
    base = tmp_path_factory.mktemp("trained")
    config = toml_config(base / "run.toml", corpus, base / "run")
    assert main(["--config", str(config), "--no-progress"]) == 0
    return base / "run", read_jsonl(base / "run" / "metrics.jsonl")


@pytest.fixture
def run(trained, corpus, tmp_path) -> tuple[Path, Path]:
    """(a copy of the trained run's folder, its config)."""
    shutil.copytree(trained[0], tmp_path / "run")
    return tmp_path / "run", toml_config(tmp_path / "run.toml", corpus, tmp_path / "run")


def moe_train(config: Path, *flags: str, trainer=None) -> int:
    return main(["--config", str(config), "--no-progress", *flags], trainer=trainer)


def refused(capsys, config: Path, *flags: str, trainer=None) -> str:
    """moe-train exits 2 with one message and no traceback, the trainer untouched; returns the message."""
    stand = trainer or Stand()
    code = moe_train(config, *flags, trainer=stand)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    if trainer is None:
        assert not stand.calls
    return err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def write_lock(run_dir: Path, host: str, pid: int, proc_start: str = "") -> Path:
    lock = run_dir / LOCK
    lock.write_text(json.dumps({"host": host, "pid": pid, "started": time.time() - 60, "proc_start": proc_start}))
    return lock


# ownership: the lock


@pytest.mark.slow  # starts the first run as a process
def test_a_second_run_into_a_held_directory_is_refused_and_the_first_finishes_untouched(corpus, tmp_path, capsys):
    config = toml_config(tmp_path / "run.toml", corpus, tmp_path / "run", steps=12)
    first = subprocess.Popen([sys.executable, "-m", "launch.train_cli", "--config", str(config), "--no-progress"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / LOCK).exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        began = time.monotonic()
        for flags in ((), ("--resume",), ("--start-over",)):
            err = refused(capsys, config, *flags)
            assert f"in use by the run of pid {first.pid} on host {socket.gethostname()}" in err, err
        assert time.monotonic() - began < 30
        assert first.poll() is None, "the first run ended before the second was refused: lengthen it"
        _, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == list(range(12))
    assert [s for s, _ in published(tmp_path / "run" / "checkpoint")] == [12, 10, 8]
    assert not (tmp_path / "run" / LOCK).exists() and not (tmp_path / "run" / ASIDE).exists()


def test_a_stale_lock_of_a_dead_process_is_named_and_taken_over(tmp_path, corpus, capsys):
    """The lock names this very pid but another start time: the process it names has gone (the pid was reused)."""
    config = toml_config(tmp_path / "run.toml", corpus, tmp_path / "run")
    (tmp_path / "run").mkdir()
    write_lock(tmp_path / "run", socket.gethostname(), os.getpid(), proc_start="1")
    stand = Stand()
    assert moe_train(config, trainer=stand) == 0
    err = capsys.readouterr().err
    assert f"names pid {os.getpid()} on host {socket.gethostname()}" in err and "no longer running" in err, err
    assert len(stand.calls) == 1 and not (tmp_path / "run" / LOCK).exists()


def test_another_hosts_lock_is_never_broken(tmp_path, corpus, capsys):
    config = toml_config(tmp_path / "run.toml", corpus, tmp_path / "run")
    (tmp_path / "run").mkdir()
    lock = write_lock(tmp_path / "run", "node-elsewhere", 4242)
    err = refused(capsys, config)
    assert "pid 4242 on host node-elsewhere" in err and f"remove {lock}" in err, err
    assert json.loads(lock.read_text())["host"] == "node-elsewhere"


def test_the_lock_goes_when_the_run_fails(tmp_path, corpus, capsys):
    config = toml_config(tmp_path / "run.toml", corpus, tmp_path / "run")
    err = refused(capsys, config, trainer=Stand(RankRefusal("shard 00000.tokens is corrupted")))
    assert "moe-train: shard 00000.tokens is corrupted" in err
    assert not (tmp_path / "run" / LOCK).exists()


# ownership: another run's files


@pytest.mark.slow  # the trained run (a few seconds, once)
def test_a_plain_run_into_another_runs_files_is_refused_and_start_over_moves_them_aside(run, capsys):
    run_dir, config = run
    before, old_id = snapshot(run_dir), run_identity(run_dir)
    err = refused(capsys, config)
    assert "3 checkpoint(s) (steps 6, 4, 2)" in err and "metrics.jsonl" in err and "--start-over" in err, err
    assert snapshot(run_dir) == before
    stand = Stand()
    assert moe_train(config, "--start-over", trainer=stand) == 0
    aside = run_dir / ASIDE / old_id
    assert f"moved the previous run's files to {aside}" in capsys.readouterr().err
    assert snapshot(aside) == {k: v for k, v in before.items() if not k.startswith("data/")}
    assert sorted(p.name for p in run_dir.iterdir()) == ["data", ASIDE, IDENTITY]
    assert run_identity(run_dir) != old_id and stand.calls == [{"metrics_out": None, "resume": False,
                                                               "require_checkpoint": True, "progress": False}]


def test_retention_deletes_only_the_checkpoints_of_its_own_run(tmp_path):
    root = tmp_path / "checkpoint"

    def save(step: int, run_id: str | None) -> None:
        tmp = root / f".step{step:08d}.tmp"
        tmp.mkdir(parents=True)
        (tmp / ".metadata").write_bytes(b"meta")
        publish(tmp, root, step, {}, keep=2, run_id=run_id)

    for step, owner in ((1, None), (2, "old"), (3, "old"), (4, "new"), (5, "new"), (6, "new")):
        save(step, owner)
    assert [s for s, _ in published(root)] == [6, 5, 3, 2, 1]  # "new" keeps 2; "old" and the id-less one stay


# --resume


def test_resume_with_no_checkpoint_is_refused_and_resume_if_possible_starts_afresh(tmp_path, corpus, capsys):
    config = toml_config(tmp_path / "run.toml", corpus, tmp_path / "run")
    err = refused(capsys, config, "--resume")
    assert f"no valid checkpoint under {tmp_path / 'run' / 'checkpoint'} (the folder does not exist)" in err, err
    stand = Stand()
    assert moe_train(config, "--resume-if-possible", trainer=stand) == 0
    assert stand.calls[0]["resume"] and not stand.calls[0]["require_checkpoint"]


@pytest.mark.slow  # the trained run (a few seconds, once)
def test_resume_names_each_refused_candidate(run, capsys):
    run_dir, config = run
    for folder in (run_dir / "checkpoint").iterdir():
        shard = next(folder.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:-10])
    err = refused(capsys, config, "--resume", "--steps", "8")
    for step in (6, 4, 2):
        assert f"step{step:08d}/__0_0.distcp has" in err and "(truncated or overwritten)" in err, err


@pytest.mark.slow  # trains (a few seconds)
def test_resume_of_bit_flipped_checkpoints_is_refused_by_the_ranks_naming_each(run, capsys):
    """Sizes intact, contents flipped: the launcher's size check passes, each rank's CRC check of what it reads
    refuses every candidate; one message names them all; nothing is written."""
    run_dir, config = run
    for folder in (run_dir / "checkpoint").iterdir():
        shard = next(folder.glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    before = snapshot(run_dir)
    code = moe_train(config, "--resume", "--steps", "8")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("moe-train: --resume: no valid checkpoint under"), last
    assert all(f"step{s:08d}/__0_0.distcp fails its CRC-32 check" in last for s in (6, 4, 2)), last
    assert snapshot(run_dir) == before


@pytest.mark.slow  # the trained run (a few seconds, once)
def test_resume_past_train_steps_says_so(run, capsys):
    err = refused(capsys, run[1], "--resume", "--steps", "5")
    assert "is at step 6, past train.steps = 5: nothing is left to train; raise --steps above 6" in err, err


@pytest.mark.slow  # the trained run (a few seconds, once)
def test_a_renamed_step_folder_is_refused_by_its_manifest(run, capsys):
    root = run[0] / "checkpoint"
    (root / "step00000006").rename(root / "step00000010")
    assert "says step 6, the folder's name step 10 (renamed?)" in verify(root / "step00000010", crc=False)
    stand = Stand()
    assert moe_train(run[1], "--resume", "--steps", "12", trainer=stand) == 0
    err = capsys.readouterr().err
    assert "checkpoint " + str(root / "step00000010") + " refused: " in err and "says step 6" in err, err
    assert len(stand.calls) == 1  # step 4 resumes


@pytest.mark.slow  # the trained run (a few seconds, once)
def test_resume_into_another_model_or_data_is_refused_naming_the_keys(run, capsys):
    config = run[1]
    err = refused(capsys, config, "--resume", "--steps", "8", "--set", "model.hidden_size=32")
    assert "saved from another model: model.hidden_size = 16 in the checkpoint, 32 here" in err, err
    err = refused(capsys, config, "--resume", "--steps", "8", "--set", "data.max_bytes=19000")
    assert "saved reading other data: data.max_bytes = 20000 in the checkpoint, 19000 here" in err, err
    assert "--allow-data-change" in err
    stand = Stand()
    assert moe_train(config, "--resume", "--steps", "8", "--set", "data.max_bytes=19000", "--set", "train.lr=0.01",
                     "--allow-data-change", trainer=stand) == 0
    err = capsys.readouterr().err
    assert "train.lr = 0.003 in the checkpoint, 0.01 here" in err and "data.max_bytes = 20000" in err, err
    assert stand.calls[0]["resume_data"] is False


@pytest.mark.slow  # trains (a few seconds)
def test_a_resume_after_a_crash_rewinds_metrics_and_continues_bitwise(run, trained, capsys):
    """The run died after logging step 5 (half a record written) but before saving step 6: the resume from step 4
    drops the records of steps 4 and 5 and the partial line, then writes steps 4 and 5 again, bitwise the same."""
    run_dir, config = run
    shutil.rmtree(run_dir / "checkpoint" / "step00000006")
    metrics = run_dir / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + b'{"step": 6, "lo')
    assert moe_train(config, "--resume") == 0
    assert "rewound to step 4 (the checkpoint resumed): 3 later or partial record(s) dropped, 4 kept" in \
        capsys.readouterr().err
    again = read_jsonl(metrics)
    assert [r["step"] for r in again] == list(range(STEPS))
    assert [r["loss"] for r in again] == [r["loss"] for r in trained[1]]


def test_rewind_keeps_the_old_file_until_the_new_one_is_whole(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    before = metrics.read_bytes()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        rewind_metrics(metrics, 2)
    assert metrics.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    monkeypatch.undo()
    rewind_metrics(metrics, 2)
    assert [r["step"] for r in read_jsonl(metrics)] == [0, 1]


# flags that would do nothing


@pytest.mark.parametrize("flags, expected", [
    (["--rank", "1"], "--rank 1 chooses the rank of a rehearsal: allowed only with --rehearse"),
    (["--device", "cpu"], "--device cpu chooses the device of a rehearsal: allowed only with --rehearse"),
    (["--rehearse", "--micro-batches", "2"], "--micro-batches 2 sets a real device's step: give --device cpu or cuda"),
    (["--resume", "--start-over"], "--start-over begins a new run, --resume continues the old one"),
    (["--resume", "--resume-if-possible"], "--resume and --resume-if-possible: give one"),
    (["--allow-data-change"], "--allow-data-change applies to a resume"),
    (["--master-port", "99999"], "--master-port 99999: allowed 0 (a free port, one node) to 65535"),
])
def test_flags_that_would_do_nothing_are_refused(tmp_path, corpus, capsys, flags, expected):
    config = toml_config(tmp_path / "run.toml", corpus, tmp_path / "run")
    with pytest.raises(SystemExit) as stop:
        moe_train(config, *flags, trainer=Stand())
    err = capsys.readouterr().err
    assert stop.value.code == 2 and expected in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags", [["--max-shard-bytes", "0", "--format", "hf"], ["--max-shard-bytes", "100"]])
def test_export_shard_size_must_be_positive_and_for_hf(tmp_path, capsys, flags):
    with pytest.raises(SystemExit) as stop:
        main(["export", str(tmp_path / "checkpoint"), str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"--max-shard-bytes {flags[1]}: allowed only with --format hf" in err, err


# verified reads


@pytest.mark.slow  # the trained run (a few seconds, once)
@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("form", ["torch", "hf"])
def test_export_of_a_damaged_step_folder_is_refused_naming_the_file(run, capsys, damage, form):
    folder = run[0] / "checkpoint" / "step00000006"
    shard = next(folder.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-64] if damage == "truncate" else data[:99] + bytes([data[99] ^ 1]) + data[100:])
    out = run[0].parent / "export"
    code = main(["export", str(folder), str(out), "--format", form])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert f"checkpoint {folder} cannot be read: {shard}" in err, err
    assert ("fails its CRC-32 check" if damage == "flip" else "(truncated or overwritten)") in err, err
    assert not out.exists()


@pytest.mark.slow  # trains (a few seconds)
def test_a_corrupted_shard_of_the_run_directorys_corpus_ends_the_resume_naming_it(run, capsys):
    run_dir, config = run
    flip = run_dir / "data" / "00000.tokens"
    data = bytearray(flip.read_bytes())
    data[10] ^= 0x01
    flip.write_bytes(bytes(data))
    err = refused(capsys, config, "--check")
    assert f"data.corpus: shard {flip} is corrupted" in err, err
    code = moe_train(config, "--resume", "--steps", "8")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"moe-train: data.corpus: shard {flip} is corrupted"), err
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(STEPS))  # nothing lost
