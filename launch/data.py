"""Training text per rank: a byte-level tokenizer, a token file written once, and an index-only sampler.

The corpus's documents are tokenised once into a flat uint16 file under RUN_DIR/data/ (reused while
the corpus files, data.max_bytes and the tokenizer are unchanged; written atomically, so ranks that
race each write the same bytes and none uses a half-written file). Each rank memory-maps it and reads
only the rows of its own micro-batches, when they are first asked for. The stream is cut into rows
of seq_len + 1 tokens: the training rows first, then the held-out tail (data.eval_fraction). Within
an epoch the training rows are visited in the order of a seeded bijective permutation computed per
index (a keyed Feistel network with cycle-walking), so the sampler's state is two integers and its
memory does not grow with the corpus; the global batch order depends only on the seed and the corpus,
so every layout sees the same global batches.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from launch.config import RunConfig

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
TOKEN_DTYPE = np.dtype("<u2")  # uint16, little-endian on every platform
READ_CHARS = 1 << 20  # characters read per piece while tokenising: memory stays flat on any corpus
FEISTEL_ROUNDS = 6


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; id 0 (NUL, absent from text) separates documents."""

    vocab_size = 256
    eos_id = 0
    name = "utf8-bytes/eos0"  # part of the token file's key

    def encode(self, text: str) -> list[int]:
        """Token ids of text."""
        return list(text.encode("utf-8"))

    def encode_bytes(self, text: str) -> bytes:
        """Token ids of text as bytes (one byte per id; what the token file is written from)."""
        return text.encode("utf-8")

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (separators dropped, bad bytes replaced)."""
        return bytes(i for i in ids if i != self.eos_id).decode("utf-8", errors="replace")


def corpus_files(corpus: str) -> list[Path]:
    """Files of a corpus: "stdlib" = Python's own top-level stdlib sources; else a file or a folder."""
    if corpus == "stdlib":
        return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    path = Path(corpus)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if files:
            return files
        raise ValueError(f"data.corpus = {corpus!r} holds no {'/'.join(TEXT_SUFFIXES)} files")
    raise ValueError(f"data.corpus = {corpus!r}: no such file or folder")


def _token_key(corpus: str, max_bytes: int, tokenizer: ByteTokenizer) -> dict:
    """What a token file is made from: the corpus files (paths, sizes, mtimes; as a digest), data.max_bytes
    and the tokenizer."""
    files = corpus_files(corpus)
    listing = hashlib.sha256()
    for file in files:
        stat = file.stat()
        listing.update(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {"corpus": corpus, "files": len(files), "files_sha256": listing.hexdigest(), "max_bytes": max_bytes,
            "tokenizer": tokenizer.name, "dtype": TOKEN_DTYPE.str}


def _write_atomically(path: Path, write: Callable[[object], None]) -> None:
    """write(f) into a temporary file beside path, then rename it over path (never half-written)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on path, so ranks on one machine tokenise once; none where the filesystem
    refuses locks (then racing ranks each write the same bytes, which the atomic rename makes safe)."""
    try:
        import fcntl
        f = open(path, "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def token_file(corpus: str, max_bytes: int, folder: str | Path,
               tokenizer: ByteTokenizer | None = None) -> tuple[Path, int]:
    """The corpus's token stream (documents tokenised and joined by eos, cut at max_bytes tokens) as a flat
    uint16 file folder/tokens.u16 with a JSON sidecar tokens.json (token count and the key it was made from);
    reused when the sidecar's key matches, rebuilt otherwise. Returns (path, token count)."""
    tokenizer = tokenizer or ByteTokenizer()
    if tokenizer.vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"a vocabulary of {tokenizer.vocab_size} ids does not fit the uint16 token file")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path, sidecar = folder / "tokens.u16", folder / "tokens.json"
    key = _token_key(corpus, max_bytes, tokenizer)
    with _file_lock(folder / "tokens.lock"):
        count = _reusable(path, sidecar, key)
        if count is None:
            count = _tokenise(corpus, max_bytes, tokenizer, path)
            _write_atomically(sidecar, lambda f: f.write(json.dumps({"tokens": count, "key": key}, indent=1).encode()))
    return path, count


