"""Verified reads of prepared token shards (issue 51, point 3): a reader checks each shard where it opens it (CRC-32,
ids within the tokenizer's vocabulary; ShardRefused naming the shard), only the shards it opens; a launch's
preflight reads no shard's contents, `--check` reads them all, the run directory's prepared corpus included."""

from __future__ import annotations

import numpy as np
import pytest

from launch.data import shards
from launch.data.feed import DataFeed, prepare_corpus
from launch.data.shards import Prepared, ShardRefused
from launch.train.preflight import check_run
from tests.launch.data_helpers import config, make_source, write_corpus


def flip(path, at: int = 7) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x04
    path.write_bytes(bytes(data))


@pytest.fixture
def source(tmp_path):
    """A prepared source of 3 shards (documents of 40 tokens, shards closing past 100 tokens)."""
    docs = [np.full(40, 1 + i, dtype=np.int64) for i in range(9)]
    folder = make_source(tmp_path / "source", docs, shard_tokens=100)
    assert len(Prepared(folder).manifest["shards"]) == 3
    return folder


def test_a_reader_checks_only_the_shards_it_opens(source):
    flip(source / "00002.tokens")
    data = Prepared(source)
    assert data.read([0, 50], 20).shape == (2, 20)  # rows of shard 0 only: the corrupt shard 2 is never read
    assert sorted(data._maps) == [0]
    with pytest.raises(ShardRefused, match=r"path: shard .*00002.tokens is corrupted .*moe-data prepare"):
        data.read([data.tokens - 10], 10)


def test_ids_outside_the_vocabulary_are_refused_where_the_shard_opens(tmp_path):
    """A shard whose manifest and CRC agree but whose ids exceed the tokenizer's (a faulty preparer): named at its
    opening, not an IndexError at the embedding."""
    folder = make_source(tmp_path / "wide", [np.array([5, 300, 7])])
    with pytest.raises(ShardRefused, match=r"00000.tokens holds token id 300, outside the vocabulary of its tokenizer "
                                           r"'bytes' \(256 ids\)"):
        Prepared(folder, field="data source").read([0], 3)


def test_a_launch_reads_no_shard_and_check_reads_every_one(tmp_path, source, monkeypatch):
    flip(source / "00001.tokens")
    cfg = config(tmp_path / "run", data={"sources": [{"path": str(source), "weight": 1.0}]})
    checked = []
    monkeypatch.setattr(shards, "crc32", lambda path: checked.append(path.name) or 0)
    check_run(cfg)
    assert checked == []
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"data.sources\[0\].path: shard .*00001.tokens is corrupted"):
        check_run(cfg, verify=True)


def test_the_run_directorys_prepared_corpus_is_checked_by_check_and_by_its_reader(tmp_path):
    cfg = config(tmp_path / "run", write_corpus(tmp_path / "corpus"))
    prepared = prepare_corpus(cfg.data, tmp_path / "run" / "data")
    check_run(cfg, verify=True)
    flip(prepared.folder / "00000.tokens")
    with pytest.raises(ValueError, match=r"data.corpus: shard .*run/data/00000.tokens is corrupted .*remove "):
        check_run(cfg, verify=True)
    feed = DataFeed(cfg, 0, "cpu")  # the corpus is unchanged: the prepared folder is reused as it is
    with pytest.raises(ShardRefused, match=r"data.corpus: shard .*00000.tokens is corrupted"):
        _ = feed.next_step()[0].inputs
