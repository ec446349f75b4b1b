"""Tokenizers of the data path: UTF-8 bytes, or a byte-level BPE of the `tokenizers` library (a tokenizer.json,
or a Hugging Face model folder holding one); `train_tokenizer` trains such a BPE on local files, offline."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from launch.files import write_atomically

BYTES = "bytes"
EOS_TOKEN = "<|endoftext|>"  # what train_tokenizer adds as id 0
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; id 0 (NUL, absent from text) ends each document."""

    vocab_size = 256
    eos_id = 0
    name = BYTES
    digest = "utf8-bytes/eos0"  # what a prepared dataset's manifest records

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids (end-of-document ids dropped, bad bytes replaced)."""
        return bytes(i for i in ids if i != self.eos_id).decode("utf-8", errors="replace")


class BPETokenizer:
    """A `tokenizers` tokenizer read from a tokenizer.json (or a model folder holding one and, optionally, a
    tokenizer_config.json naming its eos_token); its digest is the sha256 of its canonical JSON."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"data.tokenizer = {str(path)!r}: no such tokenizer.json (allowed: \"bytes\", a "
                             f"tokenizer.json, or a Hugging Face model folder holding one)")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as error:  # the Rust library raises its own exception type
            raise ValueError(f"data.tokenizer = {str(path)!r}: not a tokenizers JSON file ({error})") from None
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.digest = hashlib.sha256(self._tok.to_str().encode()).hexdigest()
        eos = _configured_eos(path) if path.is_dir() else None
        candidates = (eos,) if eos else EOS_CANDIDATES
        ids = [self._tok.token_to_id(t) for t in candidates]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"data.tokenizer = {str(path)!r} has no end-of-document token (looked for "
                             f"{', '.join(t for t in candidates)})")
        self.eos_id = found[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added; the library spreads the batch over its threads)."""
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids (special tokens dropped)."""
        return self._tok.decode([int(i) for i in ids])


Tokenizer = ByteTokenizer | BPETokenizer


def _configured_eos(folder: Path) -> str | None:
    """The eos_token a model folder's tokenizer_config.json names, if any."""
    try:
        eos = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def load_tokenizer(spec: str) -> Tokenizer:
    """data.tokenizer's tokenizer: "bytes", or a path to a tokenizer.json or a model folder."""
    return ByteTokenizer() if spec == BYTES else BPETokenizer(spec)


def train_tokenizer(texts: Iterator[str], vocab_size: int, out: str | Path) -> BPETokenizer:
    """Train a byte-level BPE of vocab_size ids (EOS_TOKEN is id 0) on texts and write it to out (a JSON file)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 256 + 1 <= vocab_size <= 1 << 20:
        raise ValueError(f"--vocab-size {vocab_size} must lie in [257, {1 << 20}] (256 bytes + the EOS token)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, lambda f: f.write(tok.to_str(pretty=True).encode()))
    return BPETokenizer(out)