def _reusable(path: Path, sidecar: Path, key: dict) -> int | None:
    """The token count of an existing token file made from key, or None."""
    try:
        meta = json.loads(sidecar.read_text())
        if meta["key"] == key and path.stat().st_size == meta["tokens"] * TOKEN_DTYPE.itemsize:
            return int(meta["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _tokenise(corpus: str, max_bytes: int, tokenizer: ByteTokenizer, path: Path) -> int:
    """Write the token stream to path (atomically, piece by piece); returns its token count."""
    count = 0

    def write(f) -> None:
        nonlocal count
        for file in corpus_files(corpus):
            with open(file, encoding="utf-8") as text:  # universal newlines: "\r\n" and "\r" read as "\n"
                while piece := text.read(READ_CHARS):
                    ids = np.frombuffer(tokenizer.encode_bytes(piece)[: max_bytes - count], dtype=np.uint8)
                    f.write(ids.astype(TOKEN_DTYPE).tobytes())
                    count += ids.size
                    if count == max_bytes:
                        return
            f.write(np.array([tokenizer.eos_id], dtype=TOKEN_DTYPE).tobytes())
            count += 1
            if count == max_bytes:
                return

    _write_atomically(path, write)
    return count


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic, the same on every platform)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class RowPermutation:
    """A seeded bijection of [0, size), evaluated per index in O(1) memory: a balanced Feistel network on
    the smallest even number of bits covering size (round keys from blake2b of seed and epoch, round
    function splitmix64's finaliser), cycle-walking any image >= size back into range."""

    def __init__(self, size: int, seed: int, epoch: int) -> None:
        self.size = size
        self.half = max(1, ((size - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        digest = hashlib.blake2b(f"rows/{seed}/{epoch}".encode(), digest_size=8 * FEISTEL_ROUNDS).digest()
        self.keys = np.frombuffer(digest, dtype="<u8").astype(np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x >> shift, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << shift) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """The images of indices (each in [0, size)) as int64."""
        out = self._encrypt(np.atleast_1d(np.asarray(indices, dtype=np.uint64)))
        walking = out >= self.size
        while walking.any():
            out[walking] = self._encrypt(out[walking])
            walking = out >= self.size
        return out.astype(np.int64)


class MicroBatch:
    """One micro-batch of one rank: inputs and labels [B, S] int64 on the feed's device, its rows read from
    the token file when first asked for (never on the meta device, where they are uninitialised)."""

    def __init__(self, read: Callable[[], np.ndarray] | None, shape: tuple[int, int], device: torch.device) -> None:
        self._read, self._shape, self._device = read, shape, device
        self._rows: np.ndarray | None = None
        self._tensors: dict[str, Tensor] = {}

    @classmethod
    def of(cls, inputs: Tensor, labels: Tensor) -> MicroBatch:
        """A micro-batch of given tensors (random tokens of a measurement, a test's batch)."""
        batch = cls(None, tuple(inputs.shape), inputs.device)
        batch._tensors = {"inputs": inputs, "labels": labels}
        return batch

    @property
    def inputs(self) -> Tensor:
        """Tokens [B, S] (int64)."""
        return self._tensor("inputs", slice(None, -1))

    @property
    def labels(self) -> Tensor:
        """Next tokens [B, S] (int64): the rows shifted by one."""
        return self._tensor("labels", slice(1, None))

    def _tensor(self, name: str, columns: slice) -> Tensor:
        if name not in self._tensors:
            if self._device.type == "meta":
                self._tensors[name] = torch.empty(self._shape, dtype=torch.int64, device=self._device)
            else:
                if self._rows is None:
                    self._rows = self._read()
                host = torch.from_numpy(self._rows[:, columns].astype(np.int64))
                if self._device.type == "cuda":
                    host = host.pin_memory()
                self._tensors[name] = host.to(self._device, non_blocking=True)
                if len(self._tensors) == 2:
                    self._rows = None
        return self._tensors[name]


def _read_rows(tokens: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows [B, seq_len + 1] of a memory-mapped [rows, seq_len + 1] token view (the only data read)."""
    return np.asarray(tokens[rows])


class DataFeed:
    """This DP rank's micro-batches of cfg's corpus (split "train": the sampled training rows; "eval": the
    held-out tail in stored order), read through a memory map of the token file in RUN_DIR/data/. On the
    meta device nothing is tokenised or read: the row count is estimated from the corpus's file sizes."""

    def __init__(self, cfg: RunConfig, dp_rank: int, device: torch.device, split: str = "train") -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split = {split!r}; allowed: 'train', 'eval'")
        settings, data = cfg.train, cfg.data
        self.device, self.split, self.seed = torch.device(device), split, settings.seed
        self.batch_size, self.seq_len = settings.micro_batch_size, settings.seq_len
        self.grad_accum, self.dp, self.dp_rank = settings.grad_accum_steps, cfg.parallel.dp, dp_rank
        if self.device.type == "meta":
            path = None
            total = min(sum(f.stat().st_size + 1 for f in corpus_files(data.corpus)), data.max_bytes)
        else:
            path, total = token_file(data.corpus, data.max_bytes, Path(settings.run_dir) / "data")
        eval_tokens = int(total * data.eval_fraction)
        first, end = (0, total - eval_tokens) if split == "train" else (total - eval_tokens, total)
        width = self.seq_len + 1
        self.rows = (end - first) // width
        if split == "train" and self.rows < self.batch_size:
            raise ValueError(f"corpus has {end - first} training tokens: fewer than one micro-batch of "
                             f"{self.batch_size} x {width}; lower train.micro_batch_size or train.seq_len")
        self._path, self._total, self._first = path, total, first
        self.epoch, self.cursor = 0, 0

    @functools.cached_property
    def _tokens(self) -> np.ndarray:
        """The split's rows [rows, seq_len + 1] as a view of the memory-mapped token file (nothing read yet)."""
        width = self.seq_len + 1
        mapped = np.memmap(self._path, dtype=TOKEN_DTYPE, mode="r")
        if mapped.size != self._total:
            raise RuntimeError(f"{self._path} changed under this run: {mapped.size} tokens, not {self._total}")
        return mapped[self._first: self._first + self.rows * width].reshape(self.rows, width)

    def _batch(self, rows: Callable[[], np.ndarray]) -> MicroBatch:
        read = None if self.device.type == "meta" else lambda: _read_rows(self._tokens, rows())
        return MicroBatch(read, (self.batch_size, self.seq_len), self.device)

    def _sampled(self, epoch: int, start: int) -> np.ndarray:
        return RowPermutation(self.rows, self.seed, epoch)(np.arange(start, start + self.batch_size))

    def next_step(self) -> list[MicroBatch]:
        """This DP rank's micro-batches of the next global batch (train.grad_accum_steps micro-batches,
        DP rank d takes [d * share, (d + 1) * share)); advances the sampler by the whole global batch
        (indices only: nothing is read). An epoch ends when fewer rows than one micro-batch's remain."""
        share = self.grad_accum // self.dp
        mine = range(self.dp_rank * share, (self.dp_rank + 1) * share)
        out = []
        for k in range(self.grad_accum):
            if self.cursor + self.batch_size > self.rows:
                self.epoch, self.cursor = self.epoch + 1, 0
            if k in mine:
                out.append(self._batch(functools.partial(self._sampled, self.epoch, self.cursor)))
            self.cursor += self.batch_size
        return out

    def held_out(self, count: int) -> list[MicroBatch]:
        """This DP rank's contiguous share of the first `count` micro-batches of rows in stored order
        (count a multiple of parallel.dp)."""
        if count % self.dp:
            raise ValueError(f"held_out({count}): the count must be a multiple of parallel.dp = {self.dp}")
        available = self.rows // self.batch_size
        if available < count:
            raise ValueError(f"the held-out data has {available} micro-batches, fewer than the {count} evaluation "
                             f"needs: raise data.eval_fraction or lower train.eval_batches")
        share, b = count // self.dp, self.batch_size
        return [self._batch(functools.partial(np.arange, k * b, (k + 1) * b))
                for k in range(self.dp_rank * share, (self.dp_rank + 1) * share)]

    def state_dict(self) -> dict[str, int]:
        """The sampler's position: the epoch and the rows taken in it."""
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by state_dict."""
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
