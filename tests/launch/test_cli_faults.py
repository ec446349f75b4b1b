"""Bad input and faults across the five CLIs (issue 51, points 4 and 5): each case runs a CLI's main(argv) in this
process and asserts the exit code (2 bad input, 1 a fault, 130 Ctrl-C), that the one message names the field, file
or line, and that no traceback is printed; for the faults, that nothing was lost (a refused prepare leaves no stub,
a run out of disk space resumes bitwise with each step once in metrics.jsonl).

Further cases of the suite: tests/launch/train/test_rundir.py (run directory, --resume, idle flags, export of
damaged checkpoints), tests/launch/data/test_verified_reads.py and tests/launch/data/test_data_cli.py."""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
from torch.distributed.checkpoint.api import CheckpointException

import launch.checkpoint.chunks as chunks_module
from launch.bench.cli import main as bench_main
from launch.data.cli import main as data_main
from launch.data.shards import MANIFEST, Prepared
from launch.data.tokenizer import BPETokenizer, load_tokenizer
from launch.errors import DiskFull, cli, describe, disk_full
from launch.metrics.dashboard.cli import main as dashboard_main
from launch.metrics.records import JsonlWriter, read_jsonl
from launch.parallel.spawn import JOINED, WorkerRefusal, _reach_node0, _Rendezvous
from launch.plan.cli import main as plan_main
from launch.train_cli import main as train_main
from tests.launch.data_helpers import SHIPPED_TOKENIZER
from tests.launch.train.test_rundir import STEPS, run, toml_config, trained  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")


def ends(capsys, code: int, expected: int, *names: str) -> str:
    """The CLI returned expected, printed no traceback, and its stderr names each of names; returns stderr."""
    err = capsys.readouterr().err
    assert code == expected, err
    assert "Traceback" not in err, err
    for name in names:
        assert name in err, (name, err)
    return err


def exits(capsys, call, expected: int, *names: str) -> str:
    """As ends, for a CLI that may also end through argparse (SystemExit)."""
    try:
        code = call()
    except SystemExit as stop:
        code = stop.code
    return ends(capsys, code, expected, *names)


# moe-data: malformed records, empty inputs, refused and interrupted prepares, streamed documents


def prepare(out: Path, *args: str, tokenizer: str = "bytes") -> int:
    return data_main(["prepare", "--tokenizer", tokenizer, "--out", str(out), "--no-progress", *args])


GOOD = json.dumps({"text": "a good document"})


@pytest.mark.parametrize("line, reason", [
    ('{"text": "broken', "not valid JSON"),
    ('{"text": 5}', "field 'text' is a number (5), not a string"),
    ('{"text": null}', "field 'text' is null"),
    ('{"body": "x"}', "the record has no --field 'text' (it has: 'body')"),
    ('{"text": ["a", "b"]}', "field 'text' is a list"),
    ('[1, 2]', "a record must be a JSON object, this is a list"),
    ('"just a string"', "a record must be a JSON object, this is a string"),
])
def test_a_malformed_record_is_refused_naming_file_and_line(tmp_path, capsys, line, reason):
    source = tmp_path / "docs.jsonl"
    source.write_text(f"{GOOD}\n{line}\n{GOOD}\n")
    err = ends(capsys, prepare(tmp_path / "out", str(source)), 2, f"moe-data: {source}:2: {reason}",
               "--skip-bad-records")
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # refused before the first shard: nothing left behind


def test_skip_bad_records_skips_and_counts_them(tmp_path, capsys):
    source = tmp_path / "docs.jsonl"
    source.write_text(f'{GOOD}\n{{"text": 5}}\n{{broken\n{GOOD}\n{{"text": null}}\n\n{GOOD}\n')
    code = prepare(tmp_path / "out", "--skip-bad-records", str(source))
    ends(capsys, code, 0, "skipped 3 bad record(s) (the first: " + f"{source}:2: field 'text' is a number")
    assert Prepared(tmp_path / "out").manifest["documents"] == 3


