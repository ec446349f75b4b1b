"""Bad layouts and launches are refused by moe-train before any process, store or group exists, naming the field and
the allowed values; torchrun, mpiexec, srun and moe-train's node flags are read as their documentation says."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from launch import train_cli
from launch.train import launcher
from launch.train.launcher import Launch, LaunchError, NodeFlags, detect_launch, first_slurm_host, wait_for_every_refusal
from launch.train_cli import main

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs" / "tiny.toml")  # pp=2 dualpipev x dp=2, ep=2, 8 experts, 4 layers, gpus_per_node=1
MLA = ["model.attention=mla", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=16",
       "model.v_head_dim=16"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NNODES",
                 "SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST",
                 "SLURM_STEP_NODELIST", "SLURM_NODELIST")


@pytest.fixture
def nothing_may_start(monkeypatch, tmp_path):
    """A plain environment in which spawning ranks, opening a store or forming a group fails the test.

    Returns (a run folder, the launches whose refusal would have waited for their other ranks).
    """
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)

    def started(*args, **kwargs):
        raise AssertionError("a process, store or process group was started before the error")

    monkeypatch.setattr(launcher, "run_processes", started)
    monkeypatch.setattr(dist, "TCPStore", started)
    monkeypatch.setattr(dist, "init_process_group", started)
    refused: list[Launch] = []
    monkeypatch.setattr(train_cli, "wait_for_every_refusal", refused.append)
    return tmp_path, refused


def refusal(argv: list[str], fixture: tuple[Path, list[Launch]], capsys) -> str:
    """moe-train's exit code must be 2 with nothing written; its error message."""
    run_dir = fixture[0]
    code = main([*argv, "--run-dir", str(run_dir / "run"), "--no-progress"], trainer=_no_training)
    err = capsys.readouterr().err
    assert code == 2, err
    assert not (run_dir / "run").exists()
    return err


def _no_training(*args, **kwargs):
    raise AssertionError("the trainer ran")


@pytest.mark.parametrize("overrides, expected", [
    (["parallel.ep=3"], "parallel.ep = 3 must divide dp x cp x tp = 2 (allowed: 1, 2)"),
    (["parallel.pp=1", "parallel.schedule=none", "parallel.dp=4", "parallel.ep=4", "model.num_experts=6"],
     "parallel.ep = 4 must divide model.num_experts = 6 (allowed with dp x cp x tp = 4: 1, 2)"),
    (["model.num_layers=3"], "model.num_layers = 3 is fewer than the 4 pipeline stages of parallel.pp = 2 with "
                             "schedule 'dualpipev' (allowed: model.num_layers >= 4"),
    (["parallel.num_chunks=2"], "parallel.num_chunks = 2 is too small for schedule 'dualpipev' with pp = 2: it needs "
                                ">= 4 chunks"),
    (["parallel.schedule=dualpipe", "parallel.pp=3", "train.grad_accum_steps=12"],
     "parallel.pp = 3: schedule 'dualpipe' needs an even pp (allowed: 2, 4, 6, ...)"),
    (["parallel.gpus_per_node=3"], "parallel.gpus_per_node = 3 must divide the world size pp x dp x cp x tp = 4 "
                                   "(allowed: 0 (one node), 1, 2, 4)"),
    (["parallel.dispatch_chunks=0"], "parallel.dispatch_chunks = 0 must be an integer >= 1"),
    (["parallel.dispatch_backend=flat", "parallel.dispatch_chunks=2"],
     "parallel.dispatch_chunks = 2 pipelines the two hops of parallel.dispatch_backend = 'hierarchical'; with 'flat' "
     "allowed: 1"),
    (["parallel.pp=1", "parallel.schedule=none", "parallel.dp=12", "parallel.ep=4", "parallel.gpus_per_node=6",
      "train.grad_accum_steps=12"], "parallel.ep = 4 with parallel.gpus_per_node = 6: EP groups would span nodes "
                                    "unevenly; choose ep dividing gpus_per_node or a multiple of it"),
    ([*MLA, "model.num_heads=3", "parallel.tp=2"], "model.num_heads = 3 is not divisible by parallel.tp = 2; tp must "
                                                   "be one of [1, 3]"),
    ([*MLA, "model.qk_rope_head_dim=5"], "qk_rope_head_dim = 5 must be even (RoPE rotates pairs of dims)"),
    (["model.attention=mla"], "kv_lora_rank = 0 must be an integer >= 1 with attention = 'mla'"),
])
def test_a_bad_layout_is_refused_before_any_process_naming_field_and_allowed_values(nothing_may_start, capsys,
                                                                                    overrides, expected):
    argv = ["--config", TINY, *(arg for o in overrides for arg in ("--set", o))]
    assert expected in refusal(argv, nothing_may_start, capsys)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("launcher_env, name, hint", [
    ({"RANK": "{rank}", "WORLD_SIZE": "2", "LOCAL_RANK": "{rank}", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}, "torchrun",
     "start torchrun with --nnodes x --nproc-per-node = 4"),
    ({"PMI_RANK": "{rank}", "PMI_SIZE": "2"}, "mpiexec", "start mpiexec -n 4"),
    ({"OMPI_COMM_WORLD_RANK": "{rank}", "OMPI_COMM_WORLD_SIZE": "2"}, "mpiexec", "start mpiexec -n 4"),
    ({"SLURM_PROCID": "{rank}", "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_LOCALID": "{rank}",
      "SLURM_JOB_ID": "7"}, "srun", "start srun --ntasks 4"),
])
def test_every_rank_of_a_launcher_world_unlike_the_layout_refuses(nothing_may_start, capsys, monkeypatch, rank,
                                                                  launcher_env, name, hint):
    for key, value in launcher_env.items():
        monkeypatch.setenv(key, value.format(rank=rank))
    err = refusal(["--config", TINY], nothing_may_start, capsys)
    assert f"{name} started 2 processes (this is rank {rank}), but the config's layout needs parallel.pp x dp x cp x tp = " \
           f"2 x 2 x 1 x 1 = 4: {hint}" in err
    [refused] = nothing_may_start[1]  # after printing, this rank waits for its launcher's other ranks to refuse
    assert (refused.launcher, refused.world_size, refused.rank) == (name, 2, rank)


