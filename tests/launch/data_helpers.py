"""Small data fixtures of the data tests: a text corpus, prepared sources made of known token arrays, configs."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from launch.config.run import build_config
from launch.data.shards import new_manifest, write_shards
from launch.data.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_TOKENIZER = ROOT / "configs" / "tiny-bpe.json"


def write_corpus(folder: Path, docs: int = 13, seed: int = 0) -> Path:
    """A folder of small text files (non-ASCII characters and CRLF line ends included)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    words = ["alpha", "beta", "gämma", "δέλτα", "epsilon", "zeta\r\n", "eta\n", "θ", "🙂"]
    for i in range(docs):
        (folder / f"doc{i:02d}.txt").write_bytes(" ".join(rng.choice(words) for _ in range(40 + 7 * i)).encode())
    return folder


def make_source(folder: Path, docs: list[np.ndarray], shard_tokens: int = 1 << 20) -> Path:
    """A prepared dataset (byte tokenizer) holding docs (token arrays < 256), each followed by EOS 0."""
    folder.mkdir(parents=True)
    write_shards(folder, iter([(d, True) for d in docs]), new_manifest(ByteTokenizer(), {"test": str(folder)}),
                 shard_tokens)
    return folder


def tagged_source(folder: Path, tag: int, tokens: int, seed: int = 0, shard_tokens: int = 1 << 20) -> Path:
    """A prepared dataset whose tokens all lie in [60 tag + 1, 60 tag + 59] (and EOS 0): each token names its
    source. Documents of random lengths up to 300 tokens."""
    rng = np.random.default_rng(seed + 1000 * tag)
    docs, total = [], 0
    while total < tokens:
        doc = rng.integers(60 * tag + 1, 60 * tag + 60, size=int(rng.integers(1, 300)))
        docs.append(doc)
        total += doc.size + 1
    return make_source(folder, docs, shard_tokens)


def config(run_dir: Path, corpus: Path | None = None, dp: int = 1, data: dict | None = None, pp: int = 1,
           **train):
    """A small run config: micro-batches of 3 x 15 tokens, 4 per step over all DP ranks."""
    settings = {"micro_batch_size": 3, "grad_accum_steps": 4, "seq_len": 15, "seed": 0, "run_dir": str(run_dir), **train}
    section = {"max_bytes": 1_000_000, "eval_fraction": 0.1, "prefetch_steps": 0, **(data or {})}
    if corpus is not None:
        section["corpus"] = str(corpus)
    parallel = {"dp": dp, "pp": pp, "schedule": "1f1b" if pp > 1 else "none"}
    return build_config({"train": settings, "parallel": parallel, "data": section})
