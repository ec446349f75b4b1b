"""`moe-bench checkpoint`: a checkpoint save and load of the trainer's own state on the config's layout.

Every rank builds its stages and ZeRO-1 optimizer as the trainer does (launch.train.build.build_model and
build_optimizer; the default is configs/tiny.toml's 4-process layout widened to 242M fp32 params: 241M before
the 512-id BPE vocabulary), takes one
optimizer step so AdamW's state exists, then saves two checkpoints through launch.checkpoint.checkpointer.Checkpointer,
synchronously in one run and asynchronously in another (fresh processes, so one mode's freed memory does not
hide the other's). Per mode, slowest rank: the first save (save() and finish(): first-call setup, host
buffers allocated) and the largest rise of a rank's resident memory above its level before the saves over
it and a second save; then --repeats rounds (launch.bench.harness) of a save's time in save() (asynchronous:
the training thread's stall) and in finish() (the wait and the publication), a load of the newest
checkpoint, TrainState.to_flat alone (the state dict handed to DCP) and the peer, each with its spread; and
the checkpoint's bytes on disk. Peer, in the same processes: each rank torch.save's its own ZeRO-1 shards
(master and AdamW state, one file, fsync'd), the floor of writing a rank's share.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

import launch.checkpoint.checkpointer
from launch.bench.harness import fields, ratio_fields, rounds, slowest
from launch.bench.progress import BenchProgress, BudgetExceeded, call_budget, run_ranks, worker_progress
from launch.bench.report import LOWER, emit, header
from launch.checkpoint.checkpointer import Checkpointer, TrainState
from launch.config.run import RunConfig, build_config, read_toml
from launch.parallel.mesh import Mesh
from launch.train.build import build_model, build_optimizer
from moe.model import MoETransformer

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
WIDE = {"hidden_size": 1024, "dense_ffn_size": 5120, "expert_ffn_size": 2560, "num_heads": 8, "num_kv_heads": 4}
COLUMNS = [("mode", "mode", "s"), ("params M", "params_m", ".0f"), ("ranks", "ranks", "d"),
           ("first save s", "first_s", ".2f"), ("save s", "save_s", ".2f"), ("spread", "save_s_spread", ".0%"),
           ("to_flat s", "to_flat_s", ".2f"), ("finish s", "finish_s", ".2f"), ("load s", "load_s", ".2f"),
           ("peak extra MiB", "peak_extra_mib", ".0f"), ("disk MB", "disk_mb", ".0f"),
           ("peer save s", "peer_s", ".2f"), ("save / peer", "ratio", ".2f"), ("spread", "ratio_spread", ".0%")]


class Position:
    """The sampler's checkpointed position (the benchmark feeds no data)."""

    def state_dict(self) -> dict[str, int]:
        """A fixed position."""
        return {"epoch": 0, "cursor": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Nothing to restore."""


def _rss() -> int:
    """This process's resident bytes."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rise() -> Iterator[list[int]]:
    """Yields a list that holds, after the block, the largest rise of resident memory above its level at entry."""
    base, peak, stop = _rss(), [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], _rss() - base)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], _rss() - base)


def _timed(fn, what: str, opts: dict) -> float:
    """Seconds fn() takes, under the per-call budget (opts["call_budget"]); rank 0 says what runs."""
    worker_progress("checkpoint", dist.get_rank(), opts)(what)
    began = time.perf_counter()
    with call_budget(opts["call_budget"], what, opts):
        fn()
    return time.perf_counter() - began


def _rank(rank: int, world: int, opts: dict) -> dict:
    cfg = build_config(opts["raw"])
    mesh = Mesh(cfg.layout)
    stages, _ = build_model(cfg, mesh, torch.device("cpu"))
    optimizer = build_optimizer(stages, cfg, mesh)
    optimizer.zero_grad(set_to_none=False)
    optimizer.step()  # AdamW's state exists from here
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = TrainState(stages, optimizer, scheduler, Position())
    root = Path(opts["root"])
    checkpointer = Checkpointer(root / "checkpoint", keep=1, asynchronous=opts["mode"] == "async")
    _timed(lambda: state.to_flat(1, {}), "state dict of the trainer's state", opts)
    dist.barrier()
    with peak_rise() as peak:
        first_s = _timed(lambda: (checkpointer.save(state, 1, {}), checkpointer.finish()), "first save", opts)
        dist.barrier()
        _timed(lambda: (checkpointer.save(state, 2, {}), checkpointer.finish()), "second save", opts)
    shards = [(s.masters, s.get_state()) for s in optimizer._shards]
    step = iter(range(3, 3 + opts["repeats"]))

    def save() -> dict[str, float]:
        dist.barrier()
        began = time.perf_counter()
        checkpointer.save(state, next(step), {})
        mid = time.perf_counter()
        checkpointer.finish()
        return {"save": mid - began, "finish": time.perf_counter() - mid}

    def load() -> float:
        dist.barrier()
        began = time.perf_counter()
        checkpointer.load(state)
        return time.perf_counter() - began

    def peer() -> None:
        with (root / f"peer{rank}.pt").open("wb") as handle:
            torch.save(shards, handle)
            handle.flush()
            os.fsync(handle.fileno())

    def to_flat() -> None:
        state.to_flat(1, {})

    timed = rounds({"save": save, "load": load, "to_flat": to_flat, "peer": peer}, 0,
                   opts["repeats"], opts["call_budget"], opts, "call", progress=worker_progress("checkpoint", rank, opts))
    disk = sum(f.stat().st_size for f in (root / "checkpoint").glob("step*/*")) if rank == 0 else 0
    return {"first_s": first_s, "save_s": timed["save"]["save"], "finish_s": timed["save"]["finish"],
            "to_flat_s": timed["to_flat"]["time"], "load_s": timed["load"]["time"], "peer_s": timed["peer"]["time"],
            "peak_extra_mib": peak[0] / 2**20, "disk_mb": disk / 1e6, "checkpoint_module": launch.checkpoint.checkpointer.__file__}


