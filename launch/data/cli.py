"""`moe-data`: train a byte-level BPE tokenizer on local files, and prepare token shards for `data.sources`.

    moe-data train-tokenizer --vocab-size 1024 --out tokenizer.json INPUT...
    moe-data prepare --tokenizer tokenizer.json --out DATASET [--field text] [--skip-bad-records] INPUT...

INPUT: text files or folders of .txt/.md/.rst/.py files (one document per file), "stdlib" (Python's own
sources), .jsonl/.json files (one document per line, text under --field) or .parquet files (column --field);
one kind per call. Everything is read from local files, streamed: a document is tokenised in chunks of
--chunk-chars characters cut between words (the ids equal the whole document's), so memory does not grow with
the longest document. A malformed record (a broken JSON line, a field that is missing, null or not a string) is
refused naming its file and line, or with --skip-bad-records skipped and counted; an input without records is
refused. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from launch.data.feed import corpus_files, text_pieces
from launch.data.shards import DataRefused, new_manifest, prepare_folder, read_manifest
from launch.data.tokenizer import Tokenizer, chunks, load_tokenizer, train_tokenizer
from launch.errors import Interrupted, cli

KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # anything else: text
CHUNK_CHARS = 1 << 20  # default --chunk-chars: the most characters per tokenizer call (~50 B of memory each)
BATCH_CHUNKS = 16  # a call's characters come in pieces of chunk_chars / BATCH_CHUNKS (spread over its threads)
PARQUET_ROWS = 16  # rows per Parquet read
JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}


def input_files(inputs: list[str]) -> tuple[str, list[Path]]:
    """(the kind: "text", "json" or "parquet"; the files) of the inputs, checked: each exists, one kind, no empty
    JSONL/Parquet file."""
    files: list[Path] = []
    for item in inputs:
        if item != "stdlib" and not Path(item).exists():
            raise ValueError(f"input {item!r}: no such file or folder")
        files += corpus_files(item) if item == "stdlib" or Path(item).is_dir() else [Path(item)]
    kinds = {KINDS.get(f.suffix, "text") for f in files}
    if len(kinds) != 1:
        raise ValueError(f"the inputs mix kinds ({', '.join(sorted(kinds))}); prepare each kind on its own")
    kind = kinds.pop()
    for file in files:
        if kind != "text" and file.stat().st_size == 0:
            raise ValueError(f"input {str(file)!r} is empty (0 bytes): it holds no records")
    return kind, files


class Documents:
    """The documents of checked inputs, streamed: each as an iterator of its text's pieces. A bad record raises
    DataRefused naming its file and line (row), or with skip_bad is skipped and counted (`skipped`, `first_bad`)."""

    def __init__(self, inputs: list[str], field: str = "text", skip_bad: bool = False,
                 chunk_chars: int = CHUNK_CHARS) -> None:
        self.kind, self.files = input_files(inputs)
        self.field, self.skip_bad, self.chunk_chars = field, skip_bad, chunk_chars
        self.skipped, self.first_bad = 0, ""
        if self.kind == "parquet":
            self._parquet_columns()

    def __iter__(self) -> Iterator[Iterator[str]]:
        """Each document's pieces; DataRefused at the end when there were none."""
        given = 0
        for file in self.files:
            if self.kind == "text":
                given += 1
                yield text_pieces(file, self.chunk_chars)
                continue
            records = 0
            for where, text, why in self._json(file) if self.kind == "json" else self._parquet(file):
                records += 1
                if why is None:
                    given += 1
                    yield iter((text,))
                elif self.skip_bad:
                    self.skipped += 1
                    self.first_bad = self.first_bad or f"{where}: {why}"
                else:
                    raise DataRefused(f"{where}: {why}; fix the record, or give --skip-bad-records to skip such "
                                      f"records (counted)")
            if not records:
                raise DataRefused(f"input {str(file)!r} holds no records")
        if not given:
            names = ", ".join(repr(str(f)) for f in self.files[:3]) + (", ..." if len(self.files) > 3 else "")
            raise DataRefused(f"the inputs ({names}) hold no documents: --skip-bad-records skipped all "
                              f"{self.skipped} record(s) (the first: {self.first_bad})")

    def _field(self, record: object) -> tuple[str | None, str | None]:
        """(the text of a parsed JSON record, None) or (None, why it has none)."""
        if not isinstance(record, dict):
            return None, f"a record must be a JSON object, this is {JSON_TYPES.get(type(record), 'a string')}"
        if self.field not in record:
            return None, f"the record has no --field {self.field!r} (it has: {', '.join(map(repr, record)) or 'none'})"
        value = record[self.field]
        if isinstance(value, str):
            return value, None
        if value is None:
            return None, f"field {self.field!r} is null"
        return None, f"field {self.field!r} is {JSON_TYPES[type(value)]} ({json.dumps(value)[:40]}), not a string"

    def _json(self, file: Path) -> Iterator[tuple[str, str | None, str | None]]:
        """(file:line, the text, None) or (file:line, None, why the record is bad) of each record of a JSON Lines file (blank lines are no
        records), or of a .json file holding one array of records."""
        with open(file, "rb") as lines:
            first = lines.read(1 << 12).lstrip()
            lines.seek(0)
            if file.suffix == ".json" and first.startswith(b"["):
                try:
                    records = json.load(lines)
                except ValueError as error:
                    raise DataRefused(f"{file}: not valid JSON ({error})") from None
                for index, record in enumerate(records):
                    yield f"{file} record {index}", *self._field(record)
                return
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as error:
                    yield f"{file}:{number}", None, f"not valid JSON ({error})"
                    continue
                yield f"{file}:{number}", *self._field(record)

    def _parquet_columns(self) -> None:
        """Every Parquet file has the text column, as strings (ValueError naming the file and what it holds)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        for file in self.files:
            try:
                schema = pq.read_schema(file)
            except (OSError, pa.ArrowException) as error:
                raise ValueError(f"input {str(file)!r} is not a Parquet file ({error})") from None
            if self.field not in schema.names:
                raise ValueError(f"--field {self.field!r}: input {str(file)!r} has no such column (it has "
                                 f"{', '.join(schema.names)})")
            kind = schema.field(self.field).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise ValueError(f"--field {self.field!r}: column of input {str(file)!r} holds {kind}, not strings")

    def _parquet(self, file: Path) -> Iterator[tuple[str, str | None, str | None]]:
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(file).iter_batches(batch_size=PARQUET_ROWS, columns=[self.field]):
            for text in batch.column(0).to_pylist():
                yield f"{file} row {row}", text, None if text is not None else f"field {self.field!r} is null"
                row += 1


def load_documents(inputs: list[str], field: str, cache: Path, num_proc: int | None):
    """The inputs as a `datasets.Dataset` with one document per row under "text" (the builder's cache in cache):
    the reading of moe-bench data's peer (a plain `datasets.map`)."""
    import datasets

    kind, files = input_files(inputs)
    options = {"sample_by": "document"} if kind == "text" else {}
    datasets.disable_progress_bars()
    ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train", cache_dir=str(cache),
                               num_proc=num_proc if num_proc and num_proc > 1 else None, **options)
    column = "text" if kind == "text" else field
    if column not in ds.column_names:
        raise ValueError(f"--field {field!r}: the inputs have no such field (they have {', '.join(ds.column_names)})")
    return ds.select_columns([column]).rename_column(column, "text") if column != "text" else ds, files


