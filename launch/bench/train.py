"""`moe-bench train`: the trainer's tokens/s on several layouts of one config, side by side in one run.

Every row trains the config's model on the same global batch for --warmup + --steps steps through
launch.train.train (the product's step, untouched), each rank one process with one thread, and
reports the median over the timed steps of the trainer's own tokens/s (global tokens / wall time
of a whole step, optimizer and metrics collectives included). Rows, in the order they run:
the single process, pp=2 DualPipeV on 2 processes, the config's own layout, and that layout with
the pipeline's overlap switch off (no F&B pair runs its EP all-to-all behind the other chunk).
The last loss is printed beside each row: the same global batch gives (nearly) the same loss.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

from launch.bench.progress import Progress, run_ranks
from launch.bench.report import HIGHER, LOWER, header, header_line, table, write_json
from launch.config import build_config, read_toml
from launch.train import train

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
COLUMNS = [("layout", "layout", "s"), ("ranks", "ranks", "d"), ("tokens/s", "tokens_per_s", ".0f"),
           ("x 1 process", "speedup", ".2f"), ("step ms", "step_ms", ".0f"), ("idle", "pipeline_idle", ".2f"),
           ("peak MiB", "peak_memory_mib", ".0f"), ("last loss", "last_loss", ".4f")]


def layouts(parallel: dict) -> dict[str, dict]:
    """The rows' [parallel] sections: single process, pp=2 DualPipeV, the config's layout, its overlap off."""
    own = " ".join(f"{k}={parallel[k]}" for k in ("pp", "dp", "tp", "ep", "schedule") if k in parallel)
    return {"1 process": {}, "pp=2 dualpipev": {"pp": 2, "schedule": "dualpipev"},
            f"config: {own}": dict(parallel), f"config: {own}, overlap off": {**parallel, "overlap": False}}


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


def measure(name: str, run: dict, warmup: int) -> dict:
    """Train run (a raw config) in its layout's processes; the row of figures over the steps after warmup."""
    cfg = build_config(run)
    with tempfile.TemporaryDirectory(prefix="moe-bench-train-") as run_dir:
        run = {**run, "train": {**run["train"], "run_dir": run_dir}}
        records = run_ranks(_train_rank, cfg.parallel.world_size, {"raw": run},
                            "lower --steps or choose a smaller --config")[0]
    timed = records[warmup:]
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in timed)
    tokens = cfg.train.grad_accum_steps * cfg.train.micro_batch_size * cfg.train.seq_len
    return {"layout": name, "ranks": cfg.parallel.world_size, "tokens_per_s": tokens_per_s,
            "step_ms": 1000 * tokens / tokens_per_s,
            "pipeline_idle": statistics.mean(statistics.mean(r["ranks"]["pipeline_idle_fraction"]) for r in timed),
            "peak_memory_mib": max(max(r["ranks"]["peak_memory_bytes"]) for r in timed) / 2**20,
            "last_loss": records[-1]["lm_loss"]}


def main(argv: list[str] | None = None) -> int:
    """Run every layout and print the table (and write --json)."""
    parser = argparse.ArgumentParser(prog="moe-bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML config (default: configs/tiny.toml)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per layout (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--json", help="also write the rows with the common header to this file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps = {args.steps} must be >= 1 and --warmup = {args.warmup} >= 0")
    raw = read_toml(args.config)
    runs = {name: with_layout(raw, parallel, args.warmup + args.steps)  # every row checked before any runs
            for name, parallel in layouts(raw.get("parallel", {})).items()}
    progress = Progress("train")
    rows = []
    for name, run in runs.items():
        progress(f"{name}: {args.warmup} + {args.steps} steps")
        rows.append(measure(name, run, args.warmup))
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    head = header("train", list(sys.argv[2:] if argv is None else argv),
                  [f"config {args.config}; each rank one process with one thread; median of {args.steps} steps "
                   f"after {args.warmup}"])
    print(header_line(head))
    print(table(rows, COLUMNS, left=1))
    if args.json:
        write_json(args.json, head, rows, key=["layout"],
                   metrics={"tokens_per_s": HIGHER, "step_ms": LOWER, "peak_memory_mib": LOWER})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
