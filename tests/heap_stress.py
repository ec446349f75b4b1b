"""Heap-corruption stress of the multi-process paths under glibc's heap checks (issue 51, point 7); run by hand.

    python -m tests.heap_stress [--repeat 30] [--per-spawn 10] [--paths "tp2 sp reshard,cp2 ring reshard"]

or `MOE_HEAP_STRESS=1 python -m pytest -q tests/test_heap_stress.py` (MOE_HEAP_STRESS_REPEAT sets --repeat).
The process re-executes itself under tests.spawns.MALLOC_ENV (glibc's heap checks: MALLOC_CHECK_=3,
MALLOC_PERTURB_=165), so the fork server and every rank it forks run under them. Each path trains `repeat` times
(the async-checkpoint path: saves `repeat` checkpoints, ASYNC_SAVES a run), `per_spawn` runs in one 2-process
spawn (a fresh world between runs, as the equivalence suite's spawns do): a rank that aborts ends its spawn with a
WorkerError naming its signal and last stderr lines, which the report quotes. Paths (PATHS): tp2 SP and cp2 ring
resuming a 1-process checkpoint (resharded) and their own runs' saves, the async EP dispatch (dp2 ep2
hierarchical, 2 dispatch chunks in flight), pipeline DualPipeV (pp2), ZeRO-3 (dp2), and async checkpoint saves
(dp2). "planted" (never in the default list) frees a receive buffer's storage under a posted irecv and lets the
peer's send land in it: the harness must report it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from launch.config.run import build_config
from launch.parallel.spawn import WorkerError, run_processes
from launch.train.loop import train
from tests.launch.train.test_equivalence import CUT, LAYOUTS, STEPS, _train_runs, cut_raw
from tests.spawns import MALLOC_ENV

ASYNC_SAVES = 30  # checkpoints one run of the async-checkpoint path saves (one a step); its repetitions are saves
ASYNC = "dp2 async checkpoint"
PATHS = {  # name -> (parallel, optim, resumes a 1-process checkpoint)
    "tp2 sp reshard": (LAYOUTS["tp2 sp"], {}, True),
    "cp2 ring reshard": (LAYOUTS["cp2 ring"], {}, True),
    "dp2 ep2 async dispatch": ({**LAYOUTS["dp2 ep2 hierarchical"], "dispatch_chunks": 2}, {}, False),
    "pp2 dualpipev": (LAYOUTS["pp2 dualpipev"], {}, False),
    "dp2 zero3": ({"dp": 2}, {"zero_stage": 3}, False),
    ASYNC: ({"dp": 2}, {}, False),
}
PLANTED = "planted"
PLANTED_BYTES = 4096  # a heap block (glibc maps blocks of 128 KiB and more on their own)


def corpus(root: Path) -> str:
    """The equivalence suite's text corpus (tests/launch/conftest.py), under root."""
    path = root / "text.txt"
    path.write_text("".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(800)))
    return str(path)


def runs_of(name: str, run: int, root: Path, text: str, one: Path | None) -> list[tuple[dict, bool]]:
    """The (raw config, resume) trainings of one repetition of path name: a resharding path resumes a copy of the
    1-process checkpoint `one` in its layout and then runs its own first CUT steps afresh (both save); the async
    checkpoint path saves ASYNC_SAVES times; the others train STEPS steps."""
    parallel, optim, reshard = PATHS[name]
    where = root / name.replace(" ", "_") / f"run{run:03d}"
    if reshard:
        shutil.copytree(one, where / "from_one")
        return [(cut_raw(where / "from_one", text, parallel, STEPS, optim), True),
                (cut_raw(where / "own", text, parallel, CUT, optim), False)]
    if name == ASYNC:
        raw = cut_raw(where, text, parallel, ASYNC_SAVES, optim)
        raw["train"]["checkpoint_every"] = 1
        raw["ops"] = {"async_checkpoint": True, "keep_checkpoints": 2}
        return [(raw, False)]
    return [(cut_raw(where, text, parallel, STEPS, optim), False)]


