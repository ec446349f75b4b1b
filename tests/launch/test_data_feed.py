"""Data per rank: the token file is written once and memory-mapped, the index-only sampler gives every
layout the same global batches, resumes bitwise, reads only what is touched, and keeps memory flat."""

import json
import multiprocessing
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import launch.data as data
from launch.config import build_config
from launch.data import ByteTokenizer, DataFeed, MicroBatch, RowPermutation, token_file

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def write_corpus(folder: Path, docs: int = 13, seed: int = 0) -> Path:
    """A folder of small text files (non-ASCII characters and CRLF line ends included)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    words = ["alpha", "beta", "gämma", "δέλτα", "epsilon", "zeta\r\n", "eta\n", "θ", "🙂"]
    for i in range(docs):
        (folder / f"doc{i:02d}.txt").write_bytes(" ".join(rng.choice(words) for _ in range(40 + 7 * i)).encode())
    return folder


def config(tmp_path: Path, corpus: Path, dp: int = 1, **train):
    settings = {"micro_batch_size": 3, "grad_accum_steps": 4, "seq_len": 15, "seed": 0,
                "run_dir": str(tmp_path / "run"), **train}
    return build_config({"train": settings, "parallel": {"dp": dp},
                         "data": {"corpus": str(corpus), "max_bytes": 1_000_000, "eval_fraction": 0.1}})


def global_batch(feeds: list[DataFeed]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of every DP rank's feed, their micro-batches concatenated in rank order."""
    micro = [mb for feed in feeds for mb in feed.next_step()]
    return torch.cat([mb.inputs for mb in micro]), torch.cat([mb.labels for mb in micro])


@pytest.fixture
def reads(monkeypatch):
    """Row indices of every read from a token file, in order."""
    seen: list[np.ndarray] = []
    real = data._read_rows

    def counted(tokens, rows):
        seen.append(np.array(rows))
        return real(tokens, rows)

    monkeypatch.setattr(data, "_read_rows", counted)
    return seen