def inputs_key(files: list[Path], field: str) -> dict:
    """What a prepared dataset is made from: the input files (paths, sizes, mtimes; as a digest) and the field."""
    listing = hashlib.sha256()
    for file in files:
        stat = file.stat()
        listing.update(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {"files": len(files), "files_sha256": listing.hexdigest(), "field": field}


def _tokenise(batch: dict, tokenizer: Tokenizer) -> dict:
    return {"ids": [ids.tolist() for ids in tokenizer.encode_batch(batch["text"])]}


def token_pieces(documents: Iterable[Iterable[str]], tokenizer: Tokenizer, skip: int = 0,
                 chunk_chars: int = CHUNK_CHARS) -> Iterator[tuple[np.ndarray, bool]]:
    """(token ids, whether the piece ends its document) of each document after the first skip: its text in chunks
    of about chunk_chars / BATCH_CHUNKS characters (tokenizer.chunks; whole documents where the tokenizer's cuts are
    not exact), about chunk_chars characters per tokenizer call."""
    size = max(1, chunk_chars // BATCH_CHUNKS) if tokenizer.exact_cuts else None
    batch: list[tuple[str, bool]] = []
    held = 0

    def encoded() -> Iterator[tuple[np.ndarray, bool]]:
        return zip(tokenizer.encode_batch([t for t, _ in batch]), [e for _, e in batch])

    for seen, pieces in enumerate(documents, 1):
        if seen <= skip:
            continue
        for part, ends in _marked(chunks(pieces, size) if size else iter(("".join(pieces),))):
            batch.append((part, ends))
            held += len(part)
            if held >= chunk_chars:
                yield from encoded()
                batch, held = [], 0
    if batch:
        yield from encoded()


def _marked(parts: Iterator[str]) -> Iterator[tuple[str, bool]]:
    """(part, whether it is the last) of a non-empty iterator."""
    part = next(parts)
    for following in parts:
        yield part, False
        part = following
    yield part, True


def prepare(inputs: list[str], tokenizer_spec: str, out: str | Path, field: str = "text", num_proc: int | None = None,
            shard_tokens: int = 1 << 28, progress: bool = True, skip_bad: bool = False,
            chunk_chars: int = CHUNK_CHARS) -> dict:
    """Tokenise the inputs' documents (EOS after each) into shards in out (resumable); returns the manifest.
    Bad inputs (missing or empty files, mixed kinds, an absent field, a bad tokenizer) are refused before out is
    made; a bad record met later (DataRefused naming file and line) or Ctrl-C (Interrupted) leaves out as it was
    (when no shard was written yet: not even made) or resumable: the same command continues it. num_proc: the
    tokenizer's threads (RAYON_NUM_THREADS, unless set; default: the library's, every core)."""
    if num_proc:
        os.environ.setdefault("RAYON_NUM_THREADS", str(num_proc))
    tokenizer = load_tokenizer(tokenizer_spec)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; give a folder")
    documents = Documents(inputs, field, skip_bad, chunk_chars)
    made = not out.exists()
    bar = tqdm(desc="prepare", unit="doc", disable=not progress)

    def pieces(skip: int) -> Iterator[tuple[np.ndarray, bool]]:
        bar.update(skip)
        return token_pieces(documents, tokenizer, skip, chunk_chars)

    try:
        with bar:
            manifest = prepare_folder(out, new_manifest(tokenizer, inputs_key(documents.files, field)), pieces,
                                      shard_tokens, on_document=lambda: bar.update())
    except (Exception, KeyboardInterrupt) as error:
        listed = read_manifest(out)
        if made and listed is None:
            shutil.rmtree(out, ignore_errors=True)
        if isinstance(error, KeyboardInterrupt):
            left = (f"{out} was removed (nothing was written yet)" if listed is None else
                    f"{out} holds {listed['documents']} documents in {len(listed['shards'])} shard(s); run the same "
                    f"command again to continue")
            raise Interrupted(f"interrupted: {left}") from None
        raise
    if documents.skipped:
        print(f"moe-data: --skip-bad-records skipped {documents.skipped} bad record(s) (the first: "
              f"{documents.first_bad})", file=sys.stderr)
    return manifest


def _texts(documents: Documents) -> Iterator[str]:
    """Each document's text in chunks (train_from_iterator counts words inside each string; cuts fall between)."""
    for pieces in documents:
        yield from chunks(pieces, documents.chunk_chars)


@cli("moe-data")
def main(argv: list[str] | None = None) -> int:
    """Parse the command and run it; 2 with a clear message on bad input, 1 on a fault (launch.errors)."""
    parser = argparse.ArgumentParser(prog="moe-data", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train-tokenizer", help="train a byte-level BPE (EOS <|endoftext|> = id 0)")
    train.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary (>= 257)")
    train.add_argument("--out", required=True, help="the tokenizer.json to write")
    prep = commands.add_parser("prepare", help="tokenise documents into shards with a manifest (resumable)")
    prep.add_argument("--tokenizer", required=True, help='"bytes", a tokenizer.json or a model folder holding one')
    prep.add_argument("--out", required=True, help="the dataset folder (give the same to continue a stopped run)")
    prep.add_argument("--num-proc", type=int,
                      help="threads of the tokenizer (RAYON_NUM_THREADS; default: every core)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 28,
                      help="tokens per shard (default 2^28)")
    prep.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    for sub in (train, prep):
        sub.add_argument("--field", default="text", help="the text field of JSONL/Parquet inputs (default text)")
        sub.add_argument("--skip-bad-records", action="store_true",
                         help="skip a malformed JSONL/Parquet record (broken JSON; the field missing, null or not a "
                              "string) and count it, instead of refusing the input naming its file and line")
        sub.add_argument("--chunk-chars", type=int, default=CHUNK_CHARS,
                         help=f"the most characters tokenised as one piece: a longer document is cut between words "
                              f"(its ids unchanged); bounds memory (default {CHUNK_CHARS})")
        sub.add_argument("inputs", nargs="+", metavar="INPUT")
    args = parser.parse_args(argv)
    for flag in ("num_proc", "shard_tokens", "chunk_chars"):
        if getattr(args, flag, None) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    if args.command == "train-tokenizer":
        documents = Documents(args.inputs, args.field, args.skip_bad_records, args.chunk_chars)
        tok = train_tokenizer(_texts(documents), args.vocab_size, Path(args.out))
        print(f"wrote {args.out}: {tok.vocab_size} ids, EOS id {tok.eos_id}, digest {tok.digest[:12]}")
        return 0
    manifest = prepare(args.inputs, args.tokenizer, args.out, args.field, args.num_proc, args.shard_tokens,
                       not args.no_progress, args.skip_bad_records, args.chunk_chars)
    print(f"{args.out}: {manifest['documents']} documents, {manifest['tokens']} tokens in "
          f"{len(manifest['shards'])} shard(s) of {manifest['dtype']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
