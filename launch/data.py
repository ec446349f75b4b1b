"""Training text: a local corpus read with `datasets`, a byte-level tokenizer, and sequence packing."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; id 0 (NUL, absent from text) separates documents."""

    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        """Token ids of text."""
        return list(text.encode("utf-8"))

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


def load_token_stream(corpus: str, max_bytes: int, tokenizer: ByteTokenizer) -> Tensor:
    """All documents of the corpus, tokenised and joined by eos, cut at max_bytes tokens (int64)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    files = [str(f) for f in corpus_files(corpus)]
    documents = datasets.load_dataset("text", data_files=files, sample_by="document", split="train")
    stream = bytearray()
    for row in documents:
        stream.extend(tokenizer.encode(row["text"]))
        stream.append(tokenizer.eos_id)
        if len(stream) >= max_bytes:
            break
    return torch.frombuffer(stream[:max_bytes], dtype=torch.uint8).long()


class PackedBatches:
    """Token stream packed into rows of seq_len+1; shuffled batches of (inputs, labels)."""

    def __init__(self, stream: Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        rows = stream.numel() // (seq_len + 1)
        if rows < batch_size:
            raise ValueError(f"corpus has {stream.numel()} tokens: fewer than one batch of "
                             f"{batch_size} x {seq_len + 1}; lower train.micro_batch_size or train.seq_len")
        self.rows = stream[: rows * (seq_len + 1)].view(rows, seq_len + 1)
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._cursor = 0

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """The next (inputs [B, S], labels [B, S]); reshuffles at the end of each epoch."""
        if self._cursor + self.batch_size > self._order.numel():
            self._order = torch.randperm(self.rows.shape[0], generator=self.generator)
            self._cursor = 0
        picked = self.rows[self._order[self._cursor: self._cursor + self.batch_size]]
        self._cursor += self.batch_size
        return picked[:, :-1], picked[:, 1:]

    def in_order(self, num_batches: int) -> list[tuple[Tensor, Tensor]]:
        """The first num_batches batches of rows in stored order (for evaluation)."""
        count = min(num_batches, self.rows.shape[0] // self.batch_size)
        rows = [self.rows[i * self.batch_size: (i + 1) * self.batch_size] for i in range(count)]
        return [(r[:, :-1], r[:, 1:]) for r in rows]

    def state_dict(self) -> dict:
        """Sampler position, so a resumed run sees the same batches."""
        return {"generator": self.generator.get_state(), "order": self._order, "cursor": self._cursor}

    def load_state_dict(self, state: dict) -> None:
        """Restore the sampler position saved by state_dict."""
        self.generator.set_state(state["generator"])
        self._order, self._cursor = state["order"], state["cursor"]
