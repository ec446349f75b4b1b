"""How a run's ranks start: moe-train's own spawn (one node or several), torchrun, mpiexec or srun.

Every path compares the launcher's world size with the config's layout before any process group
forms, joins one torch.distributed group (gloo or NCCL, from parallel.comm_backend) and runs the
trainer on each rank; a 1-rank layout runs in this process with no process group.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from launch.config.run import RunConfig
from launch.faults.watchdog import WATCHDOG_EXIT, on_rank_death
from launch.parallel.device import backend_for, check_device
from launch.parallel.spawn import WorkerError, run_processes
from launch.train.rundir import check_resume, own_run_dir

COLLECTIVE_TIMEOUT_S = 300.0  # rendezvous and every collective; a hung rank ends the run after this
REFUSAL_WAIT_S = 30.0  # a rank refusing its launcher's world waits at most this long for the others to refuse too
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MPI_VARS = (("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH, Intel MPI
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"))  # Open MPI
DEFAULT_MASTER_PORT = 29500  # torchrun's default, for multi-node runs that name none
SLURM_PORT_BASE = 20000  # srun-per-rank runs with no MASTER_PORT derive one from the job id

Trainer = Callable[..., list[dict]]


class LaunchError(ValueError):
    """The launch does not fit the config or the launcher's environment; the message says which and how to fix it.

    launch: the refused launch (from check_launch), whose every rank refuses alike (see wait_for_every_refusal).
    """

    def __init__(self, message: str, launch: Launch | None = None) -> None:
        super().__init__(message)
        self.launch = launch


@dataclass(frozen=True)
class NodeFlags:
    """moe-train's own multi-node flags (None: not given)."""

    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None


@dataclass(frozen=True)
class Launch:
    """Where this process stands: who started it, the world they started, and this process's place in it.

    rank is None when moe-train itself spawns this node's ranks; otherwise the launcher started
    this process as that rank.
    """

    launcher: str  # "moe-train", "torchrun", "mpiexec" or "srun"
    world_size: int
    local_ranks: int  # ranks on this node
    rank: int | None = None
    local_rank: int = 0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: the OS picks one (one node)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as "gpu[01-04,07],cpu3" (-> "gpu01")."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist)
    if not first:
        raise LaunchError(f"cannot read a host from the SLURM node list {nodelist!r}")
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], first.group(0))


def _int_env(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"environment variable {name} = {env[name]!r} must be an integer") from None


def _refuse_flags(flags: NodeFlags, launcher: str) -> None:
    given = [f"--{name.replace('_', '-')}" for name, value in vars(flags).items() if value is not None]
    if given:
        raise LaunchError(f"{', '.join(given)} set moe-train's own spawn, but this process was started by "
                          f"{launcher}: give the node layout to {launcher} instead")


def _own_spawn(world: int, flags: NodeFlags, env: Mapping[str, str], nnodes: int, node_rank: int,
               master_addr: str | None) -> Launch:
    if nnodes < 1 or world % nnodes:
        raise LaunchError(f"--nnodes {nnodes} must divide the config's world size parallel.pp x dp x cp x tp = {world} "
                          f"(allowed: {', '.join(str(n) for n in range(1, world + 1) if world % n == 0)})")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} must lie in [0, {nnodes - 1}] for --nnodes {nnodes}")
    port = flags.master_port if flags.master_port is not None else int(env.get("MASTER_PORT", 0))
    if nnodes > 1 and not port:
        port = DEFAULT_MASTER_PORT
    addr = flags.master_addr or master_addr or env.get("MASTER_ADDR", "127.0.0.1")
    return Launch("moe-train", world, world // nnodes, nnodes=nnodes, node_rank=node_rank, master_addr=addr,
                  master_port=port)


