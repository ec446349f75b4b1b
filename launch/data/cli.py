"""`moe-data`: train a byte-level BPE tokenizer on local files, and prepare token shards for `data.sources`.

    moe-data train-tokenizer --vocab-size 1024 --out tokenizer.json INPUT...
    moe-data prepare --tokenizer tokenizer.json --out DATASET [--field text] [--num-proc 4] INPUT...

INPUT: text files or folders of .txt/.md/.rst/.py files (one document per file), "stdlib" (Python's own
sources), .jsonl/.json files (one document per line, text under --field) or .parquet files (column --field);
one kind per call. Everything is read from local files with `datasets`; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from launch.data.feed import corpus_files
from launch.data.shards import new_manifest, prepare_folder
from launch.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer

KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # anything else: text
BATCH = 64  # documents per tokenizer call and per read (its encodings hold ~100 B per token)


def input_files(inputs: list[str]) -> tuple[str, list[Path]]:
    """(the `datasets` builder: "text", "json" or "parquet"; the files) of the inputs, checked."""
    files: list[Path] = []
    for item in inputs:
        if item != "stdlib" and not Path(item).exists():
            raise ValueError(f"input {item!r}: no such file or folder")
        files += corpus_files(item) if item == "stdlib" or Path(item).is_dir() else [Path(item)]
    kinds = {KINDS.get(f.suffix, "text") for f in files}
    if len(kinds) != 1:
        raise ValueError(f"the inputs mix kinds ({', '.join(sorted(kinds))}); prepare each kind on its own")
    return kinds.pop(), files


def load_documents(inputs: list[str], field: str, cache: Path, num_proc: int | None):
    """The inputs as a `datasets.Dataset` with one document per row under "text" (the builder's cache in cache)."""
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


def _pieces(ds, tokenizer: Tokenizer, skip: int, num_proc: int | None) -> Iterator[tuple[np.ndarray, bool]]:
    """Each document after the first skip as one piece of token ids (tokenised by `datasets.map`)."""
    rest = ds.select(range(skip, len(ds))).map(_tokenise, batched=True, batch_size=BATCH, fn_kwargs={"tokenizer": tokenizer},
                                               remove_columns=["text"], num_proc=num_proc if num_proc and num_proc > 1 else None)
    for batch in rest.with_format("numpy").iter(batch_size=BATCH):
        for ids in batch["ids"]:
            yield np.asarray(ids), True


def prepare(inputs: list[str], tokenizer_spec: str, out: str | Path, field: str = "text", num_proc: int | None = None,
            shard_tokens: int = 1 << 28, progress: bool = True) -> dict:
    """Tokenise the inputs' documents (EOS after each) into shards in out (resumable); returns the manifest.
    Bad inputs (missing files, mixed kinds, an absent field, a bad tokenizer) are refused before out is made."""
    tokenizer = load_tokenizer(tokenizer_spec)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; give a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.datasets-"))
    try:
        ds, files = load_documents(inputs, field, cache, num_proc)
        bar = tqdm(total=len(ds), desc="prepare", unit="doc", disable=not progress)

        def pieces(skip: int) -> Iterator[tuple[np.ndarray, bool]]:
            bar.update(skip)
            return _pieces(ds, tokenizer, skip, num_proc)

        with bar:
            return prepare_folder(out, new_manifest(tokenizer, inputs_key(files, field)), pieces, shard_tokens,
                                  on_document=lambda: bar.update())
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _texts(inputs: list[str], field: str, cache: Path) -> Iterator[str]:
    ds, _ = load_documents(inputs, field, cache, None)
    for batch in ds.iter(batch_size=BATCH):
        yield from batch["text"]


def main(argv: list[str] | None = None) -> int:
    """Parse the command and run it; 2 with a clear message on bad input."""
    parser = argparse.ArgumentParser(prog="moe-data", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train-tokenizer", help="train a byte-level BPE (EOS <|endoftext|> = id 0)")
    train.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary (>= 257)")
    train.add_argument("--out", required=True, help="the tokenizer.json to write")
    prep = commands.add_parser("prepare", help="tokenise documents into shards with a manifest (resumable)")
    prep.add_argument("--tokenizer", required=True, help='"bytes", a tokenizer.json or a model folder holding one')
    prep.add_argument("--out", required=True, help="the dataset folder (give the same to continue a stopped run)")
    prep.add_argument("--num-proc", type=int, help="processes reading and tokenising (default 1)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard (default 2^28)")
    prep.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    for sub in (train, prep):
        sub.add_argument("--field", default="text", help="the text field of JSONL/Parquet inputs (default text)")
        sub.add_argument("inputs", nargs="+", metavar="INPUT")
    args = parser.parse_args(argv)
    try:
        if args.command == "train-tokenizer":
            out = Path(args.out)
            input_files(args.inputs)
            cache = Path(tempfile.mkdtemp(prefix="moe-data-"))
            try:
                tok = train_tokenizer(_texts(args.inputs, args.field, cache), args.vocab_size, out)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            print(f"wrote {out}: {tok.vocab_size} ids, EOS id {tok.eos_id}, digest {tok.digest[:12]}")
        else:
            if args.shard_tokens < 1 or (args.num_proc is not None and args.num_proc < 1):
                raise ValueError(f"--shard-tokens {args.shard_tokens} and --num-proc {args.num_proc} must be >= 1")
            manifest = prepare(args.inputs, args.tokenizer, args.out, args.field, args.num_proc, args.shard_tokens,
                               not args.no_progress)
            print(f"{args.out}: {manifest['documents']} documents, {manifest['tokens']} tokens in "
                  f"{len(manifest['shards'])} shard(s) of {manifest['dtype']}")
    except ValueError as error:
        print(f"moe-data: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
