"""Data per rank: the corpus is prepared once into shards and memory-mapped, the index-only sampler gives every
layout the same global batches, blends sources by weight, resumes bitwise in any layout, reads only this rank's
rows (ahead, with prefetch) and keeps memory flat."""

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import launch.data.feed as data
from launch.data.feed import ByteTokenizer, DataFeed, MicroBatch, prepare_corpus
from launch.data.sampler import Blend, RowPermutation
from launch.data.shards import MANIFEST, Prepared, new_manifest, write_manifest
from launch.files import crc32
from tests.launch.data_helpers import ROOT, config, tagged_source, write_corpus

CPU = torch.device("cpu")


def global_batch(feeds: list[DataFeed]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of every DP rank's feed, their micro-batches concatenated in rank order."""
    micro = [mb for feed in feeds for mb in feed.next_step()]
    return torch.cat([mb.inputs for mb in micro]), torch.cat([mb.labels for mb in micro])


def stream(folder: Path) -> np.ndarray:
    """A prepared folder's whole token stream, read from its shard files directly."""
    prepared = Prepared(folder)
    return np.concatenate([np.fromfile(folder / f"{s['name']}.tokens", dtype=prepared.dtype)
                           for s in prepared.manifest["shards"]])


def close(*feeds: DataFeed) -> None:
    """Stop the feeds' prefetch threads (so no read of theirs lands in a later test)."""
    for feed in feeds:
        feed.close()


@pytest.fixture
def reads(monkeypatch):
    """Row indices of every read of a source, in order."""
    seen: list[np.ndarray] = []
    real = data._read_rows

    def counted(rows, indices):
        seen.append(np.array(indices))
        return real(rows, indices)

    monkeypatch.setattr(data, "_read_rows", counted)
    return seen


@pytest.fixture
def sources(tmp_path):
    """Three prepared sources (tokens tagged 0, 1, 2) of different sizes, the middle one in small shards."""
    return [tagged_source(tmp_path / f"src{k}", k, tokens, shard_tokens=shard)
            for k, (tokens, shard) in enumerate([(3000, 1 << 20), (1700, 200), (900, 1 << 20)])]


def blended(sources, weights, **extra):
    return {"sources": [{"path": str(p), "weight": w} for p, w in zip(sources, weights)], **extra}


def test_prepared_corpus_holds_the_documents_joined_by_eos_cut_at_max_bytes(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    texts = [open(f, encoding="utf-8").read() for f in data.corpus_files(str(corpus))]  # universal newlines
    joined = b"".join(t.encode("utf-8") + b"\0" for t in texts)
    assert b"\r" not in joined and len(joined) > len(texts[0]) + 100
    monkeypatch.setattr(data, "READ_CHARS", 5)  # pieces split CRLF pairs and multi-byte characters
    monkeypatch.setattr(data, "CORPUS_SHARD_TOKENS", 300)  # several shards
    for max_bytes in (10**6, len(joined) - 1, len(texts[0].encode()) + 1, 100):
        folder = tmp_path / f"data{max_bytes}"
        prepared = prepare_corpus(config(tmp_path, corpus, data={"max_bytes": max_bytes}).data, folder)
        tokens = stream(folder)
        assert prepared.tokens == tokens.size == min(max_bytes, len(joined))
        assert tokens.tolist() == list(joined[:max_bytes])
        assert prepared.read([0, 7], 9).tolist() == [list(joined[:9]), list(joined[7:16])]
    assert len(Prepared(tmp_path / "data1000000").manifest["shards"]) > 3
    assert ByteTokenizer().decode(tokens.tolist()) == joined[:100].decode("utf-8", errors="replace")


def test_rows_spanning_shards_read_across_them(tmp_path):
    source = tagged_source(tmp_path / "s", 1, 2000, shard_tokens=100)
    prepared, whole = Prepared(source), stream(source)
    assert len(prepared.manifest["shards"]) > 5
    ends = np.cumsum([s["tokens"] for s in prepared.manifest["shards"]])
    starts = [0, int(ends[0]) - 5, int(ends[0]) - 1, int(ends[0]), int(ends[1]) - 3, whole.size - 300]
    assert prepared.read(starts, 300).tolist() == [whole[s:s + 300].tolist() for s in starts]


def test_prepared_corpus_is_reused_and_rebuilt_when_its_sources_change(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    folder = tmp_path / "run" / "data"
    cfg = config(tmp_path / "run", corpus)
    first = prepare_corpus(cfg.data, folder)
    shard = folder / "00000.tokens"
    stat, before = shard.stat(), shard.read_bytes()
    assert prepare_corpus(cfg.data, folder).tokens == first.tokens
    assert (shard.stat().st_ino, shard.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)  # not rewritten
    feed = DataFeed(cfg, 0, CPU)  # the trainer's feeds reuse it too
    assert shard.stat().st_ino == stat.st_ino and feed.rows == (first.tokens - int(first.tokens * 0.1)) // 16

    (corpus / "doc03.txt").write_text("changed")  # the corpus changed: rebuilt
    changed = prepare_corpus(cfg.data, folder)
    assert shard.read_bytes() != before and changed.tokens != first.tokens
    assert stream(folder).tolist().count(0) == 13
    small = prepare_corpus(config(tmp_path / "run", corpus, data={"max_bytes": 500}).data, folder)
    assert small.tokens == 500 and shard.stat().st_size == 1000  # another max_bytes: rebuilt
    assert sorted(p.name for p in folder.iterdir()) == ["00000.docs", "00000.tokens", MANIFEST, "prepare.lock"]


def test_an_interrupted_corpus_preparation_continues(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", docs=20)
    monkeypatch.setattr(data, "CORPUS_SHARD_TOKENS", 400)
    settings = config(tmp_path, corpus).data
    whole = stream(prepare_corpus(settings, tmp_path / "once").folder)
    real = data.corpus_pieces

    def crashing(corpus, tokenizer, skip=0):
        for n, piece in enumerate(real(corpus, tokenizer, skip)):
            if n == 9:
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(data, "corpus_pieces", crashing)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(settings, tmp_path / "twice")
    half = json.loads((tmp_path / "twice" / MANIFEST).read_text())
    assert not half["complete"] and 0 < len(half["shards"]) and half["documents"] < 20
    assert not list((tmp_path / "twice").glob(".*tmp"))  # the shard in progress was dropped, never listed
    monkeypatch.setattr(data, "corpus_pieces", real)
    assert stream(prepare_corpus(settings, tmp_path / "twice").folder).tolist() == whole.tolist()


def _build(args: tuple[str, str]) -> tuple[int, bytes]:
    corpus, folder = args
    prepared = prepare_corpus(config(Path(folder), Path(corpus)).data, folder)
    return prepared.tokens, (Path(folder) / "00000.tokens").read_bytes()


@pytest.mark.slow  # starts processes (tests/conftest.py)
def test_racing_builders_agree(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        results = pool.map(_build, [(str(corpus), str(tmp_path / "data"))] * 3)
    assert len({r for r in results}) == 1
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["00000.docs", "00000.tokens", MANIFEST,
                                                                     "prepare.lock"]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 16, 17, 100, 1000, 4097])
def test_permutation_is_a_bijection(size):
    for seed, epoch, source in ((0, 0, 0), (1, 0, 0), (0, 7, 0), (0, 0, 2)):
        order = RowPermutation(size, seed, epoch, source)(np.arange(size))
        assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(size))
        assert order[size // 2:].tolist() == RowPermutation(size, seed, epoch, source)(np.arange(size // 2, size)).tolist()


def test_permutation_depends_on_seed_epoch_and_source_and_is_fixed():
    base = RowPermutation(1000, 0, 0)(np.arange(1000))
    for other in ((1, 0, 0), (0, 1, 0), (0, 0, 1)):
        assert base.tolist() != RowPermutation(1000, *other)(np.arange(1000)).tolist()
    assert base.tolist() != list(range(1000))
    # pure integer arithmetic: the same on every platform and numpy; these numbers must never change
    assert RowPermutation(10, 0, 0)(np.arange(10)).tolist() == [9, 2, 4, 7, 3, 1, 8, 5, 0, 6]


def test_blend_proportions_hold_within_one_percent_over_10k_samples():
    weights = [0.5, 0.3, 0.15, 0.05]
    taken = [0, 0, 0, 0]
    picks = Blend([w * 7 for w in weights]).assign(taken, 6000)  # unnormalised weights
    picks += Blend([w * 7 for w in weights]).assign(taken, 4000)  # continued from the counts alone
    sources = np.array([s for s, _ in picks])
    for s, w in enumerate(weights):
        assert abs((sources == s).mean() - w) < 0.01
        assert [k for t, k in picks if t == s] == list(range(taken[s]))  # each source's samples in order
        for n in (100, 1000, 10_000):  # every prefix is within one sample of its share
            assert abs((sources[:n] == s).sum() - w * n) <= 1


def test_a_blend_feeds_each_source_in_proportion(tmp_path, sources):
    weights = [0.6, 0.3, 0.1]
    cfg = config(tmp_path / "run", data=blended(sources, weights), grad_accum_steps=10, micro_batch_size=10)
    feed = DataFeed(cfg, 0, CPU)
    tags = []
    for _ in range(100):  # 10k samples, tagged by the tokens they hold
        rows = torch.cat([mb.inputs for mb in feed.next_step()])
        tags += (rows.max(dim=1).values // 60).tolist()
    assert all(((rows.min(dim=1).values == 0) | (rows.min(dim=1).values // 60 == rows.max(dim=1).values // 60)).tolist())
    counts = np.bincount(tags, minlength=3)
    assert np.abs(counts / 10_000 - weights).max() < 0.01
    assert feed.state_dict() == {f"source{k}": int(c) for k, c in enumerate(counts)}
    assert counts[2] > 2 * feed.sources[2].count  # the small source is repeated epoch after epoch


@pytest.mark.parametrize("prefetch", [0, 2])
def test_every_layout_sees_the_same_global_batches(tmp_path, sources, prefetch):
    corpus = write_corpus(tmp_path / "corpus")
    for spec in ({}, blended(sources, [3, 2, 1])):
        spec = {**spec, "prefetch_steps": prefetch}
        feeds = {(dp, pp): [DataFeed(config(tmp_path / "run", corpus, dp, spec, pp), d, CPU) for d in range(dp)]
                 for dp, pp in ((1, 1), (2, 1), (4, 1), (2, 2))}
        steps = 2 * feeds[1, 1][0].sources[0].count // 12 + 3  # past two epochs of the largest source
        for _ in range(steps):
            want = global_batch(feeds[1, 1])
            assert (want[0][:, 1:] == want[1][:, :-1]).all() and want[0].shape == (12, 15)
            for layout in ((2, 1), (4, 1), (2, 2)):
                got = global_batch(feeds[layout])
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        close(*(f for layout in feeds.values() for f in layout))


def test_an_epoch_visits_every_row_once(tmp_path, reads):
    corpus = write_corpus(tmp_path / "corpus")
    feed = DataFeed(config(tmp_path / "run", corpus, grad_accum_steps=1), 0, CPU)
    rows = feed.rows
    assert rows % 3
    taken = [mb.inputs for _ in range(2 * rows // 3 + 1) for mb in feed.next_step()]
    visited = np.concatenate(reads)
    assert len(taken) * 3 == visited.size and sorted(visited[:rows].tolist()) == list(range(rows))
    assert sorted(visited[rows: 2 * rows].tolist()) == list(range(rows))
    assert visited[:rows].tolist() != visited[rows: 2 * rows].tolist()


@pytest.mark.parametrize("prefetch", [0, 1])
def test_resume_is_bitwise_across_a_layout_change(tmp_path, sources, prefetch):
    spec = blended(sources, [0.5, 0.3, 0.2], prefetch_steps=prefetch)
    straight = [DataFeed(config(tmp_path / "run", dp=1, data=spec), 0, CPU)]
    per_epoch = straight[0].sources[2].count // 12  # steps per epoch of the smallest source
    wanted = [global_batch(straight) for _ in range(3 * per_epoch)]
    for stop, before, after in ((1, 1, 2), (per_epoch + 1, 2, 4), (2 * per_epoch - 1, 4, 1)):
        first = [DataFeed(config(tmp_path / "run", dp=before, data=spec), d, CPU) for d in range(before)]
        for _ in range(stop):
            global_batch(first)
        states = [feed.state_dict() for feed in first]
        assert all(s == states[0] for s in states) and all(type(v) is int for v in states[0].values())
        resumed = [DataFeed(config(tmp_path / "run", dp=after, data=spec), d, CPU) for d in range(after)]
        for feed in resumed:
            feed.next_step()  # a step read ahead of the load, then dropped
            feed.load_state_dict(json.loads(json.dumps(states[0])))
        for want in wanted[stop:]:
            got = global_batch(resumed)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        close(*first, *resumed)
    close(*straight)
    with pytest.raises(ValueError, match="1 source"):
        DataFeed(config(tmp_path / "run", write_corpus(tmp_path / "c"), data={}), 0, CPU).load_state_dict(states[0])


def test_untouched_micro_batches_read_nothing(tmp_path, reads):
    corpus = write_corpus(tmp_path / "corpus")
    feed = DataFeed(config(tmp_path / "run", corpus, dp=2), 0, CPU)
    steps = [feed.next_step() for _ in range(50)]
    assert reads == [] and feed.sources[0].segments[0].data._maps == {}  # no shard is even mapped yet
    batch = steps[3][1]
    labels = batch.labels
    assert len(reads) == 1 and reads[0].shape == (3,)
    assert batch.labels is labels and batch.inputs.shape == (3, 15) and len(reads) == 1  # one read per micro-batch
    assert batch.inputs.dtype == torch.int64 and batch.inputs.is_contiguous()


def test_prefetch_reads_this_ranks_rows_ahead(tmp_path, sources, reads):
    spec = blended(sources, [1, 1, 1])
    lazy = DataFeed(config(tmp_path / "run", dp=2, data=spec), 1, CPU)
    for _ in range(3):
        for mb in lazy.next_step():
            mb.inputs
    own = [r.tolist() for r in reads]
    reads.clear()
    ahead = DataFeed(config(tmp_path / "run", dp=2, data={**spec, "prefetch_steps": 2}), 1, CPU)
    first = ahead.next_step()  # plans steps 0, 1 and 2 and starts their reads on the feed's thread
    ahead._pool.submit(lambda: None).result()  # the thread has finished what was queued before
    assert sorted(r.tolist() for r in reads) == sorted(own)  # this rank's rows of 3 steps, nothing else
    assert ahead.state_dict() == {"source0": 4, "source1": 4, "source2": 4}  # one global batch of 12 handed out
    count = len(reads)
    assert [mb.inputs.shape for mb in first] == [(3, 15)] * 2 and len(reads) == count  # nothing read again
    ahead.close()


def test_meta_device_tokenises_and_reads_nothing(tmp_path, reads, sources):
    corpus = write_corpus(tmp_path / "corpus")
    for spec in ({}, blended(sources[:2], [1, 1], eval_sources=[{"path": str(sources[2])}])):
        feed = DataFeed(config(tmp_path / "run", corpus, dp=2, data={**spec, "prefetch_steps": 1}), 1,
                        torch.device("meta"))
        batch = feed.next_step()[0]
        assert batch.inputs.device.type == "meta" and batch.inputs.shape == batch.labels.shape == (3, 15)
        assert batch.inputs.dtype == torch.int64
        eval_feed = DataFeed(config(tmp_path / "run", corpus, dp=2, data=spec), 1, torch.device("meta"), "eval")
        assert [mb.labels.shape for mb in eval_feed.held_out(2)] == [(3, 15)]
    assert reads == [] and not (tmp_path / "run").exists()


def test_held_out_rows_in_stored_order_split_over_dp(tmp_path, sources):
    corpus = write_corpus(tmp_path / "corpus")
    prepared = prepare_corpus(config(tmp_path / "run", corpus).data, tmp_path / "run" / "data")
    tokens = stream(prepared.folder).astype(np.int64)
    tail = tokens[prepared.tokens - int(prepared.tokens * 0.1):]
    held = {"corpus": tail[:len(tail) // 16 * 16].reshape(-1, 16),  # rows of each eval source, in order
            "sources": np.concatenate([stream(s)[: stream(s).size // 16 * 16].reshape(-1, 16).astype(np.int64)
                                       for s in (sources[2], sources[1])])}
    assert held["sources"].shape[0] > 72 > stream(sources[2]).size // 16  # 24 micro-batches cross into the second
    evals = {"corpus": {}, "sources": blended(sources[:1], [1], eval_sources=[{"path": str(sources[2])},
                                                                              {"path": str(sources[1])}])}
    for name, spec in evals.items():
        rows, count = torch.from_numpy(held[name]), {"corpus": 8, "sources": 24}[name]
        for dp in (1, 2, 4):
            shares = [DataFeed(config(tmp_path / "run", corpus, dp, spec), d, CPU, "eval").held_out(count)
                      for d in range(dp)]
            assert {len(s) for s in shares} == {count // dp}
            got = [mb for share in shares for mb in share]
            assert torch.equal(torch.cat([mb.inputs for mb in got]), rows[:3 * count, :-1])
            assert torch.equal(torch.cat([mb.labels for mb in got]), rows[:3 * count, 1:])
    feed = DataFeed(config(tmp_path / "run", corpus, 2), 0, CPU, "eval")
    with pytest.raises(ValueError, match="fewer than the 100 evaluation needs"):
        feed.held_out(100)


def test_errors_name_the_fields(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", docs=1)
    with pytest.raises(ValueError, match="train.micro_batch_size or train.seq_len"):
        DataFeed(config(tmp_path / "run", corpus, micro_batch_size=64), 0, CPU)
    with pytest.raises(ValueError, match="split"):
        DataFeed(config(tmp_path / "run", corpus), 0, CPU, "test")


def test_micro_batch_of_given_tensors():
    inputs, labels = torch.arange(6).view(2, 3), torch.arange(1, 7).view(2, 3)
    batch = MicroBatch.of(inputs, labels)
    assert batch.inputs is inputs and batch.labels is labels


MEASURE = """
import json, sys, torch
from launch.config.run import build_config
from launch.data.feed import DataFeed
from launch.bench.data import rss_anon

source, run_dir = sys.argv[1:3]
cfg = build_config({"train": {"micro_batch_size": 8, "grad_accum_steps": 4, "seq_len": 128, "run_dir": run_dir},
                    "data": {"sources": [{"path": source, "weight": 1.0}], "eval_sources": [], "prefetch_steps": 1}})
torch.zeros(1).sum()
before = rss_anon()
feed = DataFeed(cfg, 0, torch.device("cpu"))
for _ in range(20):
    for mb in feed.next_step():
        mb.inputs.sum(), mb.labels.sum()
after = rss_anon()
print(json.dumps({"rows": feed.rows, "growth": after - before, "before": before, "after": after}))
"""


def _growth(source: Path, run_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(source), str(run_dir)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def sparse_source(folder: Path, tokens: int) -> Path:
    """A prepared dataset of one uint16 shard of `tokens` tokens written as a sparse numpy memmap (zeros but a
    few marks), with its manifest (CRCs computed: the reader checks a shard's where it opens it)."""
    folder.mkdir()
    shard = np.memmap(folder / "00000.tokens", dtype="<u2", mode="w+", shape=(tokens,))
    shard[:: 1 << 24] = 7
    shard.flush()
    del shard
    ends = np.array([tokens], dtype="<u8")
    ends.tofile(folder / "00000.docs")
    manifest = new_manifest(ByteTokenizer(), {"synthetic": tokens})
    manifest.update(tokens=tokens, documents=1, complete=True,
                    shards=[{"name": "00000", "tokens": tokens, "documents": 1,
                             "tokens_crc32": crc32(folder / "00000.tokens"), "docs_crc32": crc32(folder / "00000.docs")}])
    write_manifest(folder, manifest)
    return folder


@pytest.mark.slow  # starts processes (tests/conftest.py)
def test_memory_does_not_grow_with_the_data(tmp_path):
    small = sparse_source(tmp_path / "small", 1 << 20)  # 2 MB
    big = sparse_source(tmp_path / "big", 600 << 20)  # 1.2 GB, sparse on disk
    assert (big / "00000.tokens").stat().st_size >= 1 << 30
    small_run = _growth(small, tmp_path / "small_run")
    big_run = _growth(big, tmp_path / "big_run")
    print(f"RssAnon growth: 2 MB shard {small_run['growth'] / 2**20:.2f} MiB ({small_run['rows']} rows), "
          f"1.2 GB shard {big_run['growth'] / 2**20:.2f} MiB ({big_run['rows']} rows); RssAnon after: "
          f"{small_run['after'] / 2**20:.1f} / {big_run['after'] / 2**20:.1f} MiB")
    assert big_run["rows"] > 500 * small_run["rows"]
    assert big_run["growth"] < small_run["growth"] + 4 * 2**20
