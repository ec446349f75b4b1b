"""`moe-bench data`: tokens/s of `moe-data prepare` and of the loader per rank, beside a plain `datasets.map` +
in-memory tensor peer, with the anonymous memory (RssAnon) each holds.

The corpus is Python's standard-library sources repeated up to --mbytes MB of text files. Prepare rows: ours
tokenises into shards on disk (launch.data.cli.prepare); the peer loads the same files with `datasets`, maps the
same tokenizer over them (its default batches) and concatenates every token into one int64 tensor in memory;
each runs in a fresh process. Loader rows: DP rank 0
of --dp ranks takes --steps global batches of --micro-batch x --seq-len token rows (its share: grad_accum / dp
micro-batches) from our DataFeed over the prepared shards (prefetch off and on: with nothing to overlap, the
thread cannot hide the reads, so the two should be close), and from random rows of the peer's tensor, one step of
each in turn per round (launch.bench.harness). Memory is the RssAnon rise of this process while the loader is built
and takes its first step (mapped shard pages excluded; the peer's: its whole tensor).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from launch.bench.harness import fields, rounds
from launch.bench.progress import BenchProgress, run_ranks
from launch.bench.report import HIGHER, LOWER, header, header_line, table, write_json
from launch.config.run import build_config
from launch.data.feed import DataFeed, corpus_files
from launch.data.cli import _tokenise, load_documents, prepare
from launch.data.shards import Prepared
from launch.data.tokenizer import load_tokenizer

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[2] / "configs" / "tiny-bpe.json"
COLUMNS = [("path", "path", "s"), ("stage", "stage", "s"), ("tokens/s", "tokens_per_s", ".0f"),
           ("step ms", "step_ms", ".2f"), ("spread", "step_ms_spread", ".2f"), ("RssAnon MiB", "rss_anon_mib", ".1f")]


def rss_anon() -> int:
    """This process's anonymous resident bytes (mapped files excluded)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def write_corpus(folder: Path, mbytes: float) -> list[str]:
    """Standard-library sources copied as .txt documents until mbytes MB; the folder as moe-data's input."""
    folder.mkdir()
    budget, sources, n = int(mbytes * 2**20), corpus_files("stdlib"), 0
    while budget > 0:
        text = sources[n % len(sources)].read_bytes()[:budget]
        (folder / f"{n:05d}.txt").write_bytes(text)
        budget, n = budget - len(text), n + 1
    return [str(folder)]