def widened(raw: dict) -> dict:
    """raw with the 242M-parameter [model] widths (WIDE) in fp32, validated."""
    run = copy.deepcopy(raw)
    run["model"].update(WIDE)
    run.setdefault("train", {})["dtype"] = "float32"
    build_config(run)
    return run


def measure(mode: str, raw: dict, progress: BenchProgress, call_budget_s: float = 0.0, repeats: int = 3) -> dict:
    """The saves and the load in `mode` ("sync" or "async") on the config's layout: the row (slowest rank's
    seconds, largest rise of a rank's memory)."""
    cfg = build_config(raw)
    with tempfile.TemporaryDirectory(prefix="moe-bench-checkpoint-") as root:
        ranks = run_ranks(_rank, cfg.parallel.world_size, {"raw": raw, "root": root, "mode": mode, "call_budget": call_budget_s,
                                                                  "repeats": repeats},
                          "choose a smaller --config", progress=progress)
    row = {"mode": mode, "ranks": cfg.parallel.world_size, "params_m": single_process_params(cfg) / 1e6,
           "checkpoint_module": ranks[0]["checkpoint_module"]}
    for key in ("first_s", "peak_extra_mib"):
        row[key] = max(r[key] for r in ranks)
    timings = {key: slowest([r[key] for r in ranks]) for key in ("save_s", "finish_s", "to_flat_s", "load_s", "peer_s")}
    for key, timing in timings.items():
        row.update(fields(key, timing, scale=1.0))
    row["disk_mb"] = ranks[0]["disk_mb"]
    row.update(ratio_fields("ratio", (timings["save_s"] + timings["finish_s"]) / timings["peer_s"]))  # round by round
    return row


def single_process_params(cfg: RunConfig) -> int:
    """Parameters of the single-process model."""
    with torch.device("meta"):
        return sum(p.numel() for p in MoETransformer(cfg.model).parameters())


def main(argv: list[str] | None = None) -> int:
    """Run the synchronous and the asynchronous save and print the table (and write --json)."""
    parser = argparse.ArgumentParser(prog="moe-bench checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML config (default: configs/tiny.toml)")
    parser.add_argument("--as-is", action="store_true", help="keep the config's [model] (default: widen it to 242M)")
    parser.add_argument("--json", help="also write the rows with the common header to this file")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of save, load, state dict and peer")
    parser.add_argument("--call-budget", type=float, default=600.0,
                        help="seconds one save, load or peer call may take before the run stops naming it (0: none)")
    args = parser.parse_args(argv)
    if args.call_budget < 0:
        parser.error(f"--call-budget = {args.call_budget} must be >= 0 seconds (0: no budget)")
    if args.repeats < 1:
        parser.error(f"--repeats = {args.repeats} must be >= 1")
    raw = read_toml(args.config)
    raw = raw if args.as_is else widened(raw)
    progress = BenchProgress("checkpoint")
    rows = []
    try:
        for mode in ("sync", "async"):
            progress(f"{mode} save and load")
            rows.append(measure(mode, raw, progress, args.call_budget, args.repeats))
    except BudgetExceeded as err:
        print(f"moe-bench checkpoint: stopped: {err}", file=sys.stderr)
        return 3
    head = header("checkpoint", list(sys.argv[2:] if argv is None else argv),
                  [f"config {args.config}{'' if args.as_is else ' widened to ' + str(WIDE)}; {args.repeats} rounds of "
                   f"save, load, state dict and peer in turn after two saves (the first timed alone, both under the "
                   f"memory probe): median of each round's slowest rank (spread = IQR / median; ratio round by "
                   f"round), largest rank's memory rise; checkpoint code {rows[0]['checkpoint_module']}"])
    emit(head, rows, COLUMNS, args.json, ["mode"],
         {"save_s": LOWER, "finish_s": LOWER, "load_s": LOWER, "peak_extra_mib": LOWER})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
