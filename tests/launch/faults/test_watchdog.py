"""The step-progress watchdog: budgets on the monitor's own clock (the 60 s default with a fake clock, ranks'
clocks skewed), O(1) store operations per rank per second at world 4, 64 and 2048, and hang drills on the
4-process pp2 x ep2 run (a rank spinning in Python, blocked before a collective, SIGSTOPped, SIGKILLed: each
ends the run within the 5 s budget plus the step time and the heartbeat's granularity, naming rank 1 and its
phase; a restart resumes and finishes)."""

from __future__ import annotations

import json
import time

import pytest

from launch.parallel.spawn import WorkerError
from launch.config.run import build_config
from launch.config.ops import OpsSettings
from launch.train.launcher import COLLECTIVE_TIMEOUT_S, launch_run
from launch.config.ops import HANG_KINDS, HEARTBEAT_S
from launch.faults.watchdog import Watchdog, on_rank_death
from tests.launch.checkpoint.test_checkpoint import PP2_EP2, assert_continues, config

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

TIMEOUT_S = 5.0  # the drills' ops.heartbeat_timeout_s
# beyond the budget and a step: the monitor's reading, the verdict reaching every live rank through the store,
# their stacks and the launcher noticing the exits, each within a heartbeat
GRANULARITY_S = 4 * HEARTBEAT_S
STUCK = {"spin": "rank 1 made no progress", "sleep": "rank 1 made no progress",
         "stop": "rank 1 stopped publishing progress", "kill": "rank 1 died with exit code -9 (SIGKILL)"}


class MemoryStore:
    """The rendezvous store in memory: one dict shared by every rank's view; each view counts its operations
    (a multi_get or multi_set is one) and the bytes it reads."""

    def __init__(self, data: dict | None = None) -> None:
        self.data = {} if data is None else data
        self.ops = self.read_bytes = 0

    def view(self) -> MemoryStore:
        return MemoryStore(self.data)

    def set(self, key: str, value: str) -> None:
        self.multi_set([key], [value])

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self.ops += 1
        self.data.update(zip(keys, (v.encode() for v in values)))

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.ops += 1
        values = [self.data[k] for k in keys]
        self.read_bytes += sum(map(len, values))
        return values

    def check(self, keys: list[str]) -> bool:
        self.ops += 1
        return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.ops += 1
        if self.data.get(key, b"") == expected.encode():
            self.data[key] = desired.encode()
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        self.ops += 1
        self.data[key] = str(int(self.data.get(key, b"0")) + amount).encode()
        return int(self.data[key])


class Clock:
    """A fake monotonic clock, seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watchdogs(world: int, clock: Clock, run_dir, ops: OpsSettings = OpsSettings()) -> list[Watchdog]:
    """Every rank's watchdog over one MemoryStore, opened; rank r's clock runs 1000 r s ahead (skew is harmless:
    only the monitor judges progress, on its own clock)."""
    store = MemoryStore()
    dogs = [Watchdog(store.view(), r, world, ops.heartbeat_timeout_s, ops.long_phase_timeout_s, run_dir,
                     clock=lambda r=r: clock() + 1000 * r) for r in range(world)]
    for dog in dogs:
        dog.open()
    return dogs


def second(dogs: list[Watchdog], clock: Clock, polling: range | None = None) -> list[str | None]:
    """One second: the polling ranks' threads each take a round (the monitor first)."""
    clock.now += 1
    return [dogs[r].poll() for r in polling or range(len(dogs))]


def steps(dogs: list[Watchdog], clock: Clock, count: int) -> None:
    for step in range(count):
        for dog in dogs:
            dog.progress.enter("forward/backward", step)
            dog.progress.mark("layer 1", 1)
            dog.progress.enter("grad sync", step)
        assert second(dogs, clock) == [None] * len(dogs)


def first_verdict(dogs: list[Watchdog], clock: Clock, seconds: int, polling: range | None = None) -> tuple[int, str]:
    for elapsed in range(1, seconds + 1):
        verdicts = second(dogs, clock, polling)
        if any(verdicts):
            assert len(set(verdicts)) == 1, verdicts  # the monitor's verdict reaches every polling rank at once
            return elapsed, verdicts[0]
    raise AssertionError(f"no verdict within {seconds} s")


def test_default_budget_names_a_rank_stuck_in_python_after_60_s(tmp_path):
    """Rank 2 stops in forward/backward while the others enter grad sync and wait: named once it has not moved
    for more than ops.heartbeat_timeout_s (60 by default) of the monitor's clock."""
    assert OpsSettings().heartbeat_timeout_s == 60
    clock = Clock()
    dogs = watchdogs(4, clock, tmp_path)
    steps(dogs, clock, 3)
    for r, dog in enumerate(dogs):
        dog.progress.enter("forward/backward", 3)
        if r != 2:
            dog.progress.enter("grad sync", 3)
    elapsed, verdict = first_verdict(dogs, clock, 100)
    # the monitor (rank 0) reads before the others push: it sees the last moves in the second round, 61 s later
    # (> 60) they have not moved on
    assert elapsed == 63
    assert verdict.startswith("rank 2 made no progress for 61 s") and "'step 3 forward/backward'" in verdict
    assert "ops.heartbeat_timeout_s = 60" in verdict


