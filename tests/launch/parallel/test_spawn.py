"""The multi-process runner returns every rank's result, streams their output, spans nodes and surfaces a failing rank."""

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launch.parallel import spawn
from launch.parallel.spawn import IMPORT_ENV, RankRefusal, WorkerError, WorkerRefusal, run_processes

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)


def _sum_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _rank_one_fails_others_wait(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    dist.barrier()


def test_results_come_back_in_rank_order():
    assert run_processes(_sum_ranks, 3) == [6.0, 6.0, 6.0]


def test_failing_rank_raises_with_traceback_and_does_not_hang():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank one fails on purpose"):
        run_processes(_rank_one_fails_others_wait, 2, timeout_s=20)
    assert time.monotonic() - start < 60


def _rank_one_refuses_others_wait(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RankRefusal("shard 00003.tokens is corrupted")
    dist.barrier()


def test_a_refusing_rank_is_reported_by_its_message_alone():
    """A RankRefusal ends the run as a WorkerRefusal whose message is the refusal's, no traceback, no peer's error."""
    with pytest.raises(WorkerRefusal) as refused:
        run_processes(_rank_one_refuses_others_wait, 2, timeout_s=20)
    assert str(refused.value) == "shard 00003.tokens is corrupted"


def _loop_on_collectives(rank: int, world_size: int, pid_dir: str) -> None:
    (Path(pid_dir) / f"{rank}.pid").write_text(str(os.getpid()))
    print(f"rank {rank} is looping", file=sys.stderr, flush=True)
    t = torch.ones(1)
    while True:
        dist.all_reduce(t)
        time.sleep(0.01)


def _print_and_sum(rank: int, world_size: int) -> float:
    print(f"hello from {rank}", flush=True)
    print(f"warning from {rank}", file=sys.stderr, flush=True)
    return _sum_ranks(rank, world_size)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return spawn.proc_stat(pid)[0] == "Z"  # exited, not yet reaped
    except (ProcessLookupError, FileNotFoundError):
        return True


def test_sigkilled_rank_of_an_unbounded_run_is_named_with_its_exit_code_and_last_lines(tmp_path):
    pid_dir, log_dir = tmp_path / "pids", tmp_path / "logs"
    pid_dir.mkdir()

    def kill_rank_one() -> None:
        while len(list(pid_dir.glob("*.pid"))) < 2:
            time.sleep(0.05)
        time.sleep(0.5)  # every rank is inside its collective loop
        os.kill(int((pid_dir / "1.pid").read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_one, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerError) as failure:
        run_processes(_loop_on_collectives, 2, str(pid_dir), timeout_s=30, run_timeout_s=math.inf, log_dir=log_dir)
    assert time.monotonic() - start < 60
    message = str(failure.value)
    assert message.startswith("rank 1 died with exit code -9 (SIGKILL)"), message
    assert "rank 1 is looping" in message  # the last lines of its stderr
    assert all(_gone(int(p.read_text())) for p in pid_dir.glob("*.pid"))


def test_log_dir_streams_every_rank_and_keeps_the_files(tmp_path, capsys):
    assert run_processes(_print_and_sum, 2, log_dir=tmp_path) == [3.0, 3.0]
    out, err = capsys.readouterr()
    assert "hello from 0\n" in out and "[rank 1] hello from 1\n" in out
    assert "warning from 0\n" in err and "[rank 1] warning from 1\n" in err
    assert (tmp_path / "rank1.out").read_text() == "hello from 1\n"


def test_two_nodes_form_one_world():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results: dict[int, list] = {}

    def node(rank: int) -> None:
        results[rank] = run_processes(_sum_ranks, 2, nnodes=2, node_rank=rank, master_port=port, timeout_s=60)

    threads = [threading.Thread(target=node, args=(n,)) for n in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: [3.0], 1: [3.0]}


def test_bad_node_layout_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="nnodes = 3 must divide world_size = 4"):
        run_processes(_sum_ranks, 4, nnodes=3, master_port=1)
    with pytest.raises(ValueError, match="master_port must be given"):
        run_processes(_sum_ranks, 4, nnodes=2)


def _one_rank_raises_the_others_lose_their_peer(rank: int, world: int) -> None:
    if rank == world - 1:
        raise TypeError("the real cause")
    dist.all_reduce(torch.ones(1))  # the raising rank's exit breaks this collective


def test_the_named_failure_is_the_cause_not_a_peer_lost_in_a_collective():
    with pytest.raises(WorkerError) as failure:
        run_processes(_one_rank_raises_the_others_lose_their_peer, 3, timeout_s=30)
    message = str(failure.value)
    assert message.startswith("rank 2 failed:"), message
    assert "TypeError: the real cause" in message.split("ranks that failed after it")[0], message


def _wait_for_sigterm(rank: int, world: int, pid_dir: str) -> str:
    asked = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: asked.set())
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    if not asked.wait(timeout=20):
        return "no SIGTERM"
    return "saved and returned"


def test_sigterm_to_the_launcher_reaches_every_rank(tmp_path):
    seen_by_launcher = []
    previous = signal.signal(signal.SIGTERM, lambda *_: seen_by_launcher.append(True))

    def terminate_launcher() -> None:
        while len(list(tmp_path.glob("*.pid"))) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_launcher, daemon=True).start()
    try:
        results = run_processes(_wait_for_sigterm, 2, str(tmp_path), timeout_s=30)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert results == ["saved and returned"] * 2
    assert not seen_by_launcher  # forwarded while running, the caller's handler restored after


