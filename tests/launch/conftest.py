"""Fixtures of the launch tests shared across their modules (session-wide: each corpus written and each run trained
once): test_equivalence's corpora and single-process runs, which test_zero compares with too, and test_checkpoint's
saving single-process run, which test_watchdog's restart continues too."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from launch.checkpoint.checkpointer import consolidate
from launch.config.run import build_config
from launch.train.loop import train
from tests.launch.checkpoint.test_checkpoint import config
from tests.launch.train.test_equivalence import (CUT, ROUTING, STEPS, corpus_of, cut_raw, drop_text, raw_config,
                                                 routed_corpus)
from tests.syncs import step_reads


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    lines = [f"def function_{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(800)]
    path.write_text("".join(lines))
    return str(path)


@pytest.fixture(scope="session")
def documents(tmp_path_factory) -> str:
    """A corpus folder of 600 documents of 4 to 16 bytes: each file one document, so every row of 17 tokens holds
    an EOS (data.document_mask has boundaries to keep)."""
    folder = tmp_path_factory.mktemp("documents")
    for i in range(600):
        (folder / f"{i:04d}.txt").write_text(f"x{i}=" + "ab"[i % 2] * (i % 11) + "\n")
    return str(folder)


@pytest.fixture(scope="session")
def drop_corpus(tmp_path_factory) -> str:
    """The capacity runs' corpus (test_equivalence.drop_text): no two tokens of a micro-batch are equal in exact
    arithmetic, so no drop is decided by rounding."""
    path = tmp_path_factory.mktemp("drop_corpus") / "text.txt"
    path.write_text(drop_text())
    return str(path)


@pytest.fixture(scope="session")
def reference(corpus, documents, drop_corpus, tmp_path_factory):
    """(routing name, attention, MTP depth, document mask) -> (records, consolidated params) of the single process,
    each trained on first use."""
    out = {}

    def run(name: str, attention: str = "gqa", mtp_depth: int = 0, document_mask: bool = False
            ) -> tuple[list[dict], dict]:
        key = (name, attention, mtp_depth, document_mask)
        if key not in out:
            run_dir = tmp_path_factory.mktemp("ref")
            text = routed_corpus(ROUTING[name], corpus_of(document_mask, corpus, documents), drop_corpus)
            raw = raw_config(str(run_dir), text, {}, ROUTING[name], attention, mtp_depth, document_mask)
            watched = attention == "gqa" and not mtp_depth and not document_mask  # the reads a test checks
            with step_reads() if watched else contextlib.nullcontext([]) as steps:
                records = train(build_config(raw), progress=False)
            if watched:
                run.reads[key] = [([(r.kind, r.where) for r in s.reads], s.copies) for s in steps]
            out[key] = (records, consolidate(run_dir / "checkpoint"))
        return out[key]
    run.reads = {}  # key -> per forward and backward: (host reads (kind, where), statistics copies), tests/syncs.py
    return run


@pytest.fixture(scope="session")
def uninterrupted(corpus, tmp_path_factory) -> tuple[Path, list[dict], Path]:
    """The 1-process run that resharded runs continue (cut_raw): its run dir and records, and the run dir of its
    first CUT steps run alone (copy it before resuming from it)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    whole = train(build_config(cut_raw(root / "whole", corpus, {}, STEPS)), progress=False)
    train(build_config(cut_raw(root / "cut", corpus, {}, CUT)), progress=False)
    return root / "whole", whole, root / "cut"


@pytest.fixture(scope="session")
def saved_reference(corpus, tmp_path_factory) -> tuple[list[dict], Path]:
    """test_checkpoint's uninterrupted 1-process run (config), checkpointed every 2 steps: its records and run dir."""
    run_dir = tmp_path_factory.mktemp("reference")
    return train(build_config(config(run_dir, corpus, {}, every=2, keep_checkpoints=5)), progress=False), run_dir
