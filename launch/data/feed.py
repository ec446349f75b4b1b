"""Training data per rank: prepared token shards, a weighted blend of sources, an index-only sampler, prefetch.

With data.sources the run reads datasets `moe-data prepare` made (launch.data.shards); otherwise data.corpus is
prepared once, through the same tokenizer and shard writer, into RUN_DIR/data/ (reused while the corpus files,
data.max_bytes and the tokenizer are unchanged; ranks on one machine take a lock, the first writes). Each
source's token stream is cut into rows of seq_len + 1 tokens (the corpus: its training rows first, then the
held-out tail of data.eval_fraction). The global order of samples (launch.data.sampler) depends only on the seed,
the blend and the row counts, so every layout sees the same global batches; each DP rank memory-maps the
shards and reads only its own micro-batches' rows, a background thread reading data.prefetch_steps steps
ahead (into pinned memory on CUDA).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from launch.data.sampler import Blend
from launch.data.shards import DataRefused, Prepared, new_manifest, prepare_folder
from launch.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from launch.config.run import RunConfig
    from launch.config.sections import DataSettings

__all__ = ["ByteTokenizer", "DataFeed", "MicroBatch", "corpus_files", "corpus_key", "prepare_corpus"]

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
READ_CHARS = 1 << 20  # characters read per piece while tokenising: memory stays flat on any corpus
CORPUS_SHARD_TOKENS = 1 << 26


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


def corpus_key(data: DataSettings) -> dict:
    """What the run directory's prepared corpus is made from: the corpus files (paths, sizes, mtimes; as a
    digest) and data.max_bytes (the tokenizer is the manifest's own field)."""
    files = corpus_files(data.corpus)
    listing = hashlib.sha256()
    for file in files:
        stat = file.stat()
        listing.update(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {"corpus": data.corpus, "files": len(files), "files_sha256": listing.hexdigest(),
            "max_tokens": data.max_bytes}


def text_pieces(file: Path, chars: int, field: str = "input") -> Iterator[str]:
    """A UTF-8 text file in pieces of chars characters (universal newlines: "\\r\\n" and "\\r" read as "\\n"); a
    file that is not UTF-8 text is refused (DataRefused naming field and file)."""
    read = 0
    with open(file, encoding="utf-8") as text:
        while True:
            try:
                piece = text.read(chars)
            except UnicodeDecodeError as error:
                raise DataRefused(f"{field} {str(file)!r} is not UTF-8 text ({error.reason}, within the "
                                  f"{chars:,} characters after character {read:,}): give text files") from None
            if not piece:
                return
            read += len(piece)
            yield piece


def _text_pieces(corpus: str, skip: int) -> Iterator[tuple[str, bool]]:
    """(text, whether it ends its document) of each file after the first skip, in pieces of READ_CHARS
    characters."""
    for file in corpus_files(corpus)[skip:]:
        pieces = text_pieces(file, READ_CHARS, "data.corpus file")
        piece = next(pieces, "")
        while True:
            following = next(pieces, "")
            yield piece, not following
            if not following:
                break
            piece = following


def corpus_pieces(corpus: str, tokenizer: Tokenizer, skip: int = 0) -> Iterator[tuple[np.ndarray, bool]]:
    """(token ids, whether the piece ends its document) of the corpus's files after the first skip; about
    READ_CHARS characters go to the tokenizer per call (which spreads them over its threads)."""
    batch: list[tuple[str, bool]] = []
    for piece in _text_pieces(corpus, skip):
        batch.append(piece)
        if sum(len(text) for text, _ in batch) >= READ_CHARS:
            yield from zip(tokenizer.encode_batch([t for t, _ in batch]), [e for _, e in batch])
            batch = []
    if batch:
        yield from zip(tokenizer.encode_batch([t for t, _ in batch]), [e for _, e in batch])


def prepare_corpus(data: DataSettings, folder: str | Path, tokenizer: Tokenizer | None = None) -> Prepared:
    """data.corpus tokenised by data.tokenizer into the prepared folder (reused when made from the same corpus,
    max_bytes and tokenizer; continued after a crash; rebuilt otherwise), opened for reading."""
    tokenizer = tokenizer or load_tokenizer(data.tokenizer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with _file_lock(folder / "prepare.lock"):
        prepare_folder(folder, new_manifest(tokenizer, corpus_key(data)),
                       lambda skip: corpus_pieces(data.corpus, tokenizer, skip), CORPUS_SHARD_TOKENS,
                       max_tokens=data.max_bytes, replace=True)
    return Prepared(folder, tokenizer.digest, field="data.corpus")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on path, so ranks on one machine tokenise once; none where the filesystem
    refuses locks (then racing ranks each write the same bytes, which the atomic renames make safe)."""
    try:
        import fcntl
        f = open(path, "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        with contextlib.suppress(OSError):
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


@dataclass
class Segment:
    """Tokens [first, end) of a prepared stream (data None: counted only, on the meta device)."""

    data: Prepared | None
    first: int
    end: int


class Rows:
    """Rows of width tokens cut from segments in order, numbered across them."""

    def __init__(self, segments: list[Segment], width: int) -> None:
        self.segments, self.width = segments, width
        self.bounds = np.cumsum([0] + [(s.end - s.first) // width for s in segments])
        self.count = int(self.bounds[-1])

    def read(self, rows: np.ndarray) -> np.ndarray:
        """Rows [len(rows), width] as int64 (only these tokens are read)."""
        out = np.empty((rows.size, self.width), dtype=np.int64)
        where = np.searchsorted(self.bounds, rows, side="right") - 1
        for k in np.unique(where).tolist():
            pick = where == k
            seg = self.segments[k]
            out[pick] = seg.data.read(seg.first + (rows[pick] - self.bounds[k]) * self.width, self.width)
        return out


def _read_rows(rows: Rows, indices: np.ndarray) -> np.ndarray:
    """The rows of one micro-batch of one source (the only data a rank reads)."""
    return rows.read(indices)


def _host_batch(read: Callable[[], np.ndarray], pin: bool) -> tuple[Tensor, Tensor]:
    """(inputs, labels) int64 host tensors of the rows read() returns (pinned for a copy to a GPU)."""
    rows = torch.from_numpy(read())
    pair = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    return tuple(t.pin_memory() for t in pair) if pin else pair


class MicroBatch:
    """One micro-batch of one rank: inputs and labels [B, S] int64 on the feed's device, read when first asked
    for or ahead by the feed's prefetch thread (never on the meta device, where they are uninitialised)."""

    def __init__(self, load: Callable[[], tuple[Tensor, Tensor]] | None, shape: tuple[int, int],
                 device: torch.device) -> None:
        self._load, self._shape, self._device = load, shape, device
        self._host: tuple[Tensor, Tensor] | None = None
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
        return self._tensor("inputs", 0)

    @property
    def labels(self) -> Tensor:
        """Next tokens [B, S] (int64): the rows shifted by one."""
        return self._tensor("labels", 1)

    def _tensor(self, name: str, which: int) -> Tensor:
        if name not in self._tensors:
            if self._device.type == "meta":
                self._tensors[name] = torch.empty(self._shape, dtype=torch.int64, device=self._device)
            else:
                if self._host is None:
                    self._host = self._load()
                self._tensors[name] = self._host[which].to(self._device, non_blocking=True)
                if len(self._tensors) == 2:
                    self._host = None
        return self._tensors[name]


def _estimated_segment(data: DataSettings) -> Segment:
    """The corpus counted from its files' sizes, read nowhere (the meta device)."""
    total = min(sum(f.stat().st_size + 1 for f in corpus_files(data.corpus)), data.max_bytes)
    return Segment(None, 0, total)


def _open_source(path: str, digest: str, device: torch.device) -> Segment:
    data = Prepared(path, digest, field="data source")
    return Segment(data if device.type != "meta" else None, 0, data.tokens)


def data_segments(cfg: RunConfig, split: str, device: torch.device) -> tuple[list[list[Segment]], list[float]]:
    """(per source the segments of split, the sources' weights): data.sources (train) or data.eval_sources
    (eval, read in order as one source), else the prepared corpus's training rows or its held-out tail."""
    data = cfg.data
    if data.sources:
        digest = load_tokenizer(data.tokenizer).digest
        if split == "eval":
            return [[_open_source(s["path"], digest, device) for s in data.eval_sources]], [1.0]
        return [[_open_source(s["path"], digest, device)] for s in data.sources], [s["weight"] for s in data.sources]
    if device.type == "meta":
        whole = _estimated_segment(data)
    else:
        prepared = prepare_corpus(data, Path(cfg.train.run_dir) / "data")
        whole = Segment(prepared, 0, prepared.tokens)
    held = int(whole.end * data.eval_fraction)
    if split == "eval":
        return [[Segment(whole.data, whole.end - held, whole.end)]], [1.0]
    return [[Segment(whole.data, 0, whole.end - held)]], [1.0]


class DataFeed:
    """This DP rank's micro-batches of cfg's data (split "train": the blended, sampled training rows; "eval": the
    held-out rows in stored order), read through memory maps of the prepared shards. On the meta device nothing is
    tokenised or read (the corpus's row count is estimated from its files' sizes)."""

    def __init__(self, cfg: RunConfig, dp_rank: int, device: torch.device, split: str = "train") -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split = {split!r}; allowed: 'train', 'eval'")
        settings = cfg.train
        self.device, self.split, self.seed = torch.device(device), split, settings.seed
        self.batch_size, self.seq_len = settings.micro_batch_size, settings.seq_len
        self.grad_accum, self.dp, self.dp_rank = settings.grad_accum_steps, cfg.parallel.dp, dp_rank
        segments, weights = data_segments(cfg, split, self.device)
        self.sources = [Rows(s, self.seq_len + 1) for s in segments]
        self.rows = sum(s.count for s in self.sources)
        if split == "train":
            for rows, path in zip(self.sources, [s["path"] for s in cfg.data.sources] or [cfg.data.corpus]):
                if rows.count < 1:
                    raise ValueError(f"data source {path!r} holds fewer tokens than one row of train.seq_len + 1 = "
                                     f"{self.seq_len + 1}")
            if self.rows < self.batch_size:
                raise ValueError(f"the training data has {self.rows} rows of {self.seq_len + 1} tokens: fewer than "
                                 f"one micro-batch; lower train.micro_batch_size or train.seq_len")
        self._blend = Blend(weights)
        self._taken = [0] * len(self.sources)
        self._consumed = self._position()
        self.prefetch = cfg.data.prefetch_steps if self.device.type != "meta" else 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="data-prefetch") if self.prefetch else None
        self._ahead: collections.deque[tuple[list[MicroBatch], dict[str, int]]] = collections.deque()

    def _sample_rows(self, picks: list[tuple[int, int]]) -> np.ndarray:
        """The rows [B, seq_len + 1] of picks ((source, index within the source) of each sample)."""
        chosen = self._blend.rows(picks, [s.count for s in self.sources], self.seed)
        out = np.empty((len(chosen), self.seq_len + 1), dtype=np.int64)
        for source in sorted({s for s, _ in chosen}):
            at = [i for i, (s, _) in enumerate(chosen) if s == source]
            out[at] = _read_rows(self.sources[source], np.array([chosen[i][1] for i in at], dtype=np.int64))
        return out

    def _batch(self, read: Callable[[], np.ndarray]) -> MicroBatch:
        shape = (self.batch_size, self.seq_len)
        if self.device.type == "meta":
            return MicroBatch(None, shape, self.device)
        load = functools.partial(_host_batch, read, self.device.type == "cuda")
        if self._pool is not None:
            load = self._pool.submit(load).result
        return MicroBatch(load, shape, self.device)

    def _plan_step(self) -> tuple[list[MicroBatch], dict[str, int]]:
        """The next global batch's samples (every rank assigns all of them: the same order everywhere); this
        rank's micro-batches of it (DP rank d takes [d * share, (d + 1) * share)), and the state after it."""
        picks = self._blend.assign(self._taken, self.grad_accum * self.batch_size)
        share, b = self.grad_accum // self.dp, self.batch_size
        out = [self._batch(functools.partial(self._sample_rows, picks[k * b:(k + 1) * b]))
               for k in range(self.dp_rank * share, (self.dp_rank + 1) * share)]
        return out, self._position()

    def _position(self) -> dict[str, int]:
        return {f"source{s}": n for s, n in enumerate(self._taken)}

    def next_step(self) -> list[MicroBatch]:
        """This DP rank's micro-batches of the next global batch (train.grad_accum_steps micro-batches over all
        DP ranks); with prefetch, the reads of this and the next data.prefetch_steps steps are under way."""
        while len(self._ahead) <= self.prefetch:
            self._ahead.append(self._plan_step())
        batches, self._consumed = self._ahead.popleft()
        return batches

    def held_out(self, count: int) -> list[MicroBatch]:
        """This DP rank's contiguous share of the first `count` micro-batches of rows in stored order
        (count a multiple of parallel.dp)."""
        if count % self.dp:
            raise ValueError(f"held_out({count}): the count must be a multiple of parallel.dp = {self.dp}")
        available = self.rows // self.batch_size
        if available < count:
            raise ValueError(f"the held-out data has {available} micro-batches, fewer than the {count} evaluation "
                             f"needs: raise data.eval_fraction (or add data.eval_sources) or lower "
                             f"train.eval_batches")
        share, b = count // self.dp, self.batch_size
        return [self._batch(functools.partial(_read_rows, self.sources[0], np.arange(k * b, (k + 1) * b)))
                for k in range(self.dp_rank * share, (self.dp_rank + 1) * share)]

    def close(self) -> None:
        """Stop the prefetch thread (reads under way finish; queued ones are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def state_dict(self) -> dict[str, int]:
        """The sampler's position after the last step handed out: samples taken from each source."""
        return dict(self._consumed)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by state_dict (in any layout); drops steps read ahead."""
        wanted = [f"source{s}" for s in range(len(self.sources))]
        if sorted(state) != sorted(wanted):
            raise ValueError(f"the checkpoint's sampler state has keys {sorted(state)}, this run's data has "
                             f"{len(wanted)} source(s) ({', '.join(wanted)}): the data order cannot be continued")
        self._ahead.clear()
        self._taken = [int(state[k]) for k in wanted]
        self._consumed = self._position()
