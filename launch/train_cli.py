"""`moe-train --config FILE`: single-process MoE pretraining on a local corpus."""

from __future__ import annotations

import argparse
import sys

from launch.config import load_config


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, validate the config (before any work), train, print a summary."""
    parser = argparse.ArgumentParser(prog="moe-train", description=__doc__)
    parser.add_argument("--config", required=True, help="TOML run config (see configs/)")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--metrics-out", help="JSONL metrics file (default: RUN_DIR/metrics.jsonl)")
    parser.add_argument("--run-dir", help="override train.run_dir (checkpoints, metrics)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config value, e.g. --set model.expert_precision=fp8")
    parser.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoint.pt")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.run_dir is not None:
        overrides.append(f"train.run_dir={args.run_dir!r}")
    try:
        cfg = load_config(args.config, overrides)
    except ValueError as error:
        print(f"moe-train: invalid config: {error}", file=sys.stderr)
        return 2
    from launch.train import train

    records = train(cfg, args.metrics_out, resume=args.resume, progress=not args.no_progress)
    if records:
        first, last = records[0], records[-1]
        print(f"steps {first['step']}..{last['step']}: lm_loss {first['lm_loss']:.4f} -> {last['lm_loss']:.4f}; "
              f"run dir {cfg.train.run_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