def _planted(rank: int, world: int, repeats: int) -> int:
    """The planted bug: rank 0 posts an irecv and frees its buffer's storage while it is in flight (as a ZeRO-2/3
    buffer resized to 0 under its collective would be); rank 1's send then writes into the freed heap block."""
    for _ in range(repeats):
        if rank == 0:
            buf = torch.empty(PLANTED_BYTES, dtype=torch.uint8)
            work = dist.irecv(buf, 1)
            buf.untyped_storage().resize_(0)  # the bug: the storage goes while the receive is posted
            dist.barrier()
            work.wait()
            reused = [torch.ones(PLANTED_BYTES, dtype=torch.uint8) for _ in range(64)]  # malloc walks the bins
            del reused
        else:
            dist.barrier()
            dist.send(torch.full((PLANTED_BYTES,), 7, dtype=torch.uint8), 0)
        dist.barrier()
    return repeats


def stress(name: str, repeat: int, per_spawn: int, root: Path) -> dict:
    """Run path name `repeat` times (the async-checkpoint path: `repeat` saves, ASYNC_SAVES a run); returns {"runs":
    repetitions completed, "spawns", "failures": [messages], "seconds"}."""
    t0, done, failures, spawns = time.perf_counter(), 0, [], 0
    each = ASYNC_SAVES if name == ASYNC else 1
    repeat = -(-repeat // each)
    text = corpus(root)
    one = None
    if name != PLANTED and PATHS[name][2]:
        one = root / "one"
        if not one.exists():  # the 1-process checkpoint at CUT every resharding run resumes (trained here, checked too)
            train(build_config(cut_raw(one, text, {}, CUT)), progress=False)
    for first in range(0, repeat, per_spawn):
        count = min(per_spawn, repeat - first)
        spawns += 1
        logs = root / "logs" / f"{name.replace(' ', '_')}{spawns}"  # a failure quotes the rank's last stderr lines
        try:
            if name == PLANTED:
                run_processes(_planted, 2, count, timeout_s=120, log_dir=logs)
            else:
                runs = [r for i in range(first, first + count) for r in runs_of(name, i, root, text, one)]
                run_processes(_train_runs, 2, runs, timeout_s=600, run_timeout_s=1800, log_dir=logs)
            done += count * each
        except WorkerError as error:
            failures.append(str(error))
    return {"runs": done, "spawns": spawns, "failures": failures, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    """Stress the paths named (default: every path of PATHS) under MALLOC_ENV; print one line per path, and each
    failure's message; exit 1 when any spawn failed."""
    parser = argparse.ArgumentParser(prog="python -m tests.heap_stress", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=30, help="runs of each path (default 30)")
    parser.add_argument("--per-spawn", type=int, default=10, help="runs in one 2-process spawn (default 10)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {[*PATHS, PLANTED]}")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.paths.split(",") if n.strip()]
    unknown = [n for n in names if n not in PATHS and n != PLANTED]
    if unknown:
        parser.error(f"unknown paths {unknown}; choose from {[*PATHS, PLANTED]}")
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):  # glibc reads these at process start
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "tests.heap_stress", *argv], {**os.environ, **MALLOC_ENV})
    print(f"heap stress under {' '.join(f'{k}={v}' for k, v in MALLOC_ENV.items())}, torch {torch.__version__}",
          flush=True)
    failed = False
    with tempfile.TemporaryDirectory(prefix="heap-stress-") as tmp:
        for name in names:
            result = stress(name, args.repeat, args.per_spawn, Path(tmp))
            failed |= bool(result["failures"])
            print(f"{name}: {result['runs']}/{args.repeat} runs completed in {result['spawns']} spawns, "
                  f"{len(result['failures'])} failed, {result['seconds']} s", flush=True)
            for message in result["failures"]:
                print("  " + message.replace("\n", "\n  "), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
