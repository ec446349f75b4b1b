"""Tokenizers of the data path: UTF-8 bytes, or a byte-level BPE of the `tokenizers` library (a tokenizer.json,
or a Hugging Face model folder holding one); `train_tokenizer` trains such a BPE on local files, offline.

A long document is tokenised in chunks (`chunks`), cut only at a single space between two non-space characters:
there GPT-2-style byte-level pre-tokenizers (and whitespace-splitting ones) split anyway and a BPE never merges
across a pre-token, so the chunks' ids, concatenated, are the whole document's. A tokenizer whose pre-tokenizer
or normalizer does not split there (checked once on PROBE_TEXT: `exact_cuts`) is given whole documents."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from launch.files import write_atomically

BYTES = "bytes"
EOS_TOKEN = "<|endoftext|>"  # what train_tokenizer adds as id 0
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
PROBE_TEXT = ("Hello world, it's 2024: naïve café costs 3.50 € (or £3). Tabs\tand  two spaces; "
              "def f(x):\n    return x ** 2  # done\n\nÜber 🙂 emoji, 中文 text and the end.")
"""A sample of words, numbers, punctuation, indents, non-Latin scripts: a tokenizer must give the same ids for it
whole and cut at each of its cut points before its documents are chunked."""


def cut_point(text: str, size: int, start: int = 0) -> int:
    """Where to cut text[start:] into a chunk of at most size characters: the last single space between two
    non-space characters at index <= start + size (the cut goes before it), else the first one past that; 0 when
    text[start:] has none."""
    at = start + size + 1
    while (at := text.rfind(" ", start + 1, at)) > 0:
        if _cuttable(text, at):
            return at
    at = start + size
    while (at := text.find(" ", at + 1)) > 0:
        if _cuttable(text, at):
            return at
    return 0


def _cuttable(text: str, at: int) -> bool:
    return at + 1 < len(text) and not text[at - 1].isspace() and not text[at + 1].isspace()


def chunks(pieces: Iterable[str], size: int) -> Iterator[str]:
    """One document's text (given in pieces of any size) re-cut into chunks of about size characters at
    cut_point; at least one chunk (an empty document: ""). A stretch longer than size with no cut point stays
    whole (the bound on memory holds for text with spaces)."""
    rest, start, given = "", 0, False
    for piece in pieces:
        rest, start = rest[start:] + piece, 0
        while len(rest) - start > size and (at := cut_point(rest, size, start)):
            given = True
            yield rest[start:at]
            start = at
    if len(rest) > start or not given:
        yield rest[start:]


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

    exact_cuts = True  # a text's bytes are its pieces' bytes wherever it is cut


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

    @functools.cached_property
    def exact_cuts(self) -> bool:
        """Whether PROBE_TEXT cut at any of its cut points tokenises as it does whole (then chunks are exact)."""
        whole = self.encode_batch([PROBE_TEXT])[0].tolist()
        cuts = [at for at in range(1, len(PROBE_TEXT)) if PROBE_TEXT[at] == " " and _cuttable(PROBE_TEXT, at)]
        halves = self.encode_batch([part for at in cuts for part in (PROBE_TEXT[:at], PROBE_TEXT[at:])])
        return all(a.tolist() + b.tolist() == whole for a, b in zip(halves[::2], halves[1::2]))


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
