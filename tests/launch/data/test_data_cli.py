"""`moe-data`: prepare reads text, JSONL and Parquet with `datasets`, writes shards (EOS per document, uint16 for
the shipped BPE, a document index, a manifest with CRCs), continues after a stop, refuses bad inputs before
writing anything; train-tokenizer trains a small byte-level BPE."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

import launch.data.shards as shards
from launch.data.cli import main
from launch.data.shards import MANIFEST, Prepared
from launch.data.tokenizer import BPETokenizer, load_tokenizer
from tests.launch.data_helpers import SHIPPED_TOKENIZER, write_corpus

DOCS = ["def f(x):\n    return x + 1\n", "héllo wörld 🙂", "", "class A:\n    pass\n" * 30]


def documents(folder) -> list[list[int]]:
    """The prepared folder's documents (EOS dropped), read through its document index."""
    prepared = Prepared(folder)
    stream = prepared.read([0], prepared.tokens)[0].tolist()
    ends = np.concatenate(list(prepared.documents())).tolist()
    assert all(stream[e - 1] == prepared.eos_id for e in ends)
    return [stream[a:b - 1] for a, b in zip([0] + ends[:-1], ends)]


@pytest.fixture
def inputs(tmp_path):
    """The same documents as text files, JSONL lines (field "body") and a Parquet file (column "body")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = tmp_path / "text"
    text.mkdir()
    for i, doc in enumerate(DOCS):
        (text / f"{i}.txt").write_text(doc)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": DOCS, "id": list(range(len(DOCS)))}), parquet)
    return {"text": [str(text)], "jsonl": [str(jsonl), "--field", "body"], "parquet": [str(parquet), "--field", "body"]}


def test_prepare_text_jsonl_and_parquet_into_shards(tmp_path, inputs, capsys):
    tokenizer = load_tokenizer(str(SHIPPED_TOKENIZER))
    wanted = [t.tolist() for t in tokenizer.encode_batch(DOCS)]
    for kind, args in inputs.items():
        out = tmp_path / f"out-{kind}"
        assert main(["prepare", "--tokenizer", str(SHIPPED_TOKENIZER), "--out", str(out), "--shard-tokens", "20",
                     "--no-progress", *args]) == 0
        assert f"{len(DOCS)} documents" in capsys.readouterr().out
        manifest = json.loads((out / MANIFEST).read_text())
        assert manifest["complete"] and manifest["dtype"] == "<u2" and manifest["documents"] == len(DOCS)
        assert manifest["tokenizer"]["digest"] == tokenizer.digest and manifest["tokenizer"]["vocab_size"] == 512
        assert manifest["tokens"] == sum(len(w) + 1 for w in wanted) and len(manifest["shards"]) >= 2
        for shard in manifest["shards"]:
            assert shard["tokens_crc32"] == zlib.crc32((out / f"{shard['name']}.tokens").read_bytes())
        assert documents(out) == wanted, kind
        assert tokenizer.decode(documents(out)[1]) == DOCS[1]
    assert not list(tmp_path.glob(".*"))  # the datasets cache is gone


def test_prepare_continues_after_a_stop_and_never_lists_a_half_written_shard(tmp_path, monkeypatch, capsys):
    corpus = write_corpus(tmp_path / "corpus", docs=30)
    args = ["prepare", "--tokenizer", "bytes", "--shard-tokens", "500", "--no-progress", str(corpus)]
    assert main([*args, "--out", str(tmp_path / "once")]) == 0
    real = shards._publish
    published = []

    def stop_after_three(folder, manifest, shard):
        if len(published) == 3:
            raise KeyboardInterrupt
        published.append(shard.name)
        real(folder, manifest, shard)

    monkeypatch.setattr(shards, "_publish", stop_after_three)
    assert main([*args, "--out", str(tmp_path / "twice")]) == 130  # Ctrl-C: one line, no traceback
    assert "holds 6 documents in 3 shard(s); run the same command again to continue" in capsys.readouterr().err
    half = json.loads((tmp_path / "twice" / MANIFEST).read_text())
    assert not half["complete"] and [s["name"] for s in half["shards"]] == published
    assert sorted(p.name for p in (tmp_path / "twice").iterdir()) == sorted(
        [MANIFEST, *(f"{n}.{s}" for n in published for s in ("tokens", "docs"))])
    with pytest.raises(ValueError, match="has not finished"):
        Prepared(tmp_path / "twice")
    monkeypatch.setattr(shards, "_publish", real)
    assert main([*args, "--out", str(tmp_path / "twice")]) == 0
    for name in json.loads((tmp_path / "once" / MANIFEST).read_text())["shards"]:
        for suffix in ("tokens", "docs"):
            file = f"{name['name']}.{suffix}"
            assert (tmp_path / "twice" / file).read_bytes() == (tmp_path / "once" / file).read_bytes()
    assert (json.loads((tmp_path / "twice" / MANIFEST).read_text())
            == json.loads((tmp_path / "once" / MANIFEST).read_text()))


@pytest.mark.parametrize("name, args, message", [
    ("missing input", ["{tmp}/nowhere.txt"], "input '{tmp}/nowhere.txt': no such file"),
    ("mixed kinds", ["{tmp}/docs.jsonl", "{tmp}/docs.parquet"], "mix kinds"),
    ("absent field", ["{tmp}/docs.jsonl", "--field", "text"], "--field 'text'"),
    ("bad tokenizer", ["--tokenizer", "{tmp}/nowhere.json", "{tmp}/docs.jsonl"], "nowhere.json"),
    ("bad shard size", ["--shard-tokens", "0", "{tmp}/docs.jsonl"], "--shard-tokens 0"),
])
def test_prepare_refuses_bad_inputs_before_writing(name, args, message, tmp_path, inputs, capsys):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    tokenizer = [] if "--tokenizer" in args else ["--tokenizer", "bytes"]
    assert main(["prepare", *tokenizer, "--out", str(tmp_path / "out"), "--no-progress", *args]) == 2
    assert message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_prepare_refuses_a_folder_of_another_dataset(tmp_path, inputs, capsys):
    out = str(tmp_path / "out")
    assert main(["prepare", "--tokenizer", "bytes", "--out", out, "--no-progress", *inputs["text"]]) == 0
    before = (tmp_path / "out" / MANIFEST).read_text()
    assert main(["prepare", "--tokenizer", str(SHIPPED_TOKENIZER), "--out", out, "--no-progress", *inputs["text"]]) == 2
    assert "another tokenizer" in capsys.readouterr().err and (tmp_path / "out" / MANIFEST).read_text() == before


def test_train_tokenizer_makes_a_small_byte_level_bpe(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", docs=20)
    out = tmp_path / "tok" / "tokenizer.json"
    assert main(["train-tokenizer", "--vocab-size", "300", "--out", str(out), str(corpus)]) == 0
    tok = BPETokenizer(out.parent)  # a model folder holding tokenizer.json works as well
    assert 257 < tok.vocab_size <= 300 and tok.eos_id == 0  # merges stop early on a corpus of 9 words
    assert tok.digest == BPETokenizer(out).digest
    text = "gämma δέλτα 🙂 zeta\n"
    ids = tok.encode_batch([text])[0]
    assert tok.decode(ids) == text and ids.size < len(text.encode()) and ids.max() < 300
    assert main(["train-tokenizer", "--vocab-size", "100", "--out", str(tmp_path / "x.json"), str(corpus)]) == 2
    assert not (tmp_path / "x.json").exists()
    # documents cut into chunks of 7 characters between words: the trainer counts the same words
    assert main(["train-tokenizer", "--vocab-size", "300", "--chunk-chars", "7", "--out", str(tmp_path / "y.json"),
                 str(corpus)]) == 0
    assert BPETokenizer(tmp_path / "y.json").digest == tok.digest


def test_a_model_folder_names_its_eos_token(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(SHIPPED_TOKENIZER.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    tok = load_tokenizer(str(folder))
    assert tok.eos_id == 0 and tok.vocab_size == 512 and tok.digest == load_tokenizer(str(SHIPPED_TOKENIZER)).digest
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="no end-of-document token .*</s>"):
        load_tokenizer(str(folder))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tokenizers JSON file"):
        load_tokenizer(str(tmp_path / "bad.json"))