def timed(fn):
    """(fn's result, seconds, RssAnon rise in MiB) of one call."""
    before, began = rss_anon(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - began, (rss_anon() - before) / 2**20


def _prepare_rank(rank: int, world: int, opts: dict) -> dict:
    """In a fresh process: (tokens, seconds, RssAnon rise MiB) of ours ("ours") or the peer's prepare."""
    import datasets  # noqa: F401  (imported before timing: both prepare paths use it)

    tmp, num_proc = Path(opts["tmp"]), opts["num_proc"]
    if opts["ours"]:
        manifest, seconds, rise = timed(lambda: prepare(opts["inputs"], opts["tokenizer"], tmp / "dataset", "text",
                                                        num_proc, progress=False))
        return {"tokens": manifest["tokens"], "seconds": seconds, "rise": rise}
    tensor, seconds, rise = timed(lambda: peer_prepare(opts["inputs"], opts["tokenizer"], tmp / "peer-cache",
                                                       num_proc))
    return {"tokens": tensor.numel(), "seconds": seconds, "rise": rise}


def peer_prepare(inputs: list[str], tokenizer_spec: str, cache: Path, num_proc: int) -> torch.Tensor:
    """`datasets.map` of the tokenizer (EOS after each document), every token in one int64 tensor in memory."""
    tokenizer = load_tokenizer(tokenizer_spec)
    ds, _ = load_documents(inputs, "text", cache, num_proc)
    ids = ds.map(_tokenise, batched=True, fn_kwargs={"tokenizer": tokenizer}, remove_columns=["text"],
                 num_proc=num_proc if num_proc > 1 else None)
    eos = np.array([tokenizer.eos_id])
    return torch.from_numpy(np.concatenate([piece for doc in ids.with_format("numpy")["ids"] for piece in (doc, eos)])
                            .astype(np.int64))


def loader_steps(dataset: Path, args, prefetch: int) -> tuple[Callable[[], int], float, DataFeed]:
    """One step of our DataFeed over dataset as DP rank 0 (returns the tokens it took), the RssAnon rise in MiB
    of building the feed and taking its first step, and the feed (to close)."""
    vocab = load_tokenizer(args.tokenizer).vocab_size
    cfg = build_config({"model": {"max_seq_len": args.seq_len, "vocab_size": max(vocab, 256)},
                        "train": {"micro_batch_size": args.micro_batch, "grad_accum_steps": 2 * args.dp,
                                  "seq_len": args.seq_len, "run_dir": str(dataset.parent)},
                        "parallel": {"dp": args.dp},
                        "data": {"sources": [{"path": str(dataset), "weight": 1.0}], "prefetch_steps": prefetch,
                                 "tokenizer": args.tokenizer}})

    def step() -> int:
        return sum(mb.inputs.shape.numel() + 0 * mb.labels.shape.numel() for mb in feed.next_step())  # both made

    before = rss_anon()
    feed = DataFeed(cfg, 0, torch.device("cpu"))
    step()
    return step, (rss_anon() - before) / 2**20, feed


def peer_steps(tokens: torch.Tensor, args) -> Callable[[], int]:
    """One step's random rows (grad_accum / dp = 2 micro-batches) gathered from the peer's in-memory tensor."""
    width, generator = args.seq_len + 1, torch.Generator().manual_seed(0)

    def step() -> int:
        taken = 0
        for _ in range(2):
            starts = torch.randint(0, tokens.numel() - width, (args.micro_batch,), generator=generator)
            rows = torch.stack([tokens[s:s + width] for s in starts.tolist()])
            inputs, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
            taken += inputs.numel() + 0 * labels.numel()
        return taken

    return step


def main(argv: list[str] | None = None) -> int:
    """Prepare and load with ours and the peer; print the table (and write --json)."""
    parser = argparse.ArgumentParser(prog="moe-bench data", description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", type=float, default=16.0, help="MB of text (default 16)")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="default: configs/tiny-bpe.json")
    parser.add_argument("--num-proc", type=int, default=1, help="processes of prepare and of the peer's map")
    parser.add_argument("--dp", type=int, default=4, help="DP ranks the global batch is split over (default 4)")
    parser.add_argument("--steps", type=int, default=200, help="loader steps (default 200)")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch (default 8)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per row (default 1024)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--json", help="also write the rows with the common header to this file")
    args = parser.parse_args(argv)
    for name in ("mbytes", "num_proc", "dp", "steps", "micro_batch", "seq_len"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} = {getattr(args, name)} must be > 0")
    progress = BenchProgress("data", not args.quiet)
    tmp = Path(tempfile.mkdtemp(prefix="moe-bench-data-"))
    rows: list[dict] = []
    try:
        inputs = write_corpus(tmp / "corpus", args.mbytes)
        prepared = {}
        for ours, name in ((True, "moe-data prepare (shards on disk)"), (False, "datasets.map + in-memory tensor")):
            progress(f"{name}: {args.mbytes:g} MB, {args.num_proc} process(es)")
            opts = {"tmp": str(tmp), "inputs": inputs, "tokenizer": args.tokenizer, "num_proc": args.num_proc,
                    "ours": ours}
            prepared[ours] = run_ranks(_prepare_rank, 1, opts, "lower --mbytes")[0]
            rows.append({"path": name, "stage": "prepare", "rss_anon_mib": prepared[ours]["rise"],
                         "tokens_per_s": prepared[ours]["tokens"] / prepared[ours]["seconds"]})
        if prepared[True]["tokens"] != prepared[False]["tokens"]:
            print(f"moe-bench data: the peer made {prepared[False]['tokens']} tokens, ours "
                  f"{prepared[True]['tokens']}: not the same stream", file=sys.stderr)
            return 1
        dataset = Prepared(tmp / "dataset")
        tensor = torch.from_numpy(dataset.read([0], dataset.tokens)[0].astype(np.int64))  # the peer's tensor
        stage = f"load, DP rank 0 of {args.dp}"
        steps, rises, feeds = {}, {}, []
        for prefetch in (0, 1):
            name = f"DataFeed over shards, prefetch {prefetch}"
            steps[name], rises[name], feed = loader_steps(tmp / "dataset", args, prefetch)
            feeds.append(feed)
        peer = "random rows of the in-memory tensor"
        steps[peer], rises[peer] = peer_steps(tensor, args), tensor.nbytes / 2**20
        tokens = {name: step() for name, step in steps.items()}  # per step, the same for every contender
        progress(f"loaders: {args.steps} rounds of one step each")
        timings = rounds({name: lambda step=step: step() and None for name, step in steps.items()}, 0, args.steps)
        for feed in feeds:
            feed.close()
        for name, timing in timings.items():
            rows.append({"path": name, "stage": stage, **fields("step_ms", timing["time"]),
                         "tokens_per_s": tokens[name] / timing["time"].median, "rss_anon_mib": rises[name]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    head = header("data", list(sys.argv[2:] if argv is None else argv),
                  [f"{args.mbytes:g} MB of stdlib text, tokenizer {args.tokenizer} "
                   f"({dataset.tokens} tokens); each prepare in a fresh process; loader rows {args.micro_batch} x "
                   f"{args.seq_len}, {args.steps} steps; the peer's loader memory counts its whole tensor"])
    print(header_line(head))
    print(table(rows, COLUMNS))
    if args.json:
        write_json(args.json, head, rows, key=["path", "stage"],
                   metrics={"tokens_per_s": HIGHER, "step_ms": LOWER, "rss_anon_mib": LOWER})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