@pytest.mark.parametrize("name, content, flags, message", [
    ("empty.jsonl", b"", [], "is empty (0 bytes): it holds no records"),
    ("blank.jsonl", b"\n  \n\n", [], "holds no records"),
    ("empty.parquet", b"", [], "is empty (0 bytes)"),
    ("bad.jsonl", b'{"text": 1}\n{"text": null}\n', ["--skip-bad-records"],
     "hold no documents: --skip-bad-records skipped all 2"),
    ("noise.parquet", b"PAR1 not parquet at all", [], "is not a Parquet file"),
    ("noise.txt", bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)), [], "is not UTF-8 text"),
])
def test_empty_or_unreadable_inputs_are_refused(tmp_path, capsys, name, content, flags, message):
    source = tmp_path / name
    source.write_bytes(content)
    ends(capsys, prepare(tmp_path / "out", *flags, str(source)), 2, str(source), message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("values, message", [
    ([1, 2, 3], "column of input {file} holds int64, not strings"),
    (["ok", None, "ok"], "{file} row 1: field 'body' is null"),
])
def test_parquet_columns_of_the_wrong_type_or_nulls_are_named(tmp_path, capsys, values, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": values}), source)
    file = repr(str(source)) if "column" in message else str(source)
    expected = message.format(file=file)
    assert expected in ends(capsys, prepare(tmp_path / "out", "--field", "body", str(source)), 2, expected)


@pytest.mark.parametrize("flag", ["--shard-tokens", "--chunk-chars", "--num-proc"])
def test_non_positive_sizes_are_refused(tmp_path, capsys, flag):
    source = tmp_path / "docs.jsonl"
    source.write_text(GOOD + "\n")
    assert f"{flag} 0 must be >= 1" in ends(capsys, prepare(tmp_path / "out", flag, "0", str(source)), 2)


def test_an_output_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "out").write_text("mine")
    source = tmp_path / "docs.jsonl"
    source.write_text(GOOD + "\n")
    ends(capsys, prepare(tmp_path / "out", str(source)), 2, f"--out {str(tmp_path / 'out')!r} is a file")
    assert (tmp_path / "out").read_text() == "mine"


def test_the_retry_with_the_input_fixed_succeeds_after_a_refusal(tmp_path, capsys):
    """A bad record after shards were written leaves an unfinished preparation of the old input; fixing the input
    (another size and mtime: other inputs) replaces it instead of refusing the folder."""
    source = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"document number {i} " * 5}) for i in range(8)]
    source.write_text("\n".join([*lines, '{"text": 5}']) + "\n")
    small = ["--shard-tokens", "50", "--chunk-chars", "64"]  # a shard (and a tokenizer call) per document or two
    ends(capsys, prepare(tmp_path / "out", *small, str(source)), 2, f"{source}:9:")
    assert not json.loads((tmp_path / "out" / MANIFEST).read_text())["complete"]
    source.write_text("\n".join(lines) + "\n")
    ends(capsys, prepare(tmp_path / "out", *small, str(source)), 0,
         "held an unfinished preparation of other inputs", "replacing it")
    assert Prepared(tmp_path / "out").manifest["documents"] == 8


def test_ctrl_c_before_the_first_shard_leaves_nothing(tmp_path, capsys, monkeypatch):
    from launch.data import shards

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shards, "_publish", interrupted)
    source = tmp_path / "docs.jsonl"
    source.write_text(GOOD + "\n")
    ends(capsys, prepare(tmp_path / "out", str(source)), 130, "moe-data: interrupted:",
         f"{tmp_path / 'out'} was removed (nothing was written yet)")
    assert not (tmp_path / "out").exists()


def whole_and_chunked(tmp_path, tokenizer: str, texts: list[str], chunk_chars: int) -> tuple[list, list]:
    """(each text tokenised whole, the documents moe-data prepared with --chunk-chars) as lists of ids."""
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert prepare(tmp_path / "out", "--chunk-chars", str(chunk_chars), str(source), tokenizer=tokenizer) == 0
    data = Prepared(tmp_path / "out")
    stream = data.read([0], data.tokens)[0].tolist()
    bounds = [0, *np.concatenate(list(data.documents())).tolist()]
    prepared = [stream[a:b - 1] for a, b in itertools.pairwise(bounds)]
    return [ids.tolist() for ids in load_tokenizer(tokenizer).encode_batch(texts)], prepared


LONG_TEXTS = [
    "def f(x):\n    return x ** 2  # squares\n" * 40 + "naïve café 🙂 δέλτα " * 30,
    "word " * 300 + "\n\n  indented   spaces\ttabs " * 20,
    "",
    "noSpacesAtAllInThisOneLongWord" * 20,
]


