"""`moe-bench train`: the trainer's tokens/s on several layouts of one config, side by side in one run.

Every row trains the config's model on the same global batch through launch.train.loop.train (the product's
step, untouched), each rank one process with one thread. The layouts run in rounds (launch.bench.harness:
each round launches every layout once, for --warmup + --steps steps, and takes the median wall time of its
timed steps, optimizer and metrics collectives included), so a shared machine's drift hits every layout of a
round alike; the table shows the median over --rounds rounds with its spread, the speedup over the single
process taken round by round with its spread, the parallel efficiency (speedup / ranks) and marks a layout
whose ranks outnumber this machine's cores. Rows: the single process, pp=2 DualPipeV on 2 processes, the
config's own layout, and that layout with the pipeline's overlap switch off (no F&B pair runs its EP
all-to-all behind the other chunk); --only keeps some of them (the single process, every speedup's baseline,
always runs). The last loss is printed beside each row: the same global batch gives (nearly) the same loss.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

from launch.bench.harness import fields, ratio_fields, rounds
from launch.bench.progress import BenchProgress, run_ranks
from launch.bench.report import HIGHER, LOWER, header, header_line, table, write_json
from launch.config.run import build_config, read_toml
from launch.train.loop import train

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
COLUMNS = [("layout", "layout", "s"), ("ranks", "ranks", "d"), ("over cores", "oversubscribed", ""),
           ("tokens/s", "tokens_per_s", ".0f"), ("step ms", "step_ms", ".0f"), ("spread", "step_ms_spread", ".0%"),
           ("x 1 process", "speedup", ".2f"), ("spread", "speedup_spread", ".0%"), ("efficiency", "efficiency", ".2f"),
           ("idle", "pipeline_idle", ".2f"), ("peak MiB", "peak_memory_mib", ".0f"), ("last loss", "last_loss", ".4f")]


def layouts(parallel: dict) -> dict[str, dict]:
    """The rows' [parallel] sections: single process, pp=2 DualPipeV, the config's layout, its overlap off."""
    own = " ".join(f"{k}={parallel[k]}" for k in ("pp", "dp", "tp", "ep", "schedule") if k in parallel)
    return {"1 process": {}, "pp=2 dualpipev": {"pp": 2, "schedule": "dualpipev"},
            f"config: {own}": dict(parallel), f"config: {own}, overlap off": {**parallel, "overlap_fb_pairs": False}}


def _train_rank(rank: int, world: int, opts: dict) -> list[dict]:
    return train(build_config(opts["raw"]), progress=False)


def with_layout(raw: dict, parallel: dict, steps: int) -> dict:
    """raw with this [parallel] section, steps steps, no evaluation or checkpoints, every step's per-rank
    figures; validated."""
    run = copy.deepcopy(raw)
    run["parallel"] = parallel
    run.setdefault("train", {}).update(steps=steps, eval_batches=0, checkpoint_every=0, rank_metrics_every=1)
    build_config(run)
    return run


def launch(run: dict, warmup: int) -> dict:
    """Train run (a raw config) once in its layout's processes: the median step seconds after warmup steps and
    the run's other figures."""
    cfg = build_config(run)
    with tempfile.TemporaryDirectory(prefix="moe-bench-train-") as run_dir:
        run = {**run, "train": {**run["train"], "run_dir": run_dir}}
        records = run_ranks(_train_rank, cfg.parallel.world_size, {"raw": run},
                            "lower --steps or choose a smaller --config")[0]
    timed = records[warmup:]
    tokens = cfg.train.grad_accum_steps * cfg.train.micro_batch_size * cfg.train.seq_len
    return {"step": statistics.median(tokens / r["tokens_per_s"] for r in timed), "ranks": cfg.parallel.world_size,
            "tokens": tokens,
            "pipeline_idle": statistics.mean(statistics.mean(r["ranks"]["pipeline_idle_fraction"]) for r in timed),
            "peak_memory_mib": max(max(r["ranks"]["peak_memory_bytes"]) for r in timed) / 2**20,
            "last_loss": records[-1]["lm_loss"]}


def measure(runs: dict[str, dict], warmup: int, repeats: int, progress: BenchProgress) -> list[dict]:
    """Every layout in rounds; one row each (its last round's idle, memory and loss)."""
    last: dict[str, dict] = {}

    def call(name: str) -> float:
        last[name] = launch(runs[name], warmup)
        return last[name]["step"]

    timed = rounds({name: partial(call, name) for name in runs}, 0, repeats, what="training run", progress=progress)
    base = timed[next(iter(runs))]["time"]
    rows = []
    for name, steps in ((name, t["time"]) for name, t in timed.items()):
        got = last[name]
        speedup = base / steps  # round by round
        rows.append({"layout": name, "ranks": got["ranks"], "oversubscribed": got["ranks"] > (os.cpu_count() or 1),
                     "tokens_per_s": got["tokens"] / steps.median, **fields("step_ms", steps),
                     **ratio_fields("speedup", speedup), "efficiency": speedup.median / got["ranks"],
                     **{k: got[k] for k in ("pipeline_idle", "peak_memory_mib", "last_loss")}})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run every layout and print the table (and write --json)."""
    parser = argparse.ArgumentParser(prog="moe-bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML config (default: configs/tiny.toml)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every layout once (default 3)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout and round (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first in every run (default 2)")
    parser.add_argument("--only", nargs="+", metavar="LAYOUT",
                        help="run only these layouts (names as printed) beside the single process")
    parser.add_argument("--json", help="also write the rows with the common header to this file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error(f"--steps = {args.steps} and --rounds = {args.rounds} must be >= 1 and --warmup = "
                     f"{args.warmup} >= 0")
    raw = read_toml(args.config)
    rows_of = layouts(raw.get("parallel", {}))
    unknown = sorted(set(args.only or ()) - set(rows_of))
    if unknown:
        parser.error(f"--only {', '.join(map(repr, unknown))}: not a layout of this config; choose from "
                     f"{', '.join(map(repr, rows_of))}")
    kept = {name: parallel for i, (name, parallel) in enumerate(rows_of.items())
            if i == 0 or not args.only or name in args.only}  # the first row, one process, is every baseline
    runs = {name: with_layout(raw, parallel, args.warmup + args.steps)  # every row checked before any runs
            for name, parallel in kept.items()}
    rows = measure(runs, args.warmup, args.rounds, BenchProgress("train"))
    head = header("train", list(sys.argv[2:] if argv is None else argv),
                  [f"config {args.config}; each rank one process with one thread; {args.rounds} rounds of every "
                   f"layout in turn, each run {args.warmup} + {args.steps} steps (its median step); median over "
                   f"rounds, spread = IQR / median; speedup over 1 process round by round; efficiency = speedup / "
                   f"ranks; over cores: ranks > {os.cpu_count()} cores here"])
    print(header_line(head))
    print(head["notes"][0])
    print(table(rows, COLUMNS, left=1))
    if args.json:
        write_json(args.json, head, rows, key=["layout"],
                   metrics={"tokens_per_s": HIGHER, "step_ms": LOWER, "peak_memory_mib": LOWER})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
