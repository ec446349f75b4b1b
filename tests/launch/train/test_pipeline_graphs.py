"""train.cuda_graphs with a pipeline (parallel.pp > 1; pipeline.graphs): each compute action of the runtime on each
(stage, chunk) captured and replayed by the replay simulator (tests/graph_replay.py), on 2 processes, trains to the
eager run's losses, grad norms and final parameters bitwise: 1F1B, and DualPipeV with the B/W split (W actions, F&B
pairs). One warm-up step, the capture at step 1 (each action captured, then replayed at once), replays after."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from launch.config.run import build_config
from launch.plan.rehearse import RandomFeed
from launch.train import loop
from pipeline.graphs import WARMUP_STEPS

STEPS = 4
REHEARSED_STEPS = 3  # the rehearsal's: a warm-up, the capture, a replay (its memory tracker slows every step)
# by name: (parallel settings, layers, micro-batches a step)
LAYOUTS = {"1f1b": ({"pp": 2, "schedule": "1f1b"}, 2, 2),
           "dualpipev": ({"pp": 2, "schedule": "dualpipev", "defer_weight_grads": True}, 4, 4)}
# the kinds of actions captured on each rank, by layout (Op values: F&B pairs and W actions with DualPipeV)
KINDS = {"1f1b": [["B", "F"]] * 2, "dualpipev": [["B", "F", "FB", "W"]] * 2}


def raw(run_dir, parallel: dict, layers: int, micro: int, graphs: bool) -> dict:
    """A float32 model of 1 dense and layers - 1 MoE layers (4 experts, top-2, aux loss and bias update on), micro
    micro-batches of 2 x 8 tokens a step."""
    return {"model": {"vocab_size": 64, "hidden_size": 16, "num_layers": layers, "num_heads": 2, "num_kv_heads": 1,
                      "dense_ffn_size": 32, "num_experts": 4, "expert_ffn_size": 8, "top_k": 2, "max_seq_len": 8,
                      "first_k_dense": 1, "aux_loss_coeff": 0.01, "bias_update_rate": 0.01},
            "train": {"steps": STEPS, "micro_batch_size": 2, "seq_len": 8, "grad_accum_steps": micro, "lr": 0.01,
                      "warmup_steps": 1, "eval_batches": 0, "run_dir": str(run_dir), "cuda_graphs": graphs},
            "parallel": parallel}


def _runs(rank: int, world: int, raws: list[dict]) -> list[tuple]:
    """Each raw config's (per step (loss, grad norm), final parameters, captures, replays, the kinds of the actions
    captured) on this rank."""
    from tests.graph_replay import ReplayGraphs

    out = []
    for settings in raws:
        cfg = build_config(settings)
        backend = ReplayGraphs() if cfg.train.cuda_graphs else None
        held, build = {}, loop.build_model

        def keep(*args, **kwargs):
            held["stages"], held["runtime"] = build(*args, **kwargs)
            return held["stages"], held["runtime"]
        loop.build_model = keep
        try:
            records = loop.train(cfg, progress=False, feed=RandomFeed(cfg, torch.device("cpu")), checkpoints=False,
                                 graph_backend=backend)
        finally:
            loop.build_model = build
        params = {f"{s}.{name}": p.detach().clone() for s, stage in enumerate(held["stages"])
                  for name, p in stage.named_parameters()}
        graphs = held["runtime"].graphs
        kinds = sorted({action[0].value for step in graphs.sets.values() for action in step.actions}) if graphs else []
        out.append(([(r["loss"], r["grad_norm"]) for r in records], params,
                    backend.captures if backend else 0, backend.replays if backend else 0, kinds))
    return out


@pytest.mark.slow  # spawns 2 processes
def test_pipelined_graphed_steps_equal_eager_ones_bitwise(tmp_path):
    from launch.parallel.spawn import run_processes

    raws = [raw(tmp_path / f"{name}-{graphs}", *layout, graphs) for name, layout in LAYOUTS.items()
            for graphs in (False, True)]
    per_rank = run_processes(_runs, 2, raws, timeout_s=300)
    for rank, results in enumerate(per_rank):
        for n, name in enumerate(LAYOUTS):
            (eager, eager_params, *_), (graphed, graphed_params, captures, replays, kinds) = results[2 * n:2 * n + 2]
            assert len(eager) == (STEPS if rank == 0 else 0), "the records are rank 0's"
            assert graphed == eager, f"{name}: losses and grad norms"
            differ = [key for key, p in eager_params.items() if not torch.equal(graphed_params[key], p)]
            assert not differ, f"{name}, rank {rank}: final parameters {differ[:3]}"
            assert captures > 0 and replays == captures * (STEPS - WARMUP_STEPS), (name, rank, captures, replays)
            assert kinds == KINDS[name][rank], (name, rank, kinds)


def rehearsed(run_dir, backend) -> tuple[list[tuple], dict[str, torch.Tensor], list[torch.Tensor]]:
    """(per step (loss, grad norm), final parameters, every tensor sent to rank 1) of rank 0 of pp2 DualPipeV (the
    B/W split on) rehearsed on the CPU under the fake process group (launch.plan.rehearse: its p2p receives read
    zeros, its routing is forced), over REHEARSED_STEPS steps (all but the last warm-up for the rehearsal's
    measurement), graphed through backend when given."""
    from launch.plan import rehearse as rehearsal
    from pipeline.p2p import P2PChannel

    parallel, layers, micro = LAYOUTS["dualpipev"]
    cfg = build_config(raw(run_dir, parallel, layers, micro, graphs=backend is not None))
    held, build, train = {}, loop.build_model, loop.train

    def keep(*args, **kwargs):
        held["stages"], runtime = build(*args, **kwargs)
        return held["stages"], runtime

    def recorded(*args, **kwargs):
        held["records"] = train(*args, **kwargs)
        return held["records"]
    sent, send = [], P2PChannel.send

    def sending(self, tensors, *args):
        sent.extend(t.detach().clone() for t in tensors)
        return send(self, tensors, *args)
    with (mock.patch.object(loop, "build_model", keep), mock.patch.object(loop, "train", recorded),
          mock.patch.object(P2PChannel, "send", sending)):
        rehearsal.rehearse(cfg, rank=0, device="cpu", micro_batches=micro, warmup_steps=REHEARSED_STEPS - 1,
                           graph_backend=backend)
    return ([(r["loss"], r["grad_norm"]) for r in held["records"]],
            {f"{s}.{name}": p.detach().clone() for s, stage in enumerate(held["stages"])
             for name, p in stage.named_parameters()}, sent)


def test_a_rehearsed_dualpipev_rank_runs_through_the_graphs_as_eagerly(tmp_path):
    """The rehearsal's path (moe-train --rehearse --device cpu: one rank of the layout, the fake process group) with
    train.cuda_graphs and the simulator: the rank's actions are captured and replayed, and its losses, grad norms,
    final parameters and the activations its first stage sends are the eager rehearsal's, bitwise. (The rehearsal's
    numbers are mostly degenerate: its last stage reads zeros from the fake receive, so the loss is the same every
    step and the grads are zero; the sent activations are the first stage's real forward of random tokens.)"""
    from tests.graph_replay import ReplayGraphs

    eager = rehearsed(tmp_path / "eager", None)
    backend = ReplayGraphs()
    graphed = rehearsed(tmp_path / "graphed", backend)
    assert backend.captures > 0 and backend.replays == backend.captures * (REHEARSED_STEPS - WARMUP_STEPS)
    assert len(eager[0]) == REHEARSED_STEPS and graphed[0] == eager[0], "losses and grad norms"
    assert all(torch.equal(graphed[1][name], p) for name, p in eager[1].items()), "final parameters"
    assert len(graphed[2]) == len(eager[2]) > 0 and all(map(torch.equal, graphed[2], eager[2])), "activations sent"