def _slurm(world: int, flags: NodeFlags, env: Mapping[str, str]) -> Launch:
    tasks = _int_env(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
    nodes = _int_env(env, "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_NNODES")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    addr = env.get("MASTER_ADDR") or (first_slurm_host(nodelist) if nodes > 1 else "127.0.0.1")
    if tasks == 1 or tasks == nodes:  # one moe-train per node spawns the node's ranks
        nnodes = flags.nnodes or (nodes if tasks > 1 else 1)
        node_rank = flags.node_rank if flags.node_rank is not None else (_int_env(env, "SLURM_NODEID") if nnodes > 1 else 0)
        return _own_spawn(world, flags, env, nnodes, node_rank, addr)
    _refuse_flags(flags, "srun")
    port = int(env.get("MASTER_PORT", 0)) or SLURM_PORT_BASE + _int_env(env, "SLURM_JOB_ID") % 10000
    return Launch("srun", tasks, tasks // nodes, rank=_int_env(env, "SLURM_PROCID"),
                  local_rank=_int_env(env, "SLURM_LOCALID"), nnodes=nodes,
                  node_rank=_int_env(env, "SLURM_NODEID"), master_addr=addr, master_port=port)


def detect_launch(world: int, flags: NodeFlags, env: Mapping[str, str]) -> Launch:
    """Who started this process (torchrun, mpiexec, srun per rank, or a plain moe-train) and what it asked for."""
    if "TORCHELASTIC_RUN_ID" in env or all(name in env for name in TORCHRUN_VARS):
        _refuse_flags(flags, "torchrun")
        size = _int_env(env, "WORLD_SIZE")
        local = _int_env(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else size
        return Launch("torchrun", size, local, rank=_int_env(env, "RANK"),
                      local_rank=_int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                      nnodes=size // local, master_addr=env.get("MASTER_ADDR", ""),
                      master_port=int(env.get("MASTER_PORT", 0)))
    for rank_var, size_var, local_rank_var, local_size_var in MPI_VARS:
        if size_var in env:
            _refuse_flags(flags, "mpiexec")
            size = _int_env(env, size_var)
            local = _int_env(env, local_size_var) if local_size_var in env else size
            return Launch("mpiexec", size, local, rank=_int_env(env, rank_var),
                          local_rank=_int_env(env, local_rank_var) if local_rank_var in env else 0,
                          nnodes=size // local)
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        return _slurm(world, flags, env)
    return _own_spawn(world, flags, env, flags.nnodes or 1, flags.node_rank or 0, None)


_HOW_TO_START = {"torchrun": "torchrun with --nnodes x --nproc-per-node = {world}", "mpiexec": "mpiexec -n {world}",
                 "srun": "srun --ntasks {world}"}


def check_launch(cfg: RunConfig, launch: Launch) -> None:
    """Refuse a launcher world that differs from the layout's, and real nodes that differ from parallel.gpus_per_node."""
    par = cfg.parallel
    layout = f"parallel.pp x dp x cp x tp = {par.pp} x {par.dp} x {par.cp} x {par.tp} = {par.world_size}"
    if launch.world_size != par.world_size:
        hint = _HOW_TO_START[launch.launcher].format(world=par.world_size)
        raise LaunchError(f"{launch.launcher} started {launch.world_size} processes (this is rank {launch.rank}), but "
                          f"the config's layout needs {layout}: start {hint}, change [parallel], or run plain "
                          f"`moe-train --config ...`, which spawns the layout's ranks itself", launch)
    if cfg.ops.max_restarts and (launch.launcher != "moe-train" or launch.nnodes > 1):
        raise LaunchError(f"ops.max_restarts = {cfg.ops.max_restarts} restarts the ranks of moe-train's own spawn on "
                          f"one node, not a run started by {launch.launcher} on {launch.nnodes} node(s): set "
                          f"ops.max_restarts = 0 and restart with torchrun --max-restarts N plus moe-train --resume "
                          f"(a run without a checkpoint starts afresh)", launch)
    if launch.nnodes > 1 and par.gpus_per_node != launch.local_ranks:
        raise LaunchError(f"parallel.gpus_per_node = {par.gpus_per_node} but {launch.launcher} puts "
                          f"{launch.local_ranks} ranks on each of {launch.nnodes} nodes: set parallel.gpus_per_node = "
                          f"{launch.local_ranks} (e.g. --set parallel.gpus_per_node={launch.local_ranks}) so the "
                          f"layout's nodes are the real ones", launch)


def wait_for_every_refusal(launch: Launch, env: Mapping[str, str] | None = None) -> None:
    """Return once every rank of a torchrun or mpiexec world has refused it too (at most REFUSAL_WAIT_S).

    Both launchers stop all ranks as soon as one exits; a rank that printed its error and waits
    here lets the slower ones print theirs before any exits. Other launchers return at once.
    """
    env = os.environ if env is None else env
    deadline = time.monotonic() + REFUSAL_WAIT_S
    if launch.launcher == "mpiexec":
        from mpi4py import MPI

        request = MPI.COMM_WORLD.Ibarrier()
        while not request.Test() and time.monotonic() < deadline:
            time.sleep(0.05)
    elif launch.launcher == "torchrun":  # torchrun's own store, which every rank of this attempt reaches
        key = f"moe-train/refused/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        with contextlib.suppress(RuntimeError):  # no store to meet at (or it went away): nothing to wait for
            store = dist.TCPStore(launch.master_addr, launch.master_port, is_master=False,
                                  timeout=timedelta(seconds=REFUSAL_WAIT_S))
            store.add(key, 1)
            while store.add(key, 0) < launch.world_size and time.monotonic() < deadline:
                time.sleep(0.05)


def resolve_backend(cfg: RunConfig, local_ranks: int) -> str:
    """The torch.distributed backend of the run (NCCL for CUDA ranks, gloo for CPU ones; launch.parallel.device),
    checked against this node's GPUs: LaunchError (before any process starts) naming the numbers."""
    try:
        check_device(cfg.train.device, cfg.parallel.comm_backend, cfg.model.expert_precision, local_ranks,
                     cfg.train.cuda_graphs)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    return backend_for(cfg.train.device, cfg.parallel.comm_backend)


def threads_per_rank(local_ranks: int, env: Mapping[str, str]) -> int:
    """CPU threads for each rank: OMP_NUM_THREADS when set, else this machine's cores shared by its ranks."""
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // local_ranks)


def _mpi_store(launch: Launch, env: Mapping[str, str]) -> dist.TCPStore:
    """Rank 0 opens the rendezvous store on a free port and broadcasts its address over MPI (MPI starts only here)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    one_host = len(set(comm.allgather(MPI.Get_processor_name()))) == 1
    store = None
    if launch.rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, timeout=timeout, wait_for_workers=False)
        addr = env.get("MASTER_ADDR") or ("127.0.0.1" if one_host else socket.getfqdn())
    host, port = comm.bcast((addr, store.port) if store is not None else None, root=0)
    return store or dist.TCPStore(host, port, is_master=False, timeout=timeout)


def _join(launch: Launch, backend: str, env: Mapping[str, str]) -> None:
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    os.environ["LOCAL_RANK"] = str(launch.local_rank)  # the trainer's device index (launch.parallel.device), under any launcher
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank)
    if launch.launcher == "torchrun":
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return
    if launch.launcher == "mpiexec":
        store = _mpi_store(launch, env)
    else:
        store = dist.TCPStore(launch.master_addr, launch.master_port, is_master=launch.rank == 0, timeout=timeout,
                              wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size, timeout=timeout)


def _default_trainer() -> Trainer:
    from launch.train.loop import train

    return train


def train_rank(rank: int, world_size: int, cfg: RunConfig, trainer: Trainer | None, train_kwargs: dict) -> list[dict]:
    """One spawned rank: run the trainer on the process group run_processes formed."""
    return (trainer or _default_trainer())(cfg, **train_kwargs)


def _spawn(cfg: RunConfig, launch: Launch, backend: str, threads: int, trainer: Trainer | None,
           train_kwargs: dict) -> list[dict]:
    """moe-train's own spawn of this node's ranks; after a failure, up to ops.max_restarts fresh attempts, each
    resuming from the latest valid checkpoint in RUN_DIR (as torchrun's elastic agent restarts its workers);
    attempt n > 0 logs to RUN_DIR/logs/restartN."""
    attempt = 0
    while True:
        kwargs = {**train_kwargs, "resume": True, "require_checkpoint": False} if attempt else train_kwargs
        logs = Path(cfg.train.run_dir) / "logs"
        try:
            results = run_processes(
                train_rank, launch.world_size, cfg, trainer, kwargs, backend=backend, threads=threads,
                timeout_s=COLLECTIVE_TIMEOUT_S, run_timeout_s=math.inf, nnodes=launch.nnodes,
                node_rank=launch.node_rank, master_addr=launch.master_addr, master_port=launch.master_port,
                log_dir=logs / f"restart{attempt}" if attempt else logs, on_death=on_rank_death,
                verdict_exit=WATCHDOG_EXIT, rendezvous_timeout_s=cfg.ops.rendezvous_timeout_s)
            return results[0] if launch.node_rank == 0 else []
        except WorkerError as error:
            if attempt == cfg.ops.max_restarts:
                raise
            attempt += 1
            print(f"moe-train: the run failed ({str(error).splitlines()[0]}); restart {attempt} of ops.max_restarts "
                  f"= {cfg.ops.max_restarts}, from the latest checkpoint in {Path(cfg.train.run_dir) / 'checkpoint'}",
                  file=sys.stderr, flush=True)


def launch_run(cfg: RunConfig, flags: NodeFlags = NodeFlags(), env: Mapping[str, str] | None = None,
               trainer: Trainer | None = None, start_over: bool = False, allow_data_change: bool = False,
               **train_kwargs: Any) -> list[dict]:
    """Run cfg on the ranks its layout needs, however this process was started; rank 0's records ([] elsewhere).

    Raises LaunchError (before any process starts or any group forms) when the launch does not
    fit the layout, and launch.parallel.spawn.WorkerError when a spawned rank fails (the message
    names the rank, its exit code and its last traceback lines) in each of ops.max_restarts + 1
    attempts. trainer defaults to launch.train.loop.train; it runs on the current process group with
    train_kwargs. The process of rank 0 (moe-train's own spawn: node 0's) holds the run directory for the
    whole run (launch.train.rundir: refused, as a LaunchError, while another run holds it or when it holds
    another run's files and neither train_kwargs' resume nor start_over accepts them); with resume, the
    checkpoint to continue is checked first (launch.train.rundir.check_resume; allow_data_change lets the data
    settings differ, the new data then read from its start).
    """
    env = os.environ if env is None else env
    launch = detect_launch(cfg.parallel.world_size, flags, env)
    check_launch(cfg, launch)
    backend = resolve_backend(cfg, launch.local_ranks)
    threads = threads_per_rank(launch.local_ranks, env)
    resume = bool(train_kwargs.get("resume"))
    if allow_data_change:
        train_kwargs["resume_data"] = False
    with contextlib.ExitStack() as held:
        if launch.node_rank == 0 and launch.rank in (None, 0):
            try:
                held.enter_context(own_run_dir(cfg.train.run_dir, resume, start_over, train_kwargs.get("metrics_out")))
                if resume:
                    check_resume(cfg, train_kwargs.get("require_checkpoint", True), allow_data_change)
            except ValueError as error:  # this rank alone refuses: its launcher stops the others
                raise LaunchError(str(error)) from None
        return _run(cfg, launch, backend, threads, env, trainer, train_kwargs)


def _run(cfg: RunConfig, launch: Launch, backend: str, threads: int, env: Mapping[str, str], trainer: Trainer | None,
         train_kwargs: dict) -> list[dict]:
    """launch_run's ranks: spawned here, this process alone, or this process as one rank of its launcher's world."""
    if launch.rank is None and (launch.world_size > 1 or cfg.ops.max_restarts):
        return _spawn(cfg, launch, backend, threads, trainer, train_kwargs)
    torch.set_num_threads(threads)
    if launch.world_size == 1:
        return (trainer or _default_trainer())(cfg, **train_kwargs)
    _join(launch, backend, env)
    try:
        return (trainer or _default_trainer())(cfg, **train_kwargs)
    finally:
        dist.destroy_process_group()