@pytest.mark.parametrize("flags, expected", [
    (["--nnodes", "3"], "--nnodes 3 must divide the config's world size parallel.pp x dp x cp x tp = 4 (allowed: 1, 2, 4)"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 must lie in [0, 1] for --nnodes 2"),
    (["--nnodes", "2", "--node-rank", "1"], "parallel.gpus_per_node = 1 but moe-train puts 2 ranks on each of 2 nodes: "
                                            "set parallel.gpus_per_node = 2"),
])
def test_bad_node_flags_are_refused_before_any_process(nothing_may_start, capsys, flags, expected):
    assert expected in refusal(["--config", TINY, *flags], nothing_may_start, capsys)


def test_node_flags_under_torchrun_are_refused(nothing_may_start, capsys, monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    err = refusal(["--config", TINY, "--nnodes", "2"], nothing_may_start, capsys)
    assert "--nnodes set moe-train's own spawn, but this process was started by torchrun" in err


def test_moe_train_node_flags_make_one_node_of_several():
    flags = NodeFlags(nnodes=4, node_rank=2, master_addr="node0", master_port=6000)
    assert detect_launch(8, flags, {}) == Launch("moe-train", 8, 2, nnodes=4, node_rank=2, master_addr="node0",
                                                 master_port=6000)
    assert detect_launch(8, NodeFlags(nnodes=2, node_rank=1), {}).master_port == 29500  # torchrun's default port
    assert detect_launch(4, NodeFlags(), {}) == Launch("moe-train", 4, 4)  # one node: a free port, local address


def test_slurm_one_task_per_node_spawns_that_nodes_ranks_and_srun_per_rank_joins():
    per_node = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
                "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1234"}
    assert detect_launch(8, NodeFlags(), per_node) == Launch("moe-train", 8, 4, nnodes=2, node_rank=1,
                                                             master_addr="gpu07", master_port=29500)
    per_rank = {**per_node, "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    assert detect_launch(8, NodeFlags(), per_rank) == Launch("srun", 8, 4, rank=5, local_rank=1, nnodes=2,
                                                             node_rank=1, master_addr="gpu07", master_port=21234)
    with pytest.raises(LaunchError, match="--nnodes set moe-train's own spawn, but this process was started by srun"):
        detect_launch(8, NodeFlags(nnodes=2), per_rank)


@pytest.mark.parametrize("nodelist, first", [("gpu[01-04,07],cpu3", "gpu01"), ("a1,b2", "a1"), ("n[3,5]x", "n3x"),
                                             ("host", "host")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_a_refusing_torchrun_rank_returns_once_every_rank_refused(monkeypatch):
    monkeypatch.setattr(launcher, "REFUSAL_WAIT_S", 120.0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_RUN_ID": "run", "TORCHELASTIC_RESTART_COUNT": "0"}
    ranks = [Launch("torchrun", 2, 2, rank=r, master_addr="127.0.0.1", master_port=store.port) for r in (0, 1)]
    first = threading.Thread(target=wait_for_every_refusal, args=(ranks[0], env))
    first.start()
    first.join(timeout=1.0)
    assert first.is_alive()  # alone, rank 0 waits for rank 1
    wait_for_every_refusal(ranks[1], env)
    first.join(timeout=60)
    assert not first.is_alive()
