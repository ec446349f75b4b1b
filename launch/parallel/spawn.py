"""Run a function on several processes joined by one torch.distributed process group (one node or several)."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing.context
import multiprocessing.forkserver as forkserver
import os
import pickle
import queue
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from datetime import timedelta
from multiprocessing import reduction
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launch.errors import DiskFull

TAIL_LINES = 20  # last stderr lines of a dead rank quoted in the failure message
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|remote worker crash")  # a consequence, not a cause
GRACE_S = 3.0  # after a first failure, how long the others may still report (a killed peer explains their errors)
RENDEZVOUS_REPORT_S = 10.0  # how often a rendezvous of several nodes still waiting says who is missing
RENDEZVOUS_GRACE_S = 30.0  # a rank's own rendezvous timeout exceeds the launcher's by this: the launcher names them
JOINED = "moe/joined/{rank}"  # the store key a rank sets once it reached the rendezvous
PR_SET_PDEATHSIG = 1
# Ranks start from a fork server that has imported these (a rank then starts in ~0.1 s instead of re-importing torch);
# its one other thread, numpy's OpenBLAS pool, is joined by OpenBLAS's own fork handler before every fork.
# torch._dynamo (no threads of its own) is what torch.optim's optimizers import when the first one is built: ~1 s of
# CPU a training rank would pay again, once per server instead
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.optim", "torch._dynamo",
           __name__]
# Variables read at interpreter start or module import: a rank must start with the caller's values of these
IMPORT_ENV = re.compile(r"PYTHON|LD_|TORCH|PYTORCH_|ATEN_|OMP_|MKL_|KMP_|GOMP_|OPENBLAS_|CUDA_|TRITON_|MOE_")
START_METHODS = ("forkserver", "spawn")  # MOE_START_METHOD: how ranks start (spawn: fresh interpreters)
_server_env: dict[str, str] | None = None  # the IMPORT_ENV variables the fork server started with
_server_lock = threading.Lock()


class WorkerError(RuntimeError):
    """A worker process raised, timed out or died; the message carries its traceback."""

    exit_code = 1  # a CLI ends with exit 1 on it (launch.errors)


class RankRefusal(ValueError):
    """Raised on a rank that refuses its input (a checkpoint, a data shard): the message says what and why, and
    run_processes reports it alone, with no traceback, as a WorkerRefusal."""


class WorkerRefusal(WorkerError):
    """The first rank to fail refused its input (RankRefusal, exit_code 2) or met a full disk (DiskFull, exit_code 1):
    the message is that rank's, without a traceback."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _context() -> multiprocessing.context.BaseContext:
    """The fork server's context, started on first use; spawn where the caller's IMPORT_ENV differs from the server's
    (a server restart would kill the ranks of concurrent runs) or MOE_START_METHOD=spawn asks for it (debugging)."""
    global _server_env
    method = os.environ.get("MOE_START_METHOD", "forkserver")
    if method not in START_METHODS:
        raise ValueError(f"MOE_START_METHOD = {method!r} is not allowed; choose one of {', '.join(START_METHODS)}")
    if method == "spawn":
        return mp.get_context("spawn")
    env = {k: v for k, v in os.environ.items() if IMPORT_ENV.match(k)}
    with _server_lock:
        if _server_env is None:
            mp.set_forkserver_preload(PRELOAD)
            forkserver.ensure_running()
            _server_env = env
    return mp.get_context("forkserver" if env == _server_env else "spawn")


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (Linux): state, parent, ...; OSError once it is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent_pid(pid: int) -> int:
    """The parent of process `pid` (Linux; OSError once it is gone)."""
    return int(proc_stat(pid)[1])