@pytest.mark.parametrize("tokenizer", [str(SHIPPED_TOKENIZER), "bytes"])
def test_a_document_tokenised_in_small_chunks_has_the_ids_of_the_whole(tmp_path, tokenizer):
    """--chunk-chars 16: pieces of one character at most before the next word; the ids equal the whole text's."""
    whole, prepared = whole_and_chunked(tmp_path, tokenizer, LONG_TEXTS, 16)
    assert prepared == whole


def test_a_tokenizer_whose_cuts_are_not_exact_gets_whole_documents(tmp_path):
    """A BPE without a pre-tokenizer merges across spaces: cutting would change its ids, so the probe refuses its
    cuts and documents go whole."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.train_from_iterator([" ".join(LONG_TEXTS)] * 3, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False))
    tok.save(str(tmp_path / "nopre.json"))
    assert not BPETokenizer(tmp_path / "nopre.json").exact_cuts
    assert BPETokenizer(SHIPPED_TOKENIZER).exact_cuts
    whole, prepared = whole_and_chunked(tmp_path, str(tmp_path / "nopre.json"), LONG_TEXTS, 16)
    assert prepared == whole


def test_train_tokenizer_refuses_a_malformed_record_too(tmp_path, capsys):
    source = tmp_path / "docs.jsonl"
    source.write_text(f'{GOOD}\n{{"text": null}}\n')
    out = tmp_path / "tok.json"
    ends(capsys, data_main(["train-tokenizer", "--vocab-size", "300", "--out", str(out), str(source)]), 2,
         f"{source}:2: field 'text' is null")
    assert not out.exists()


# moe-train: paths, config keys, a full disk, a missing node


@pytest.mark.parametrize("where, message", [
    ("{tmp}", "--metrics-out {tmp} is a folder"),
    ("/sys/moe-metrics.jsonl", "--metrics-out /sys/moe-metrics.jsonl: cannot write there"),
])
def test_metrics_out_must_be_a_writable_file(tmp_path, corpus, capsys, where, message):
    if where.startswith("/sys") and os.access("/sys", os.W_OK) and not Path("/sys").is_mount():
        pytest.skip("/sys is writable here")
    config = toml_config(tmp_path / "run.toml", corpus, tmp_path / "run")
    code = train_main(["--config", str(config), "--metrics-out", where.format(tmp=tmp_path), "--no-progress"])
    ends(capsys, code, 2, message.format(tmp=tmp_path))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ("ops.rendezvous_timeout_s=0", "ops.rendezvous_timeout_s = 0 must be > 0 and finite"),
    ("ops.rendezvous_timeout_s=inf", "ops.rendezvous_timeout_s = inf must be > 0 and finite"),
    ("train.steps=0", "[train] steps = 0 must be an integer >= 1"),
    ("train.no_such_key=1", "no_such_key"),
    ("data.corpus='/nowhere/text.txt'", "data.corpus = '/nowhere/text.txt': no such file or folder"),
])
def test_bad_config_values_are_refused_naming_the_key(tmp_path, corpus, capsys, override, message):
    config = toml_config(tmp_path / "run.toml", corpus, tmp_path / "run")
    ends(capsys, train_main(["--config", str(config), "--check", "--set", override]), 2, "invalid config", message)


@pytest.mark.parametrize("content, message", [
    (None, "run.toml' does not exist"),
    (b"[model\nvocab_size = ", "run.toml' is not valid TOML: Expected ']'"),
    (bytes(range(256)) * 4, "run.toml' is not valid TOML"),
])
def test_a_missing_or_unreadable_config_file_is_named(tmp_path, capsys, content, message):
    config = tmp_path / "run.toml"
    if content is not None:
        config.write_bytes(content)
    ends(capsys, train_main(["--config", str(config), "--check"]), 2, "moe-train: invalid config", message)


def test_a_random_bytes_corpus_is_refused_by_check_naming_the_file(tmp_path, capsys):
    noise = tmp_path / "noise.txt"
    noise.write_bytes(bytes(np.random.default_rng(1).integers(0, 256, 20000, dtype=np.uint8)))
    config = toml_config(tmp_path / "run.toml", str(noise), tmp_path / "run")
    ends(capsys, train_main(["--config", str(config), "--check"]), 2, f"data.corpus file {str(noise)!r} is not "
                                                                       f"UTF-8 text")


def test_export_of_a_missing_checkpoint_is_named(tmp_path, capsys):
    ends(capsys, train_main(["export", str(tmp_path / "nowhere"), str(tmp_path / "out.pt")]), 2,
         "moe-train export:", str(tmp_path / "nowhere"))


@pytest.mark.slow  # trains (a few seconds)
def test_a_disk_full_mid_save_ends_named_and_the_run_resumes_bitwise(run, trained, capsys, monkeypatch):  # noqa: F811
    """ENOSPC while the step-4 checkpoint is written: the run ends (exit 1) naming the step folder and the bytes, no
    half-written folder stays; once space is back, --resume continues from step 2 and metrics.jsonl holds each
    step once, the losses bitwise those of the uninterrupted run."""
    run_dir, config = run
    shutil.rmtree(run_dir / "checkpoint")
    (run_dir / "metrics.jsonl").unlink()
    real = chunks_module.Writer.write_data

    def full_at_step_4(self, plan, planner):
        if "step00000004" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real(self, plan, planner)

    monkeypatch.setattr(chunks_module.Writer, "write_data", full_at_step_4)
    code = train_main(["--config", str(config), "--no-progress", "--start-over"])
    tmp = run_dir / "checkpoint" / ".step00000004.tmp"
    ends(capsys, code, 1, f"moe-train: no space left on device saving checkpoint step 4 into {tmp}: ",
         "bytes needed by this rank's tensors (the latest checkpoint, ", "step00000002, takes ", "free there")
    assert not tmp.exists() and [p.name for p in (run_dir / "checkpoint").iterdir()] == ["step00000002"]
    monkeypatch.undo()
    assert train_main(["--config", str(config), "--no-progress", "--resume"]) == 0
    again = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in again] == list(range(STEPS))
    assert [r["loss"] for r in again] == [r["loss"] for r in trained[1]]


def test_a_metrics_record_is_written_whole_or_not_at_all(tmp_path):
    """The disk fills half-way through a record: the half is cut off again (DiskFull names the file and the bytes);
    the next record, once there is space, starts on a line of its own."""
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    writer.write({"step": 0})
    before = path.read_bytes()

    class Filling:
        """The file, on a disk that takes half of the first write and nothing after."""

        def __init__(self, file):
            self.file, self.calls = file, 0

        def write(self, data):
            self.calls += 1
            if self.calls == 1:
                return self.file.write(bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.file, name)

    real, writer._file = writer._file, Filling(writer._file)
    with pytest.raises(DiskFull, match=rf"appending a metrics record to {path}: 20 bytes needed"):
        writer.write({"step": 1, "x": 1})
    assert writer._file.calls == 2 and path.read_bytes() == before
    writer._file = real
    writer.write({"step": 1})
    writer.close()
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_node_0_names_the_missing_node_while_waiting_and_after_the_timeout(capsys, monkeypatch):
    import torch.distributed as dist

    from launch.parallel import spawn

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(JOINED.format(rank=0), "1")
    store.set(JOINED.format(rank=1), "1")
    monkeypatch.setattr(spawn, "RENDEZVOUS_REPORT_S", 0.0)
    watch = _Rendezvous(store, world_size=6, nnodes=3, where="node0:1234", timeout_s=0.3)
    assert watch.poll() is None
    assert "rendezvous at node0:1234: waiting for node 1 (ranks 2-3), node 2 (ranks 4-5)" in capsys.readouterr().err
    store.set(JOINED.format(rank=4), "1")
    watch.began -= 1.0
    message = watch.poll()
    assert message.startswith("the rendezvous at node0:1234 ended after ops.rendezvous_timeout_s = 0.3 s: node 1 "
                              "(ranks 2-3), node 2 (rank 5) never joined"), message


def test_another_node_names_node_0_when_it_never_answers(tmp_path, corpus, capsys):
    """moe-train --node-rank 1 of 2 with nothing listening at --master-port: exit 1 after the timeout."""
    config = toml_config(tmp_path / "run.toml", corpus, tmp_path / "run")
    config.write_text(config.read_text().replace("micro_batch_size = 2", "micro_batch_size = 2\ngrad_accum_steps = 2")
                      + "[parallel]\ndp = 2\ngpus_per_node = 1\n[ops]\nrendezvous_timeout_s = 1\n")
    port = free_port()
    code = train_main(["--config", str(config), "--no-progress", "--nnodes", "2", "--node-rank", "1",
                       "--master-port", str(port)])
    ends(capsys, code, 1, f"the rendezvous at 127.0.0.1:{port} ended after ops.rendezvous_timeout_s = 1 s: node 0 "
                          f"never answered")
    with pytest.raises(WorkerRefusal):
        _reach_node0("127.0.0.1", port, 0.1)


# moe-plan, moe-dashboard, moe-bench


@pytest.mark.parametrize("flags, message", [
    (["--memory-gb", "inf"], "--memory-gb = inf must be a finite number"),
    (["--memory-gb", "nan"], "--memory-gb = nan must be a finite number"),
    (["--gpus-per-node", "0"], "--gpus-per-node = 0 must be >= 1"),
    (["--gpus-per-node", "-2"], "--gpus-per-node = -2 must be >= 1"),
    (["--peak-tflops", "-5", "--gpu", "h100"], "--peak-tflops = -5.0 must be > 0"),
    (["--clock", "0"], "--clock = 0.0 must be in (0, 1]"),
])
def test_moe_plan_refuses_bad_machine_figures(capsys, flags, message):
    assert message in ends(capsys, plan_main([TINY, *flags]), 2, "moe-plan: error:")


@pytest.mark.parametrize("args, code, message", [
    (["{tmp}/nowhere.toml"], 2, "nowhere.toml"),
    ([TINY, "--json", "{tmp}/missing/plan.json"], 2, "{tmp}/missing/plan.json: No such file or directory"),
    ([TINY, "--json", "{tmp}"], 2, "{tmp}: Is a directory"),
])
def test_moe_plan_names_missing_and_unwritable_files(tmp_path, capsys, args, code, message):
    assert message.format(tmp=tmp_path) in ends(capsys, plan_main([a.format(tmp=tmp_path) for a in args]), code)


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> Path:
    """A run folder with a two-record metrics.jsonl."""
    folder = tmp_path_factory.mktemp("logged")
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"schema": 2, "step": s, "loss": 1.0}) + "\n"
                                                  for s in range(2)))
    return folder


@pytest.mark.parametrize("args, message", [
    (["--out", "{tmp}/missing/dash.html"], "--out {tmp}/missing/dash.html: the folder {tmp}/missing does not exist"),
    (["--out", "{tmp}"], "--out {tmp} is a folder"),
    (["--serve", "--port", "99999"], "--port 99999: allowed 0 (any free port) to 65535"),
    (["--serve", "--port", "-1"], "--port -1: allowed 0 (any free port) to 65535"),
    (["--refresh", "0"], "--refresh = 0.0 must be > 0"),
])
def test_moe_dashboard_refuses_bad_paths_and_ports(tmp_path, capsys, logged, args, message):
    assert message.format(tmp=tmp_path) in exits(
        capsys, lambda: dashboard_main([str(logged), *[a.format(tmp=tmp_path) for a in args]]), 2)


def test_moe_dashboard_names_a_missing_run(tmp_path, capsys):
    assert str(tmp_path / "nowhere") in exits(
        capsys, lambda: dashboard_main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "d.html")]), 2)


def test_moe_bench_names_an_unknown_suite(capsys):
    assert "moe-bench: unknown suite 'nosuch'" in ends(capsys, bench_main(["nosuch"]), 2)


# the one place that turns errors into messages


@pytest.mark.parametrize("error, code, words", [
    (ValueError("train.lr = -1 must be > 0"), 2, "train.lr = -1 must be > 0"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/y"), 2, "/x/y: No such file or directory"),
    (PermissionError(errno.EACCES, "Permission denied", "/ro/m.jsonl"), 2, "/ro/m.jsonl: Permission denied"),
    (OSError(errno.ENOSPC, "No space left on device", "/full/f"), 1, "no space left on device writing /full/f: "),
    (OSError(errno.ECONNREFUSED, "Connection refused"), 1, "Connection refused"),
    (WorkerRefusal("rank 1 refused", 2), 2, "rank 1 refused"),
])
def test_known_errors_become_one_line_and_an_exit_code(error, code, words):
    message, got = describe(error)
    assert got == code and words in message and "\n" not in message


def test_a_bug_keeps_its_traceback_and_ctrl_c_exits_130(capsys):
    assert describe(RuntimeError("a bug")) is None

    @cli("moe-x")
    def buggy(argv):
        raise KeyError(argv)

    @cli("moe-x")
    def stopped(argv):
        raise KeyboardInterrupt

    with pytest.raises(KeyError):
        buggy("a")
    assert stopped("a") == 130 and "moe-x: interrupted" in capsys.readouterr().err


def test_enospc_inside_a_checkpoint_exception_is_recognised():
    inner = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("save failed", {0: (inner, None)})
    assert disk_full(wrapped) and not disk_full(CheckpointException("x", {0: (ValueError("no"), None)}))
