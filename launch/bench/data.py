"""`moe-bench data`: tokens/s of `moe-data prepare` and of the loader per rank, beside a plain `datasets.map` +
in-memory tensor peer, with the anonymous memory (RssAnon) each holds.

The corpus is Python's standard-library sources repeated up to --mbytes MB of text files. Prepare rows: ours
tokenises into shards on disk (launch.data_cli.prepare); the peer loads the same files with `datasets`, maps the
same tokenizer over them (its default batches) and concatenates every token into one int64 tensor in memory;
each runs in a fresh process. Loader rows: DP rank 0
of --dp ranks takes --steps global batches of --micro-batch x --seq-len token rows (its share: grad_accum / dp
micro-batches) from our DataFeed over the prepared shards (prefetch off and on: with nothing to overlap, the
thread cannot hide the reads, so the two should be close), and from random rows of the peer's tensor. Memory is
the RssAnon rise of this process while the row's structure is built and used (mapped shard pages excluded).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from launch.bench.progress import Progress, run_ranks
from launch.bench.report import HIGHER, LOWER, header, header_line, table, write_json
from launch.config import build_config
from launch.data import DataFeed, corpus_files
from launch.data_cli import _tokenise, load_documents, prepare
from launch.shards import Prepared
from launch.tokenizer import load_tokenizer

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[2] / "configs" / "tiny-bpe.json"
COLUMNS = [("path", "path", "s"), ("stage", "stage", "s"), ("tokens/s", "tokens_per_s", ".0f"),
           ("RssAnon MiB", "rss_anon_mib", ".1f")]


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


def loader_rows(dataset: Path, args, prefetch: int) -> tuple[int, float, float]:
    """(tokens DP rank 0 took, seconds, RssAnon rise MiB) of --steps steps of our DataFeed over dataset."""
    vocab = load_tokenizer(args.tokenizer).vocab_size
    cfg = build_config({"model": {"max_seq_len": args.seq_len, "vocab_size": max(vocab, 256)},
                        "train": {"micro_batch_size": args.micro_batch, "grad_accum_steps": 2 * args.dp,
                                  "seq_len": args.seq_len, "run_dir": str(dataset.parent)},
                        "parallel": {"dp": args.dp},
                        "data": {"sources": [{"path": str(dataset), "weight": 1.0}], "prefetch_steps": prefetch,
                                 "tokenizer": args.tokenizer}})

    def run() -> int:
        feed = DataFeed(cfg, 0, torch.device("cpu"))
        taken = 0
        for _ in range(args.steps):
            for mb in feed.next_step():
                taken += mb.inputs.shape.numel() + 0 * mb.labels.shape.numel()  # both made
        feed.close()
        return taken

    return timed(run)


def peer_loader(tokens: torch.Tensor, args) -> tuple[int, float, float]:
    """(tokens, seconds, RssAnon rise MiB) of the same number of random rows gathered from the in-memory tensor."""
    width, generator = args.seq_len + 1, torch.Generator().manual_seed(0)

    def run() -> int:
        taken = 0
        for _ in range(args.steps * 2):  # grad_accum / dp = 2 micro-batches per rank per step
            starts = torch.randint(0, tokens.numel() - width, (args.micro_batch,), generator=generator)
            rows = torch.stack([tokens[s:s + width] for s in starts.tolist()])
            inputs, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
            taken += inputs.numel() + 0 * labels.numel()
        return taken

    return timed(run)


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
    progress = Progress("data", not args.quiet)
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
        for prefetch in (0, 1):
            progress(f"DataFeed, prefetch {prefetch}: {args.steps} steps")
            taken, seconds, rise = loader_rows(tmp / "dataset", args, prefetch)
            rows.append({"path": f"DataFeed over shards, prefetch {prefetch}", "stage": stage,
                         "tokens_per_s": taken / seconds, "rss_anon_mib": rise})
        taken, seconds, rise = peer_loader(tensor, args)
        rows.append({"path": "random rows of the in-memory tensor", "stage": stage, "tokens_per_s": taken / seconds,
                     "rss_anon_mib": rise + tensor.nbytes / 2**20})
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
                   metrics={"tokens_per_s": HIGHER, "rss_anon_mib": LOWER})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
