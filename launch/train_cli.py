"""`moe-train --config FILE`: MoE pretraining on a local corpus, on the ranks the config's [parallel] layout needs.

A plain `moe-train` spawns those ranks itself (add --nnodes/--node-rank/--master-addr/--master-port,
or run one moe-train per node under SLURM, for several nodes); under torchrun, mpiexec or srun
each process is one rank.
"""

from __future__ import annotations

import argparse
import sys

from launch.checkpoint.checkpointer import export_main
from launch.errors import cli
from launch.files import check_writable
from launch.train.launcher import LaunchError, NodeFlags, Trainer, launch_run, wait_for_every_refusal
from launch.train.preflight import check_config


@cli("moe-train")
def main(argv: list[str] | None = None, trainer: Trainer | None = None) -> int:
    """Parse arguments, validate the config and the launch (before any work), train, print a summary.

    trainer replaces launch.train.loop.train (tests pass a small stand-in with the same call shape).
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    parser = argparse.ArgumentParser(prog="moe-train", description=__doc__,
                                     epilog="moe-train export CHECKPOINT OUT.pt: one consolidated state dict; "
                                            "moe-train export CHECKPOINT OUT --format hf: a Hugging Face DeepSeek-V3 "
                                            "folder")
    parser.add_argument("--config", required=True, help="TOML run config (see configs/)")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--metrics-out", help="JSONL metrics file (default: RUN_DIR/metrics.jsonl)")
    parser.add_argument("--run-dir", help="override train.run_dir (checkpoints, metrics)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config value, e.g. --set model.expert_precision=fp8")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in RUN_DIR from its latest valid checkpoint (saved in any layout; "
                             "metrics.jsonl rewound to its step); refused (exit 2) when there is none")
    parser.add_argument("--resume-if-possible", action="store_true",
                        help="as --resume, but start at step 0 when RUN_DIR holds no valid checkpoint")
    parser.add_argument("--start-over", action="store_true",
                        help="begin a new run in a RUN_DIR that holds another run's checkpoints or metrics: they are "
                             "moved into RUN_DIR/previous/RUN_ID, never deleted")
    parser.add_argument("--allow-data-change", action="store_true",
                        help="with --resume: continue although the data settings differ from the checkpoint's (the "
                             "new data is read from its start)")
    parser.add_argument("--check", action="store_true", help="validate the config (every section, the corpus, the "
                                                             "run dir) and every prepared shard's CRC-32, and exit: "
                                                             "0 valid, 2 not")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--rehearse", action="store_true",
                        help="run one training step of the whole layout as one rank, here, on the meta device under "
                             "the fake process group: memory by category beside moe-plan's, every collective")
    parser.add_argument("--rank", type=int, help="with --rehearse: the rank to rehearse (default: the first rank of "
                                                 "the pipeline rank moe-plan gives the largest peak)")
    parser.add_argument("--device", choices=("meta", "cpu", "cuda"), help="with --rehearse: where the rank runs "
                        "(default meta; cpu or cuda: its stages materialised there, the step run for real, each "
                        "phase timed beside moe-plan's prediction)")
    parser.add_argument("--micro-batches", type=int, help="with --rehearse --device cpu|cuda: micro-batches of the "
                        "rank's step (default: 4, or the fewest the schedule takes)")
    parser.add_argument("--json", metavar="FILE", help="with --rehearse: also write the report as JSON (moe-plan "
                                                       "--measure-gpu reads it)")
    nodes = parser.add_argument_group("several nodes (moe-train's own spawn; torchrun, mpiexec and srun bring their own)")
    nodes.add_argument("--nnodes", type=int, help="nodes taking part (default 1, or SLURM_NNODES)")
    nodes.add_argument("--node-rank", type=int, help="this node's index in [0, nnodes) (default 0, or SLURM_NODEID)")
    nodes.add_argument("--master-addr", help="address of node 0, which hosts the rendezvous (default MASTER_ADDR, "
                                              "the first SLURM host, or 127.0.0.1)")
    nodes.add_argument("--master-port", type=int, help="rendezvous port on node 0 (default MASTER_PORT, or 29500 "
                                                        "with several nodes; one node picks a free port)")
    args = parser.parse_args(argv)
    _refuse_idle_flags(parser, args)
    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.run_dir is not None:
        overrides.append(f"train.run_dir={args.run_dir!r}")
    try:
        cfg = check_config(args.config, overrides, verify=args.check)
    except ValueError as error:
        raise ValueError(f"invalid config: {error}") from None
    if args.rehearse:
        from launch.plan.rehearse import rehearse, render, write_json  # here only: torch's tracing stack (~1 s)
        result = rehearse(cfg, args.rank, args.device or "meta", args.micro_batches)
        print(render(result))
        if args.json:
            write_json(result, args.json)
        return 0
    if args.metrics_out is not None:
        check_writable(args.metrics_out, "--metrics-out", make_folder=True)
    if args.check:
        world = cfg.parallel.world_size
        print(f"config OK: {args.config} runs on {world} process{'es' if world > 1 else ''}")
        return 0
    flags = NodeFlags(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    try:
        resume = args.resume or args.resume_if_possible
        records = launch_run(cfg, flags, trainer=trainer, start_over=args.start_over,
                             allow_data_change=args.allow_data_change, metrics_out=args.metrics_out, resume=resume,
                             require_checkpoint=not args.resume_if_possible, progress=not args.no_progress)
    except LaunchError as error:
        print(f"moe-train: {error}", file=sys.stderr, flush=True)
        if error.launch is not None:  # torchrun or mpiexec must not stop another rank before it said why
            wait_for_every_refusal(error.launch)
        return 2
    if records:
        first, last = records[0], records[-1]
        print(f"steps {first['step']}..{last['step']}: lm_loss {first['lm_loss']:.4f} -> {last['lm_loss']:.4f}; "
              f"run dir {cfg.train.run_dir}")
    return 0


def _refuse_idle_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that would do nothing, or contradict each other, end with parser.error (exit 2) naming them."""
    resume = [flag for flag, given in (("--resume", args.resume), ("--resume-if-possible", args.resume_if_possible))
              if given]
    for flag, given, does in (("--rank", args.rank, "chooses the rank"), ("--json", args.json, "writes the report"),
                              ("--device", args.device, "chooses the device"),
                              ("--micro-batches", args.micro_batches, "sets the step")):
        if given is not None and not args.rehearse:
            parser.error(f"{flag} {given} {does} of a rehearsal: allowed only with --rehearse")
    if args.micro_batches is not None and args.device in (None, "meta"):
        parser.error(f"--micro-batches {args.micro_batches} sets a real device's step: give --device cpu or cuda")
    if args.json is not None:
        check_writable(args.json, "--json", make_folder=True)
    if len(resume) == 2:
        parser.error("--resume and --resume-if-possible: give one")
    if args.start_over and resume:
        parser.error(f"--start-over begins a new run, {resume[0]} continues the old one: give one")
    if args.allow_data_change and not resume:
        parser.error("--allow-data-change applies to a resume: allowed only with --resume or --resume-if-possible")
    if args.master_port is not None and not 0 <= args.master_port <= 65535:
        parser.error(f"--master-port {args.master_port}: allowed 0 (a free port, one node) to 65535")


if __name__ == "__main__":
    raise SystemExit(main())