def test_token_file_holds_the_documents_joined_by_eos_cut_at_max_bytes(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    texts = [open(f, encoding="utf-8").read() for f in data.corpus_files(str(corpus))]  # universal newlines
    stream = b"".join(t.encode("utf-8") + b"\0" for t in texts)
    assert b"\r" not in stream and len(stream) > len(texts[0]) + 100
    monkeypatch.setattr(data, "READ_CHARS", 5)  # pieces split CRLF pairs and multi-byte characters
    for max_bytes in (10**6, len(stream) - 1, len(texts[0].encode()) + 1, 100):
        path, count = token_file(str(corpus), max_bytes, tmp_path / f"data{max_bytes}")
        tokens = np.fromfile(path, dtype=np.uint16)
        assert count == tokens.size == min(max_bytes, len(stream))
        assert tokens.tolist() == list(stream[:max_bytes])
        assert json.loads((path.parent / "tokens.json").read_text())["tokens"] == count
    assert ByteTokenizer().decode(tokens.tolist()) == stream[:100].decode("utf-8", errors="replace")


def test_token_file_is_reused_and_rebuilt_when_its_sources_change(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    folder = tmp_path / "run" / "data"
    path, count = token_file(str(corpus), 10**6, folder)
    first = path.stat()
    again, same = token_file(str(corpus), 10**6, folder)
    assert (again, same) == (path, count)
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # not rewritten

    feed = DataFeed(config(tmp_path, corpus), 0, CPU)  # the trainer's feeds reuse it too
    assert path.stat().st_ino == first.st_ino and feed.rows == (count - int(count * 0.1)) // 16

    (corpus / "doc03.txt").write_text("changed")  # the corpus changed: refused, rebuilt
    path, changed = token_file(str(corpus), 10**6, folder)
    assert path.stat().st_ino != first.st_ino and changed != count
    assert list(np.fromfile(path, dtype=np.uint16)).count(0) == 13

    stat = path.stat()
    token_file(str(corpus), 500, folder)  # another max_bytes: rebuilt
    assert path.stat().st_ino != stat.st_ino and path.stat().st_size == 1000

    path.write_bytes(path.read_bytes()[:-2])  # a damaged file (size != the sidecar's count) is not used
    assert token_file(str(corpus), 500, folder)[1] == 500 and path.stat().st_size == 1000
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def _build(args: tuple[str, str]) -> tuple[int, bytes]:
    path, count = token_file(*args[:1], 10**6, args[1])
    return count, path.read_bytes()


def test_racing_builders_agree(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        results = pool.map(_build, [(str(corpus), str(tmp_path / "data"))] * 3)
    assert len({r for r in results}) == 1
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["tokens.json", "tokens.lock", "tokens.u16"]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 16, 17, 100, 1000, 4097])
def test_permutation_is_a_bijection(size):
    for seed, epoch in ((0, 0), (1, 0), (0, 7)):
        order = RowPermutation(size, seed, epoch)(np.arange(size))
        assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(size))
        assert order[size // 2:].tolist() == RowPermutation(size, seed, epoch)(np.arange(size // 2, size)).tolist()


def test_permutation_depends_on_seed_and_epoch_and_is_fixed():
    base = RowPermutation(1000, 0, 0)(np.arange(1000))
    assert base.tolist() != RowPermutation(1000, 1, 0)(np.arange(1000)).tolist()
    assert base.tolist() != RowPermutation(1000, 0, 1)(np.arange(1000)).tolist()
    assert base.tolist() != list(range(1000))
    # pure integer arithmetic: the same on every platform and numpy; these numbers must never change
    assert RowPermutation(10, 0, 0)(np.arange(10)).tolist() == [9, 2, 4, 7, 3, 1, 8, 5, 0, 6]


def test_every_layout_sees_the_same_global_batches(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    feeds = {dp: [DataFeed(config(tmp_path, corpus, dp), d, CPU) for d in range(dp)] for dp in (1, 2, 4)}
    rows, batch = feeds[1][0].rows, 3
    per_epoch = rows // batch  # micro-batches per epoch; epochs end mid-step
    assert per_epoch % 4 and rows % batch
    steps = 2 * per_epoch // 4 + 2
    for _ in range(steps):
        want = global_batch(feeds[1])
        assert (want[0][:, 1:] == want[1][:, :-1]).all() and want[0].shape == (12, 15)
        for dp in (2, 4):
            got = global_batch(feeds[dp])
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert feeds[1][0].epoch == feeds[4][3].epoch == 2


def test_an_epoch_visits_every_row_once(tmp_path, reads):
    corpus = write_corpus(tmp_path / "corpus")
    feed = DataFeed(config(tmp_path, corpus, grad_accum_steps=1), 0, CPU)
    per_epoch = feed.rows // 3
    for epoch in range(2):
        for _ in range(per_epoch):
            feed.next_step()[0].inputs
        assert feed.epoch == epoch
        visited = np.concatenate(reads[-per_epoch:])
        assert len(set(visited.tolist())) == visited.size == per_epoch * 3
    assert not np.array_equal(np.concatenate(reads[:per_epoch]), np.concatenate(reads[per_epoch:]))
    feed.next_step()
    assert feed.state_dict() == {"epoch": 2, "cursor": 3}


def test_resume_is_bitwise_mid_epoch_and_across_an_epoch_boundary(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = config(tmp_path, corpus, dp=2)
    straight = DataFeed(cfg, 1, CPU)
    per_epoch_steps = straight.rows // 3 / 4
    wanted = [global_batch([straight]) for _ in range(int(2.5 * per_epoch_steps))]
    for stop in (1, int(per_epoch_steps) - 1, int(per_epoch_steps) + 1):
        first = DataFeed(cfg, 1, CPU)
        for _ in range(stop):
            first.next_step()
        state = first.state_dict()
        assert all(type(v) is int for v in state.values())
        resumed = DataFeed(cfg, 1, CPU)
        resumed.load_state_dict(json.loads(json.dumps(state)))
        for want in wanted[stop:]:
            got = global_batch([resumed])
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_untouched_micro_batches_read_nothing(tmp_path, reads):
    corpus = write_corpus(tmp_path / "corpus")
    feed = DataFeed(config(tmp_path, corpus, dp=2), 0, CPU)
    steps = [feed.next_step() for _ in range(50)]
    assert reads == [] and "_tokens" not in vars(feed)  # the file is not even mapped yet
    batch = steps[3][1]
    labels = batch.labels
    assert len(reads) == 1 and reads[0].shape == (3,)
    assert batch.labels is labels and batch.inputs.shape == (3, 15) and len(reads) == 1  # one read per micro-batch
    assert batch.inputs.dtype == torch.int64 and batch.inputs.is_contiguous()


def test_meta_device_tokenises_and_reads_nothing(tmp_path, reads):
    corpus = write_corpus(tmp_path / "corpus")
    feed = DataFeed(config(tmp_path, corpus, dp=2), 1, torch.device("meta"))
    batch = feed.next_step()[0]
    assert batch.inputs.device.type == "meta" and batch.inputs.shape == batch.labels.shape == (3, 15)
    assert batch.inputs.dtype == torch.int64
    eval_feed = DataFeed(config(tmp_path, corpus, dp=2), 1, torch.device("meta"), "eval")
    assert [mb.labels.shape for mb in eval_feed.held_out(2)] == [(3, 15)]
    assert reads == [] and not (tmp_path / "run").exists()


def test_held_out_rows_in_stored_order_split_over_dp(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    path, count = token_file(str(corpus), 1_000_000, tmp_path / "run" / "data")
    tokens = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    tail = tokens[count - int(count * 0.1):]
    rows = torch.from_numpy(tail[:len(tail) // 16 * 16].reshape(-1, 16))
    for dp in (1, 2, 4):
        shares = [DataFeed(config(tmp_path, corpus, dp), d, CPU, "eval").held_out(4) for d in range(dp)]
        assert {len(s) for s in shares} == {4 // dp}
        got = [mb for share in shares for mb in share]
        assert torch.equal(torch.cat([mb.inputs for mb in got]), rows[:12, :-1])
        assert torch.equal(torch.cat([mb.labels for mb in got]), rows[:12, 1:])
    feed = DataFeed(config(tmp_path, corpus, 2), 0, CPU, "eval")
    with pytest.raises(ValueError, match="fewer than the 100 evaluation needs"):
        feed.held_out(100)


def test_errors_name_the_fields(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", docs=1)
    with pytest.raises(ValueError, match="train.micro_batch_size or train.seq_len"):
        DataFeed(config(tmp_path, corpus, micro_batch_size=64), 0, CPU)
    with pytest.raises(ValueError, match="split"):
        DataFeed(config(tmp_path, corpus), 0, CPU, "test")


def test_micro_batch_of_given_tensors():
    inputs, labels = torch.arange(6).view(2, 3), torch.arange(1, 7).view(2, 3)
    batch = MicroBatch.of(inputs, labels)
    assert batch.inputs is inputs and batch.labels is labels


MEASURE = """
import json, sys, torch
from launch.config import build_config
from launch.data import DataFeed
from tests.launch.build_rss import rss_anon

corpus, run_dir = sys.argv[1:3]
cfg = build_config({"train": {"micro_batch_size": 8, "grad_accum_steps": 4, "seq_len": 128, "run_dir": run_dir},
                    "data": {"corpus": corpus, "max_bytes": 10**9, "eval_fraction": 0.01}})
torch.zeros(1).sum()
before = rss_anon()
feed, held = DataFeed(cfg, 0, torch.device("cpu")), DataFeed(cfg, 0, torch.device("cpu"), "eval")
for _ in range(5):
    for mb in feed.next_step():
        mb.inputs.sum(), mb.labels.sum()
for mb in held.held_out(2):
    mb.inputs.sum()
after = rss_anon()
print(json.dumps({"rows": feed.rows, "growth": after - before, "before": before, "after": after}))
"""


def _growth(corpus: Path, run_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(corpus), str(run_dir)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_memory_does_not_grow_with_the_corpus(tmp_path):
    rng = random.Random(0)
    block = " ".join(rng.choice(["moe", "expert", "router", "tökens", "pipeline\n", "shard"]) for _ in range(200_000))
    block = block.encode()[: 1 << 20]
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        for _ in range(200):
            f.write(block)
    small = tmp_path / "small.txt"
    small.write_bytes(block)  # 1 MB
    try:
        small_run = _growth(small, tmp_path / "small_run")
        big_run = _growth(big, tmp_path / "big_run")  # builds the 400 MB token file, then samples from it
        big_again = _growth(big, tmp_path / "big_run")  # reuses it
        print(f"RssAnon growth: small corpus {small_run['growth'] / 2**20:.2f} MiB ({small_run['rows']} rows), "
              f"200 MB corpus {big_run['growth'] / 2**20:.2f} MiB building, {big_again['growth'] / 2**20:.2f} MiB "
              f"reusing ({big_run['rows']} rows); RssAnon after: {small_run['after'] / 2**20:.1f} / "
              f"{big_run['after'] / 2**20:.1f} / {big_again['after'] / 2**20:.1f} MiB")
        assert big_run["rows"] > 150 * small_run["rows"]
        for run in (big_run, big_again):
            assert run["growth"] < small_run["growth"] + 4 * 2**20
    finally:
        big.unlink()
        for run in ("small_run", "big_run"):
            for f in (tmp_path / run / "data").glob("tokens.*"):
                f.unlink()