def _die_with_launcher(launcher_pid: int) -> None:
    """Have the kernel kill this rank when its parent dies (Linux), so a killed launcher leaves no rank behind.

    The parent is the launcher (spawn) or the fork server, which exits when the launcher does: its "alive" pipe
    reads EOF once every write end is closed, so this rank closes the copy the server handed it.
    """
    if forkserver._forkserver._forkserver_alive_fd is not None:
        os.close(forkserver._forkserver._forkserver_alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None  # a server this rank needs is its own
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        parent = os.getppid()
        if launcher_pid not in (parent, parent_pid(parent)):  # a parent died before prctl took effect
            os._exit(1)


class _LauncherStdio:
    """The launcher's stdout and stderr on their way to a rank (a fork server's child would write to the server's)."""

    def __init__(self, fds: tuple[Any, Any] | None = None):
        self.fds = fds

    def __reduce__(self) -> tuple:
        return _LauncherStdio, ((reduction.DupFd(1), reduction.DupFd(2)),)

    def take(self) -> None:
        """Make the launcher's stdout and stderr this process's file descriptors 1 and 2."""
        for target, dup in zip((1, 2), self.fds):
            fd = dup.detach()
            if fd != target:  # spawn passes them as they are
                os.dup2(fd, target)
                os.close(fd)


def _redirect_output(prefix: str) -> None:
    """Send this process's stdout/stderr (file descriptors 1, 2) to PREFIX.out / PREFIX.err, line-buffered."""
    for fd, suffix in ((1, "out"), (2, "err")):
        log = os.open(f"{prefix}.{suffix}", os.O_WRONLY | os.O_APPEND)
        os.dup2(log, fd)
        os.close(log)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    faulthandler.enable()  # a fatal signal (segfault, abort) leaves the Python stacks in the .err file


def _worker(
    rank: int,
    local_rank: int,
    world_size: int,
    master: tuple[str, int],
    backend: str,
    threads: int,
    timeout_s: float,
    log_prefix: str | None,
    launcher_pid: int,
    stdio: _LauncherStdio,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    _die_with_launcher(launcher_pid)
    stdio.take()
    os.environ.clear()  # a fork server's child starts with the server's environment: take the launcher's
    os.environ.update(env)
    if log_prefix is not None:
        _redirect_output(log_prefix)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ["LOCAL_RANK"] = str(local_rank)  # as torchrun sets it: the rank's index on its node
    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore(master[0], master[1], is_master=False, timeout=timedelta(seconds=timeout_s))
        store.set(JOINED.format(rank=rank), "1")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        out = fn(rank, world_size, *args)
        # plain pickle copies tensors by value: shared-memory handles would die with this process
        results.put((rank, True, pickle.dumps(out)))
    except (RankRefusal, DiskFull) as error:
        results.put((rank, None, (str(error), 2 if isinstance(error, RankRefusal) else 1)))
    except BaseException:  # noqa: BLE001 - the parent re-raises with this traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _LogStreams:
    """Copies each rank's .out/.err files to this process's stdout/stderr as they grow; keeps each stderr's tail.

    Global rank 0 is copied byte for byte (its progress bar keeps working); the other ranks line by
    line, each line prefixed with "[rank R] ".
    """

    def __init__(self, prefixes: dict[int, str]):
        self.files = [(rank, f"{prefix}.{suffix}", suffix) for rank, prefix in prefixes.items() for suffix in ("out", "err")]
        self.offsets = {path: 0 for _, path, _ in self.files}
        self.partial = {path: "" for _, path, _ in self.files}
        self.err_paths = {rank: f"{prefix}.err" for rank, prefix in prefixes.items()}
        self.tails = {rank: deque(maxlen=TAIL_LINES) for rank in prefixes}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.1):
            self._pump()
        self._pump()

    def _pump(self) -> None:
        for rank, path, suffix in self.files:
            with open(path, "rb") as log:
                log.seek(self.offsets[path])
                data = log.read()
            if not data:
                continue
            self.offsets[path] += len(data)
            text = data.decode(errors="replace")
            target = sys.stdout if suffix == "out" else sys.stderr
            pieces = (self.partial[path] + text).replace("\r", "\n").split("\n")
            self.partial[path] = pieces.pop()
            if suffix == "err":
                self.tails[rank].extend(p for p in pieces if p.strip())
            if rank == 0:
                target.write(text)
            else:
                target.write("".join(f"[rank {rank}] {line}\n" for line in pieces if line.strip()))
            target.flush()

    def close(self) -> None:
        """Copy what is left and stop."""
        self.done.set()
        self.thread.join()

    def tail(self, rank: int) -> str:
        """The last stderr lines of a rank (a trailing partial line included)."""
        return "\n".join([*self.tails[rank], self.partial[self.err_paths[rank]]]).strip()


def _died(rank: int, exitcode: int, logs: _LogStreams | None, last_words: Callable[[int], str] | None) -> str:
    how = f"exit code {exitcode}"
    if exitcode < 0:
        how += f" ({signal.Signals(-exitcode).name})"
    text = f"rank {rank} died with {how} before reporting a result"
    if last_words is not None:
        text += last_words(rank)
    if logs is not None:
        tail = logs.tail(rank)
        path = logs.err_paths[rank]
        text += f"; last lines of its stderr ({path}):\n{tail}" if tail else f"; its stderr ({path}) is empty"
    return text


@contextlib.contextmanager
def _forwarding(procs: dict[int, Any], signals: tuple[int, ...]) -> Iterator[None]:
    """While running, pass these signals on to every live rank (e.g. a scheduler's SIGTERM to the launcher
    lets each rank save and return); only from the main thread, where Python handles signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, _frame: Any) -> None:
        for p in procs.values():
            if p.is_alive():
                os.kill(p.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Rendezvous:
    """Node 0's watch over a rendezvous of several nodes: every RENDEZVOUS_REPORT_S seconds while ranks are missing
    it says which (and on which nodes) on stderr; past timeout_s, poll returns the message that ends the run."""

    def __init__(self, store: dist.Store, world_size: int, nnodes: int, where: str, timeout_s: float) -> None:
        self.store, self.world_size, self.local, self.where = store, world_size, world_size // nnodes, where
        self.timeout_s, self.began = timeout_s, time.monotonic()
        self.next_report, self.complete = self.began + RENDEZVOUS_REPORT_S, False

    def missing(self) -> str:
        """'node N (ranks a-b), ...' of the ranks that have not joined; "" when every rank has."""
        absent = [r for r in range(self.world_size) if not self.store.check([JOINED.format(rank=r)])]
        nodes: dict[int, list[int]] = {}
        for rank in absent:
            nodes.setdefault(rank // self.local, []).append(rank)
        return ", ".join(f"node {n} (rank{'s' if len(r) > 1 else ''} {_span(r)})" for n, r in nodes.items())

    def poll(self) -> str | None:
        """None while the rendezvous is complete or within its time; the failure message once the time is up."""
        now = time.monotonic()
        if self.complete or (now < self.next_report and now - self.began < self.timeout_s):
            return None
        missing = self.missing()
        self.complete = not missing
        if self.complete:
            return None
        if now - self.began >= self.timeout_s:
            return (f"the rendezvous at {self.where} ended after ops.rendezvous_timeout_s = {self.timeout_s:g} s: "
                    f"{missing} never joined; start moe-train there with its --node-rank and the same --nnodes, "
                    f"--master-addr and --master-port, or check that it reaches {self.where}")
        print(f"rendezvous at {self.where}: waiting for {missing} ({now - self.began:.0f} s of "
              f"ops.rendezvous_timeout_s = {self.timeout_s:g} s)", file=sys.stderr, flush=True)
        self.next_report = now + RENDEZVOUS_REPORT_S
        return None


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks[-1] - ranks[0] == len(ranks) - 1 else \
        ", ".join(map(str, ranks))


def _reach_node0(addr: str, port: int, timeout_s: float) -> None:
    """On a node other than 0: wait until node 0's rendezvous store answers, saying so every RENDEZVOUS_REPORT_S
    seconds; WorkerRefusal (exit 1) naming the address once timeout_s passed."""
    began = time.monotonic()
    report = began + RENDEZVOUS_REPORT_S
    while (now := time.monotonic()) - began < timeout_s:
        with contextlib.suppress(OSError):
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        if now >= report:
            print(f"rendezvous at {addr}:{port}: node 0 does not answer yet ({now - began:.0f} s of "
                  f"ops.rendezvous_timeout_s = {timeout_s:g} s)", file=sys.stderr, flush=True)
            report = now + RENDEZVOUS_REPORT_S
        time.sleep(0.5)
    raise WorkerRefusal(f"the rendezvous at {addr}:{port} ended after ops.rendezvous_timeout_s = {timeout_s:g} s: "
                        f"node 0 never answered; start moe-train --node-rank 0 there, or check that this node "
                        f"reaches {addr}:{port}", 1)


def _collect(procs: dict[int, Any], results: Any, outputs: dict[int, Any], wait_s: float,
             logs: _LogStreams | None, last_words: Callable[[int], str] | None,
             verdict_exit: int | None = None, rendezvous: _Rendezvous | None = None) -> tuple[str | None, int | None]:
    """Fill outputs with each rank's result; return (a message naming the failed ranks (died ones first), or None;
    the exit code when the first failure was a RankRefusal (2), a DiskFull (1) or a rendezvous past its time (1),
    else None). A rank that exits with verdict_exit ended the run on a verdict it printed: no grace for the
    others."""
    end = time.monotonic() + wait_s
    raised: dict[int, str] = {}
    refused: dict[int, int] = {}
    died: dict[int, str] = {}
    suspects: set[int] = set()
    grace_end = None
    while len(outputs) + len(raised) + len(died) < len(procs):
        if grace_end is not None and time.monotonic() > grace_end:
            break
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            dead = {r for r, p in procs.items() if r not in outputs and r not in raised and p.exitcode is not None}
            for rank in dead & suspects - set(died):  # gone with no result over two polls: it will never report
                died[rank] = _died(rank, procs[rank].exitcode, logs, last_words)
                if procs[rank].exitcode == verdict_exit:
                    grace_end = time.monotonic()
            suspects = dead
            late = rendezvous.poll() if rendezvous is not None else None
            if late is not None:
                return late, 1
            if time.monotonic() > end and not (raised or died):
                missing = sorted(set(procs) - set(outputs))
                return f"no result within {wait_s:.0f}s from ranks {missing}", None
        else:
            if ok:
                outputs[rank] = pickle.loads(payload)
            elif ok is None:
                raised[rank], refused[rank] = payload
            else:
                raised[rank] = f"rank {rank} failed:\n{payload}"
        if (raised or died) and grace_end is None:
            grace_end = time.monotonic() + GRACE_S
    if not (raised or died):
        return None, None
    cause = next((r for r in raised if not PEER_LOST.search(raised[r])), next(iter(raised), None))  # first to report
    if not died and cause in refused:
        return raised[cause], refused[cause]
    first = [died[r] for r in sorted(died)] or [raised[cause]]
    others = sorted(set(raised) - ({cause} if not died else set()))
    if others:
        last_lines = "; ".join(f"rank {r}: {raised[r].strip().splitlines()[-1]}" for r in others)
        first.append(f"ranks that failed after it: {last_lines}")
    return "\n".join(first), None


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float = 120.0,
    run_timeout_s: float | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    log_dir: str | Path | None = None,
    on_death: Callable[[dist.Store, int], str] | None = None,
    verdict_exit: int | None = None,
    rendezvous_timeout_s: float | None = None,
) -> list[Any]:
    """Run fn(rank, world_size, *args) on this node's share of world_size fresh processes; return their results.

    timeout_s bounds the rendezvous and every collective; run_timeout_s bounds the whole run
    (default timeout_s + 60 s; math.inf: no bound, for training). With nnodes > 1 this node runs ranks
    node_rank * L .. node_rank * L + L - 1 (L = world_size / nnodes) and node 0 hosts the
    rendezvous store on master_addr:master_port; with one node the OS picks a free port, so
    concurrent runs never collide. With log_dir, rank r's stdout/stderr go to log_dir/rank{r}.out
    and .err and are copied to this process's (rank 0 as is, the others prefixed "[rank r]").
    If any rank raises, dies or runs out of time, every local rank is killed and a WorkerError
    names the failed ranks with the first one's traceback (or exit code, signal and last stderr
    lines; a WorkerRefusal, when that rank raised a RankRefusal: its message alone); a rank that dies without reporting is noticed within about a second. A killed parent
    takes its ranks with it (Linux). on_death(store, rank), on node 0, is told of a rank that died
    (the rendezvous store in hand) and returns words the message adds about it. A rank exiting with
    verdict_exit ended the run on a verdict of its own (a watchdog's, after the live ranks' last words): the
    ranks still running are killed at once instead of after a grace period. With nnodes > 1 the rendezvous has
    rendezvous_timeout_s (default timeout_s): node 0 says which ranks are missing while it waits and, past it,
    ends the run with a WorkerRefusal (exit 1) naming them; another node first waits that long for node 0's
    store to answer (the ranks' own store and init timeouts then exceed it by RENDEZVOUS_GRACE_S). fn and its results
    must be picklable (define fn at module level); tensors in results come back by value. Ranks fork from a
    server process that has imported PRELOAD (MOE_START_METHOD=spawn: fresh interpreters), each with this
    process's environment as it is at the call. Returns the results of this node's ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if nnodes < 1 or world_size % nnodes or not 0 <= node_rank < nnodes:
        raise ValueError(f"nnodes = {nnodes} must divide world_size = {world_size} and node_rank = {node_rank} "
                         f"must lie in [0, {nnodes - 1}]")
    if nnodes > 1 and not master_port:
        raise ValueError("master_port must be given (not 0) when nnodes > 1: every node must reach the same store")
    ctx = _context()  # a bad MOE_START_METHOD fails here, before a store or a log file exists
    if run_timeout_s is None:
        run_timeout_s = timeout_s + 60.0  # interpreter start-up counts too
    local = world_size // nnodes
    ranks = range(node_rank * local, (node_rank + 1) * local)
    rendezvous_timeout_s = timeout_s if rendezvous_timeout_s is None else rendezvous_timeout_s
    rank_timeout_s = timeout_s if nnodes == 1 else max(timeout_s, rendezvous_timeout_s + RENDEZVOUS_GRACE_S)
    if node_rank > 0:
        _reach_node0(master_addr, master_port, rendezvous_timeout_s)
    store = (dist.TCPStore(master_addr, master_port, is_master=True, timeout=timedelta(seconds=timeout_s),
                           wait_for_workers=False) if node_rank == 0 else None)
    master = (master_addr, store.port if store is not None else master_port)
    prefixes: dict[int, str | None] = {r: None for r in ranks}
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        prefixes = {r: str(Path(log_dir) / f"rank{r}") for r in ranks}
        for prefix in prefixes.values():
            for suffix in ("out", "err"):
                Path(f"{prefix}.{suffix}").write_bytes(b"")
    results = ctx.Queue()
    procs = {
        r: ctx.Process(target=_worker, daemon=True,
                       args=(r, r - ranks.start, world_size, master, backend, threads, rank_timeout_s, prefixes[r],
                             os.getpid(), _LauncherStdio(), dict(os.environ), fn, args, results))
        for r in ranks
    }
    logs = _LogStreams(prefixes) if log_dir is not None else None
    outputs: dict[int, Any] = {}
    failure: str | None = "interrupted"
    refusal: int | None = None
    try:
        for p in procs.values():
            p.start()
        with _forwarding(procs, (signal.SIGTERM,)):
            last_words = (lambda rank: on_death(store, rank)) if on_death is not None and store is not None else None
            watch = (_Rendezvous(store, world_size, nnodes, f"{master_addr}:{master[1]}", rendezvous_timeout_s)
                     if nnodes > 1 and store is not None else None)
            failure, refusal = _collect(procs, results, outputs, run_timeout_s, logs, last_words, verdict_exit, watch)
    finally:
        for p in procs.values():
            if failure is not None and p.is_alive():
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        if logs is not None:
            logs.close()
        del store
    if failure is not None:
        raise WorkerError(failure) if refusal is None else WorkerRefusal(failure, refusal)
    return [outputs[r] for r in ranks]
