"""Prepared datasets: token shards (numpy memmaps), a document index per shard and a manifest.

A prepared folder holds NNNNN.tokens (the documents' tokens, each document followed by the tokenizer's EOS,
uint16 or uint32 little-endian), NNNNN.docs (uint64: where each document of the shard ends) and
manifest.json: the dtype, the tokenizer (digest, vocabulary, EOS id), what the data was made from (`key`), the
input documents consumed so far, and per shard its token and document counts and the CRC-32 of both files.
A shard is written to a temporary file, renamed into place and only then listed (the manifest is replaced
atomically): a half-written shard is never listed, and a writer that stopped continues after the last listed
shard. Readers treat the folder's tokens as one stream and map each shard when first read, checking it then:
its CRC-32 and its token ids against the tokenizer's vocabulary (a ShardRefused names the shard). A reader thus
verifies what it opens, once, where it opens it (a rank: in its prefetch thread), never the whole dataset first.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from launch.data.tokenizer import Tokenizer
from launch.files import crc32, write_atomically
from launch.parallel.spawn import RankRefusal

MANIFEST = "manifest.json"
FORMAT = "moe-pretrain shards v1"
DOC_DTYPE = np.dtype("<u8")
CHECK_BLOCK = 1 << 22  # tokens per block of the check at a shard's opening


class DataRefused(RankRefusal):
    """Input data that cannot be used (text that is not UTF-8, a malformed record): the message names the file."""


class ShardRefused(DataRefused):
    """A shard opened for reading is not what its manifest lists (corrupted, or ids outside the vocabulary)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 for vocabularies up to 65536 ids, else uint32 (little-endian on every platform)."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def write_manifest(folder: Path, manifest: dict) -> None:
    """Replace folder's manifest.json atomically."""
    write_atomically(folder / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def new_manifest(tokenizer: Tokenizer, key: dict) -> dict:
    """An empty manifest of data made by tokenizer from key (a description of the inputs)."""
    return {"format": FORMAT, "dtype": token_dtype(tokenizer.vocab_size).str, "key": key,
            "tokenizer": {"digest": tokenizer.digest, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
                          "name": tokenizer.name},
            "documents": 0, "tokens": 0, "complete": False, "shards": []}


def read_manifest(folder: Path) -> dict | None:
    """folder's manifest, or None where it has none that parses."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def write_shards(folder: Path, pieces: Iterator[tuple[np.ndarray, bool]], manifest: dict, shard_tokens: int,
                 max_tokens: int | None = None, on_document: Callable[[], None] = lambda: None) -> dict:
    """Append pieces (token ids, whether the piece ends its document; EOS is added after each document) to the
    shards of folder after those manifest lists, until max_tokens tokens; each shard closes at the first document
    end past shard_tokens and is then listed. Returns the completed manifest (also written)."""
    dtype, eos = np.dtype(manifest["dtype"]), manifest["tokenizer"]["eos_id"]
    limit = max_tokens if max_tokens is not None else float("inf")
    shard: _OpenShard | None = None
    try:
        for ids, ends in pieces:
            room = limit - manifest["tokens"] - (shard.tokens if shard else 0)
            if room <= 0:
                break
            shard = shard or _OpenShard(folder, len(manifest["shards"]), dtype)
            kept = ids[: int(min(room, ids.size))]
            shard.append(kept)
            if ends and kept.size < room:  # the document and its EOS fit
                shard.append(np.array([eos]))
                shard.documents += 1
                shard.ends.append(shard.tokens)
                on_document()
                if shard.tokens >= shard_tokens:
                    _publish(folder, manifest, shard)
                    shard = None
        if shard is not None and shard.tokens:
            if not shard.ends or shard.ends[-1] != shard.tokens:
                shard.ends.append(shard.tokens)  # cut by max_tokens inside a document
            _publish(folder, manifest, shard)
            shard = None
    finally:
        if shard is not None:
            shard.discard()
    manifest["complete"] = True
    write_manifest(folder, manifest)
    return manifest


def prepare_folder(folder: Path, fresh: dict, pieces: Callable[[int], Iterator[tuple[np.ndarray, bool]]],
                   shard_tokens: int, max_tokens: int | None = None, replace: bool = False,
                   on_document: Callable[[], None] = lambda: None) -> dict:
    """Make folder the prepared dataset fresh (an empty manifest) describes, from pieces(skip) (the token pieces of
    the input documents after the first skip): reused when complete, continued when a writer stopped. A folder
    holding another finished dataset is refused (with replace: emptied first); an unfinished preparation of other
    inputs (e.g. stopped by a bad record, the input fixed since) is replaced, saying so. The manifest is written
    with the first shard: a writer refused before it leaves no manifest behind. Returns the complete manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(folder)
    same = manifest is not None and (manifest["key"], manifest["tokenizer"]["digest"], manifest["dtype"]) == (
        fresh["key"], fresh["tokenizer"]["digest"], fresh["dtype"])  # the tokenizer by content, not by path
    if manifest is not None and not same:
        if manifest["complete"] and not replace:
            raise ValueError(f"{folder} holds a prepared dataset of other inputs or another tokenizer; give an "
                             f"empty or new output folder")
        if not manifest["complete"]:
            print(f"{folder} held an unfinished preparation of other inputs or another tokenizer ({manifest['documents']} "
                  f"documents in {len(manifest['shards'])} shard(s)): replacing it", file=sys.stderr, flush=True)
        for old in [*folder.glob("[0-9]*.tokens"), *folder.glob("[0-9]*.docs"), folder / MANIFEST]:
            old.unlink()
    if not same:
        manifest = fresh
    if manifest["complete"]:
        return manifest
    return write_shards(folder, pieces(manifest["documents"]), manifest, shard_tokens, max_tokens, on_document)


class _OpenShard:
    """A shard being written: tokens appended to a temporary file, CRC and document ends tracked."""

    def __init__(self, folder: Path, index: int, dtype: np.dtype) -> None:
        self.name, self.dtype = f"{index:05d}", dtype
        self.tmp = folder / f".{self.name}.tokens.tmp"
        self.file = open(self.tmp, "wb")
        self.tokens, self.documents, self.crc, self.ends = 0, 0, 0, []

    def append(self, ids: np.ndarray) -> None:
        data = ids.astype(self.dtype).tobytes()
        self.file.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.tokens += ids.size

    def discard(self) -> None:
        self.file.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink()


def _publish(folder: Path, manifest: dict, shard: _OpenShard) -> None:
    """Close shard, rename it into place with its document index, then list it in the manifest."""
    shard.file.flush()
    os.fsync(shard.file.fileno())
    shard.file.close()
    os.replace(shard.tmp, folder / f"{shard.name}.tokens")
    ends = np.asarray(shard.ends, dtype=DOC_DTYPE).tobytes()
    write_atomically(folder / f"{shard.name}.docs", lambda f: f.write(ends))
    manifest["shards"].append({"name": shard.name, "tokens": shard.tokens, "documents": len(shard.ends),
                               "tokens_crc32": shard.crc, "docs_crc32": zlib.crc32(ends)})
    manifest["documents"] += shard.documents
    manifest["tokens"] += shard.tokens
    write_manifest(folder, manifest)


class Prepared:
    """A prepared folder read as one token stream: the manifest checked (complete, the expected tokenizer, every
    listed shard present with its size; with verify, every shard's CRCs at once), each shard memory-mapped when
    first read and then checked (its CRC-32, its ids below the tokenizer's vocabulary size; ShardRefused)."""

    def __init__(self, folder: str | Path, digest: str | None = None, verify: bool = False, field: str = "path") -> None:
        self.folder = Path(folder)
        manifest = read_manifest(self.folder)
        if manifest is None:
            raise ValueError(f"{field} = {str(folder)!r}: no prepared dataset there (no readable {MANIFEST}; "
                             f"make one with `moe-data prepare`)")
        if not manifest["complete"]:
            raise ValueError(f"{field} = {str(folder)!r}: its preparation has not finished (run `moe-data prepare` "
                             f"again to continue it)")
        made = manifest["tokenizer"]["digest"]
        if digest is not None and made != digest:
            raise ValueError(f"{field} = {str(folder)!r} was tokenised by {manifest['tokenizer']['name']!r} "
                             f"(digest {made[:12]}), not by the configured data.tokenizer (digest {digest[:12]})")
        self.manifest, self.dtype, self.field = manifest, np.dtype(manifest["dtype"]), field
        self.vocab_size, self.eos_id = manifest["tokenizer"]["vocab_size"], manifest["tokenizer"]["eos_id"]
        for shard in manifest["shards"]:
            self._check(shard, verify, field)
        counts = [s["tokens"] for s in manifest["shards"]]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.tokens = int(self.starts[-1])
        self._maps: dict[int, np.ndarray] = {}

    def _check(self, shard: dict, verify: bool, field: str) -> None:
        for suffix, size, crc in ((".tokens", shard["tokens"] * self.dtype.itemsize, shard["tokens_crc32"]),
                                  (".docs", shard["documents"] * DOC_DTYPE.itemsize, shard["docs_crc32"])):
            path = self.folder / f"{shard['name']}{suffix}"
            if not path.is_file() or path.stat().st_size != size:
                raise ValueError(f"{field}: shard {path} is missing or has the wrong size (the manifest lists {size} "
                                 f"bytes): prepare the dataset again")
            if verify and crc32(path) != crc:
                raise ValueError(f"{field}: shard {path} is corrupted (its CRC-32 differs from the manifest's): "
                                 f"{self._remedy()}")

    def _remedy(self) -> str:
        return (f"remove {self.folder} to have the run prepare it again" if self.field == "data.corpus"
                else "prepare the dataset again (moe-data prepare)")

    def _shard(self, index: int) -> np.ndarray:
        """Shard index's tokens, mapped and checked on first use (ShardRefused when the check fails)."""
        if index not in self._maps:
            shard = self.manifest["shards"][index]
            path = self.folder / f"{shard['name']}.tokens"
            tokens = np.memmap(path, dtype=self.dtype, mode="r")
            crc, top = 0, 0
            for at in range(0, tokens.size, CHECK_BLOCK):
                block = tokens[at:at + CHECK_BLOCK]
                crc = zlib.crc32(block, crc)
                top = max(top, int(block.max()))
            if crc != shard["tokens_crc32"]:
                raise ShardRefused(f"{self.field}: shard {path} is corrupted (its CRC-32 differs from the manifest's): "
                                   f"{self._remedy()}")
            if top >= self.vocab_size:
                raise ShardRefused(f"{self.field}: shard {path} holds token id {top}, outside the vocabulary of its "
                                   f"tokenizer {self.manifest['tokenizer']['name']!r} ({self.vocab_size} ids): "
                                   f"{self._remedy()}")
            self._maps[index] = tokens
        return self._maps[index]

    def read(self, starts: Iterable[int], width: int) -> np.ndarray:
        """Rows [len(starts), width] of the stream (a row may span shards); only these tokens are read."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((starts.size, width), dtype=self.dtype)
        for row, start in enumerate(starts.tolist()):
            filled = 0
            while filled < width:
                at = start + filled
                index = int(np.searchsorted(self.starts, at, side="right")) - 1
                local = at - int(self.starts[index])
                piece = self._shard(index)[local: local + width - filled]
                out[row, filled: filled + piece.size] = piece
                filled += piece.size
        return out

    def documents(self) -> Iterable[np.ndarray]:
        """Each shard's document ends (offsets in the stream), read from the document index."""
        for index, shard in enumerate(self.manifest["shards"]):
            ends = np.fromfile(self.folder / f"{shard['name']}.docs", dtype=DOC_DTYPE).astype(np.int64)
            yield ends + int(self.starts[index])