def test_stopped_rank_long_phases_and_a_silent_monitor(tmp_path):
    """A rank whose beats stop is named even when its counters are ahead; a long phase (save) has
    ops.long_phase_timeout_s; ranks whose monitor (rank 0) stops end themselves naming it."""
    clock = Clock()
    dogs = watchdogs(4, clock, tmp_path)
    steps(dogs, clock, 2)
    dogs[3].progress.enter("forward/backward", 2)  # rank 3 ahead, then SIGSTOPped: its thread stops too
    elapsed, verdict = first_verdict(dogs, clock, 100, range(3))
    assert elapsed == 61 and verdict.startswith("rank 3 stopped publishing progress")
    assert dogs[0].store.get(dogs[0].keys.dumped) == b"1"  # the live ranks will not wait for rank 3's stacks

    clock, ops = Clock(), OpsSettings(long_phase_timeout_s=240)
    dogs = watchdogs(4, clock, tmp_path, ops)
    steps(dogs, clock, 2)
    for dog in dogs:
        dog.progress.enter("save", 2, long=True)
    elapsed, verdict = first_verdict(dogs, clock, 300)
    assert elapsed == 242 and "'step 2 save' (ops.long_phase_timeout_s = 240)" in verdict  # rank 0's own move: now

    clock = Clock()
    dogs = watchdogs(4, clock, tmp_path)
    steps(dogs, clock, 2)
    elapsed, verdict = first_verdict(dogs, clock, 100, range(1, 4))
    assert elapsed == 61 and verdict.startswith("rank 0, which runs the watchdog's monitor, stopped answering")


@pytest.mark.parametrize("world", [4, 64, 2048])
def test_store_operations_per_rank_are_constant_in_the_world_size(world, tmp_path):
    """Counting harness: each rank's thread does 2 store operations per second at any world size (a set and a
    multi_get of the monitor's two keys; the monitor: a multi_get of every rank's key and a multi_set)."""
    clock = Clock()
    dogs = watchdogs(world, clock, tmp_path)
    steps(dogs, clock, 1)  # the monitor's first round checks that every rank has pushed
    for dog in dogs:
        dog.store.ops = dog.store.read_bytes = 0
    steps(dogs, clock, 10)
    per_second = [dog.store.ops / 10 for dog in dogs]
    assert per_second == [2.0] * world
    assert dogs[1].store.read_bytes / 10 < 40  # a non-monitor rank reads two short keys; the monitor O(world) bytes


@pytest.mark.parametrize("kind", HANG_KINDS)
def test_hang_drill_ends_the_run_naming_rank_and_phase(kind, corpus, tmp_path, capfd):
    run = tmp_path / "run"
    cfg = build_config(config(run, corpus, PP2_EP2, steps=4, heartbeat_timeout_s=TIMEOUT_S,
                              inject_hang={"rank": 1, "step": 2, "kind": kind}))
    with pytest.raises(WorkerError) as failure:
        launch_run(cfg, progress=False)
    took = time.time() - (run / "hang" / "drill-fired").stat().st_mtime
    text = str(failure.value) + capfd.readouterr().err
    tokens = cfg.train.grad_accum_steps * cfg.train.micro_batch_size * cfg.train.seq_len
    step_s = max(tokens / json.loads(line)["tokens_per_s"] for line in (run / "metrics.jsonl").open())
    print(f"{kind}: the run ended {took:.1f} s after rank 1 hung (steps took up to {step_s:.1f} s)")
    assert STUCK[kind] in text and "'step 2 forward/backward / " in text, text
    assert took < TIMEOUT_S + step_s + GRANULARITY_S < COLLECTIVE_TIMEOUT_S / 4
    if kind != "kill":  # (a SIGKILL fails the peers' collectives at once: their own tracebacks report it)
        live = [0, 2, 3] if kind == "stop" else [0, 1, 2, 3]
        assert sorted(p.name for p in (run / "hang").glob("rank*.txt")) == [f"rank{r:05d}.txt" for r in live]
    if kind in ("spin", "sleep"):  # the stuck rank's main thread is caught in the drill
        assert "in _hang" in (run / "hang" / "rank00001.txt").read_text()


def test_a_restart_resumes_from_the_latest_checkpoint_and_finishes(corpus, saved_reference, tmp_path, capfd):
    """Rank 1 spins in step 3; the watchdog ends the run, ops.max_restarts = 1 restarts it from the step-2
    checkpoint (the drill fires once per run directory) and it finishes as the uninterrupted run."""
    run = tmp_path / "run"
    cfg = build_config(config(run, corpus, PP2_EP2, every=2, heartbeat_timeout_s=TIMEOUT_S, max_restarts=1,
                              inject_hang={"rank": 1, "step": 3, "kind": "spin"}))
    records = launch_run(cfg, progress=False)
    assert "restart 1 of ops.max_restarts = 1" in capfd.readouterr().err
    assert_continues(records, saved_reference[0], 2)
    assert (run / "logs" / "restart1" / "rank0.err").exists()


def test_a_rank_the_launcher_saw_die_is_not_awaited(tmp_path):
    """on_rank_death sets the abort key naming the dead rank's phase and counts the dead rank as dumped, once:
    a later death (a peer failing after the verdict) adds nothing."""
    clock = Clock()
    dogs = watchdogs(4, clock, tmp_path)
    steps(dogs, clock, 1)
    store = dogs[0].store
    assert on_rank_death(store, 2) == "; its last published phase: 'step 0 grad sync'"
    assert on_rank_death(store, 3) == "; its last published phase: 'step 0 grad sync'"
    assert store.get(dogs[0].keys.abort).decode().startswith("rank 2 died in 'step 0 grad sync'")
    assert store.get(dogs[0].keys.dumped) == b"1"