LAUNCHER = """
import math, sys
from launch.parallel.spawn import run_processes
from tests.launch.parallel.test_spawn import _loop_on_collectives
if __name__ == "__main__":
    run_processes(_loop_on_collectives, 2, sys.argv[1], timeout_s=30, run_timeout_s=math.inf)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_sigkilled_launcher_takes_its_ranks_with_it(tmp_path):
    root = Path(__file__).resolve().parents[3]
    (tmp_path / "start_ranks.py").write_text(LAUNCHER)
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "start_ranks.py"), str(tmp_path)], cwd=root,
                                env={**os.environ, "PYTHONPATH": str(root)})
    pids: list[int] = []
    try:
        start_by = time.monotonic() + 120
        while len(pids) < 2:
            assert launcher.poll() is None and time.monotonic() < start_by, "the ranks never started"
            time.sleep(0.1)
            pids = [int(p.read_text()) for p in tmp_path.glob("*.pid") if p.read_text()]
        launcher.kill()
        launcher.wait()
        end = time.monotonic() + 20
        while not all(_gone(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.1)
        assert all(_gone(p) for p in pids), "ranks outlived their SIGKILLed launcher"
    finally:
        launcher.kill()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def _parent_and_env(rank: int, world: int) -> tuple[int, str | None, str | None]:
    return os.getppid(), os.environ.get("RUN_PROCESSES_TEST_VALUE"), os.environ.get("TORCH_RUN_PROCESSES_TEST")


def _imported(rank: int, world: int) -> bool:
    """Whether this rank started with torch._dynamo imported: the ~1 s of CPU torch.optim's first optimizer costs."""
    return "torch._dynamo" in sys.modules


def test_each_rank_sees_the_callers_environment_of_the_call(monkeypatch):
    monkeypatch.delenv("MOE_START_METHOD", raising=False)
    run_processes(_parent_and_env, 1)  # the fork server runs from here on
    for name in [n for n in os.environ if IMPORT_ENV.match(n)]:  # an earlier test may have started it under
        monkeypatch.delenv(name)  # other variables: the caller's become those it started with
    for name, value in spawn._server_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RUN_PROCESSES_TEST_VALUE", "set after the server started")
    [(parent, value, _)] = run_processes(_parent_and_env, 1)
    assert value == "set after the server started" and parent != os.getpid()  # a fork server's child
    assert run_processes(_imported, 1) == [True]  # it starts with the server's imports (spawn.PRELOAD)
    monkeypatch.setenv("TORCH_RUN_PROCESSES_TEST", "read at import")  # a variable the server's imports may have read
    [(parent, value, torch_value)] = run_processes(_parent_and_env, 1)
    assert (value, torch_value) == ("set after the server started", "read at import")
    assert parent == os.getpid()  # started afresh (spawn): the server's imports saw another value
    monkeypatch.delenv("TORCH_RUN_PROCESSES_TEST")
    monkeypatch.delenv("RUN_PROCESSES_TEST_VALUE")
    [(parent, value, _)] = run_processes(_parent_and_env, 1)
    assert value is None and parent != os.getpid()


def test_ranks_write_to_the_callers_stdout_and_stderr(capfd):
    assert run_processes(_print_and_sum, 2) == [3.0, 3.0]
    out, err = capfd.readouterr()
    assert "hello from 1" in out and "warning from 1" in err  # (two ranks' writes to one file may interleave)


def test_an_unknown_start_method_is_an_error_naming_the_allowed_ones(monkeypatch):
    monkeypatch.setenv("MOE_START_METHOD", "fork")
    with pytest.raises(ValueError, match="MOE_START_METHOD = 'fork' is not allowed; choose one of forkserver, spawn"):
        run_processes(_parent_and_env, 1)
