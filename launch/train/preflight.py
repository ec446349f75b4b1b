"""Checks of a whole run config beyond each section's own, run before any process is spawned.

build_config already refuses unknown sections and keys, wrong types, out-of-range values and
inconsistent layouts; check_run adds what needs the whole config or the machine: finite numbers,
optimizer ranges, the tokenizer (its vocabulary within model.vocab_size), the data (the corpus readable and
large enough for one micro-batch; prepared sources complete, of the configured tokenizer, every shard of its
listed size), a writable run directory and model.init_from (a Hugging Face folder of this model: launch.checkpoint.hf.load).
Every error names the field and what is allowed. A launch reads no shard's contents here (each rank checks the
shards it opens: launch.data.shards); `moe-train --check` (verify) also checks every shard's CRC-32, those of
data.sources and of the corpus the run directory holds prepared.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
from pathlib import Path

from launch.checkpoint.hf.load import check_init_from
from launch.config.run import RunConfig, load_config
from launch.data.feed import READ_CHARS, corpus_files, corpus_key, text_pieces
from launch.data.shards import Prepared, read_manifest
from launch.data.tokenizer import load_tokenizer
from launch.parallel.device import check_device
from launch.train.graphs import check_graphable


def _check_finite(cfg: RunConfig) -> None:
    """Every float field of every section is a finite number."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for item in dataclasses.fields(values):
            value = getattr(values, item.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{section.name}.{item.name} = {value!r} must be a finite number")


def _check_optimizer(cfg: RunConfig) -> None:
    """AdamW's betas in [0, 1), weight decay >= 0."""
    for name in ("beta1", "beta2"):
        value = getattr(cfg.train, name)
        if not 0 <= value < 1:
            raise ValueError(f"train.{name} = {value!r} must be in [0, 1) (e.g. 0.9 / 0.95)")
    if cfg.train.weight_decay < 0:
        raise ValueError(f"train.weight_decay = {cfg.train.weight_decay!r} must be >= 0")


def _check_corpus(cfg: RunConfig, verify: bool) -> None:
    """The corpus's files hold at least one micro-batch of training tokens (one byte is one token); with verify,
    every file is UTF-8 text (read through) and the run directory's prepared copy of this corpus (if any) is
    intact."""
    files = corpus_files(cfg.data.corpus)
    unreadable = [str(f) for f in files if not os.access(f, os.R_OK)]
    if unreadable:
        raise ValueError(f"data.corpus = {cfg.data.corpus!r}: cannot read {', '.join(unreadable[:3])}")
    for file in files if verify else ():
        collections.deque(text_pieces(file, READ_CHARS, "data.corpus file"), maxlen=0)
    tokens = min(sum(f.stat().st_size + 1 for f in files), cfg.data.max_bytes)
    needed = cfg.train.micro_batch_size * (cfg.train.seq_len + 1)
    if tokens * (1 - cfg.data.eval_fraction) < needed:
        raise ValueError(f"data.corpus = {cfg.data.corpus!r} with data.max_bytes = {cfg.data.max_bytes} gives about "
                         f"{tokens} tokens, fewer than one micro-batch (train.micro_batch_size x (train.seq_len + 1) "
                         f"= {needed}): give a larger corpus or lower those fields")
    prepared = Path(cfg.train.run_dir) / "data"
    manifest = read_manifest(prepared)
    if verify and manifest is not None and manifest["complete"] and manifest["key"] == corpus_key(cfg.data):
        Prepared(prepared, verify=True, field="data.corpus")


def _check_data(cfg: RunConfig, verify: bool) -> None:
    """The tokenizer loads and model.vocab_size covers it; then the corpus, or every prepared source (manifest
    complete, made by this tokenizer, shards of the listed sizes (with verify: and CRC-32s), at least one row
    each)."""
    data, width = cfg.data, cfg.train.seq_len + 1
    tokenizer = load_tokenizer(data.tokenizer)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the vocabulary of data.tokenizer "
                         f"= {data.tokenizer!r} ({tokenizer.vocab_size} ids): allowed model.vocab_size >= "
                         f"{tokenizer.vocab_size}")
    if not data.sources:
        _check_corpus(cfg, verify)
        return
    rows = 0
    for name, entries in (("data.sources", data.sources), ("data.eval_sources", data.eval_sources)):
        for i, source in enumerate(entries):
            tokens = Prepared(source["path"], tokenizer.digest, verify=verify, field=f"{name}[{i}].path").tokens
            if tokens < width:
                raise ValueError(f"{name}[{i}].path = {source['path']!r} holds {tokens} tokens, fewer than one row "
                                 f"of train.seq_len + 1 = {width}")
            rows += tokens // width if name == "data.sources" else 0
    if rows < cfg.train.micro_batch_size:
        raise ValueError(f"data.sources hold {rows} rows of train.seq_len + 1 = {width} tokens, fewer than one "
                         f"micro-batch (train.micro_batch_size = {cfg.train.micro_batch_size})")


def _check_run_dir(cfg: RunConfig) -> None:
    """train.run_dir is a folder this process can create or write into."""
    path = Path(cfg.train.run_dir).resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"train.run_dir = {cfg.train.run_dir!r} is a file; allowed: a folder path (new or writable)")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        raise ValueError(f"train.run_dir = {cfg.train.run_dir!r} is not writable ({existing} refuses writes); "
                         f"allowed: a folder path this user can write")


def _check_machine(cfg: RunConfig) -> None:
    """The device can run the ranks (launch.parallel.device), and train.cuda_graphs can capture their step
    (launch.train.graphs.check_graphable)."""
    check_device(cfg.train.device, cfg.parallel.comm_backend, cfg.model.expert_precision,
                 cuda_graphs=cfg.train.cuda_graphs)
    check_graphable(cfg)


def _check_init_from(cfg: RunConfig) -> None:
    """model.init_from, when set, is a Hugging Face DeepSeek-V3 folder of this very model (launch.checkpoint.hf.load)."""
    if cfg.model.init_from:
        check_init_from(cfg.model)


def check_run(cfg: RunConfig, verify: bool = False) -> None:
    """Raise ValueError naming the field unless the whole run can start (no process is spawned); with verify, every
    prepared shard's CRC-32 too."""
    for check in (_check_finite, _check_optimizer, _check_machine, functools.partial(_check_data, verify=verify),
                  _check_run_dir, _check_init_from):
        check(cfg)


def check_config(path: str | Path, overrides: list[str] = (), verify: bool = False) -> RunConfig:
    """load_config plus check_run: the config a launch (verify: `moe-train --check`) accepts."""
    cfg = load_config(path, overrides)
    check_run(cfg, verify)
    return cfg
