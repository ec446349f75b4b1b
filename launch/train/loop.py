"""The training loop, on any layout: pipeline stages x data parallel x expert parallel, ZeRO-1, one config.

Read top to bottom, one step is: every DP rank takes its slice of the global batch -> the pipeline
runtime (or, with pp = 1, a loop over micro-batches) runs forward and backward through this rank's
stages, and ZeRO-1 sums grads over each parameter's replicas, each bucket as soon as its grads are final
(during the last backward, in flight behind the rest of it) -> one global grad norm clips them ->
AdamW updates the shards -> routing loads summed over all ranks drive the expert-bias update and
the metrics rank 0 writes. A single process runs the same code on a 1-rank mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from dispatch.progress import ACTION, mark
from launch.checkpoint.checkpointer import Checkpointer, TrainState
from launch.config.run import RunConfig
from launch.data.feed import DataFeed
from launch.faults.guard import Preemption, StepGuard
from launch.faults.watchdog import Progress, run_watchdog
from launch.metrics.records import JsonlWriter, TensorBoardWriter
from launch.parallel.device import rank_device
from launch.parallel.mesh import Mesh
from launch.parallel.stages import Stage
from launch.train.graphs import GraphBackend, StepGraphs, step_graphs
from launch.train.build import (build_model, build_optimizer, fold_replica_grads, refresh_replicas,
                                sum_tp_partial_grads)
from launch.train.rundir import METRICS, rewind_metrics, run_identity
from launch.train.step import (ReplicaWindow, document_eos, evaluate, exact_exchanges, forward_backward,
                               gather_step_stats, step_metrics, update_expert_bias)
from optim.lr_schedule import warmup_cosine
from pipeline import PipelineRuntime


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """The launcher's process group, or a 1-rank group (NCCL on a GPU, gloo on the CPU) for a single process."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()



def checkpoint_dir(cfg: RunConfig) -> Path:
    """Root of the run's checkpoints: one sharded DCP folder per saved step (launch.checkpoint.checkpointer)."""
    return Path(cfg.train.run_dir) / "checkpoint"



def train(cfg: RunConfig, metrics_out: str | Path | None = None, resume: bool = False,
          progress: bool = True, device: torch.device | None = None, require_checkpoint: bool = True,
          resume_data: bool = True, feed: DataFeed | None = None, checkpoints: bool = True,
          graph_backend: GraphBackend | None = None) -> list[dict]:
    """Train cfg's model on cfg's corpus with cfg's layout; returns the metric records on rank 0 ([] elsewhere).

    resume: continue from the newest valid checkpoint in RUN_DIR/checkpoint (the metrics file is rewound to its
    step); when there is none, launch.checkpoint.checkpointer.CheckpointRefused names each candidate, unless
    require_checkpoint is False (then the run starts at step 0); without resume_data the sampler starts afresh
    (the data changed: launch.train.rundir.check_resume).

    device: where this rank computes; default train.device's choice (launch.parallel.device: cuda:LOCAL_RANK or
    the CPU). A rehearsal (launch.plan.rehearse) runs under a fake process group, on `meta` (the step runs without
    storage) or on a real device: checkpoints and the step-progress watchdog are skipped (it says so).
    feed: the micro-batches to train on (default: a DataFeed of cfg's data; a real-device rehearsal and a benchmark
    hand in random tokens). checkpoints=False: none is saved, not even after the last step (a benchmark's run).
    graph_backend: how train.cuda_graphs captures and replays the micro-batches (launch.train.graphs; default CUDA
    graphs on device; the tests hand in a CPU simulator, the GPU check CUDA graphs that refuse syncs).
    """
    device = device or rank_device(cfg.train.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with process_group(device):
        return _train(cfg, metrics_out, resume, require_checkpoint, resume_data, progress, device, feed,
                      checkpoints, graph_backend)



def _train(cfg: RunConfig, metrics_out: str | Path | None, resume: bool, require_checkpoint: bool, resume_data: bool,
           progress: bool, device: torch.device, feed: DataFeed | None = None, checkpoints: bool = True,
           graph_backend: GraphBackend | None = None) -> list[dict]:
    settings = cfg.train
    mesh = Mesh(cfg.layout)
    lead = mesh.rank == 0
    if lead and 1 < mesh.layout.world_size and device.type != "meta":  # a rehearsal's world may be thousands
        print(mesh.layout.describe(), flush=True)
    stages, runtime = build_model(cfg, mesh, device)
    optimizer = build_optimizer(stages, cfg, mesh)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, settings.warmup_steps, settings.steps, settings.min_lr_ratio))
    batches = feed or DataFeed(cfg, mesh.dp_rank, device)
    eval_batches = (DataFeed(cfg, mesh.dp_rank, device, "eval")
                    if cfg.data.has_held_out and settings.eval_batches else None)
    rehearsal = device.type == "meta" or dist.get_backend() == "fake"
    if rehearsal:
        print(f"rehearsal on the {device.type} device: checkpoints (DCP writes real storage) and the step-progress "
              "watchdog (the rendezvous store of every rank) are skipped", flush=True)
    checkpointer = None if rehearsal or not checkpoints else Checkpointer(
        checkpoint_dir(cfg), cfg.ops.keep_checkpoints, cfg.ops.async_checkpoint,
        run_identity(settings.run_dir) if lead else None)
    state = TrainState(stages, optimizer, scheduler, batches, StepGuard(cfg.ops), ReplicaWindow(stages, cfg))
    with Preemption() as preemption, run_watchdog(cfg.ops, settings.run_dir, mesh.rank, mesh.layout.world_size,
                                                  enabled=not rehearsal) as phases:
        phases.enter("load", long=True)
        start = checkpointer.load(state, resume_data, required=require_checkpoint) if resume and checkpointer else 0
        refresh_replicas(stages)  # a checkpoint's placement, the owners' loaded weights
        records = _loop(cfg, mesh, stages, runtime, state, checkpointer, eval_batches, start, metrics_out,
                        progress, preemption, phases, step_graphs(cfg, stages, device, graph_backend))
    if checkpointer is not None:
        checkpointer.finish()
    return records



def _loop(cfg: RunConfig, mesh: Mesh, stages: list[Stage], runtime: PipelineRuntime | None, state: TrainState,
          checkpointer: Checkpointer | None, eval_batches: DataFeed | None, start: int, metrics_out: str | Path | None,
          progress: bool, preemption: Preemption, phases: Progress, graphs: StepGraphs | None = None) -> list[dict]:
    """Steps start..train.steps (a spike may roll back, SIGTERM ends early); saves the last step reached; graphs:
    the micro-batches' CUDA graphs (train.cuda_graphs), forgotten after a rollback's load.
    Every rank enters the same phases in phases (launch.faults.watchdog); the first step of a process is a long one."""
    settings, optimizer, scheduler, batches = cfg.train, state.optimizer, state.scheduler, state.data
    lead = mesh.rank == 0
    guard = state.guard
    skipped = reruns = 0
    metrics = Path(metrics_out) if metrics_out else Path(settings.run_dir) / METRICS
    if lead and start > 0:
        rewind_metrics(metrics, start)
    writers = [JsonlWriter(metrics, append=start > 0)] if lead else []
    if lead and settings.tensorboard:
        writers.append(TensorBoardWriter(Path(settings.run_dir) / "tensorboard"))
    records = []
    global_tokens = settings.grad_accum_steps * settings.micro_batch_size * settings.seq_len
    eos = document_eos(cfg)
    bar = tqdm(total=settings.steps, initial=start, disable=not (progress and lead), desc="train", unit="step")
    step, saved = start, start
    window = state.window
    while step < settings.steps:
        began = time.perf_counter()
        micro = batches.next_step()
        per_rank = (step + 1) % settings.rank_metrics_every == 0 or step + 1 == settings.steps

        def attempt(graphs: StepGraphs | None) -> tuple[torch.Tensor, dict]:
            """The step's forward, backward (through graphs, when given), grad sync, clip and statistics:
            (grad norm, stats)."""
            phases.enter("forward/backward", step, long=step == start)
            optimizer.zero_grad(set_to_none=False)  # fp32 grads accumulate into ZeRO-1's flat buffer: no second copy
            lm_part, busy = forward_backward(stages, runtime, micro, cfg.chunks_per_step,
                                             guard.loss_scale(step, 1 / settings.grad_accum_steps),
                                             optimizer if cfg.parallel.overlap_grad_reduce else None, eos, graphs)
            mark("grad sync", ACTION)  # the micro-batches' end (a rehearsal's phase clock, launch.plan.phases)
            phases.enter("grad sync", step)
            fold_replica_grads(stages, optimizer)
            sum_tp_partial_grads(stages, mesh, optimizer)
            compute_s = time.perf_counter() - began
            grad_norm = optimizer.clip_grad_norm_(settings.grad_clip, group=mesh.world)
            phases.enter("step stats", step)
            return grad_norm, gather_step_stats(stages, cfg, mesh, lm_part, grad_norm,
                                                1 - busy / compute_s if runtime is not None else 0.0,
                                                preemption.requested, per_rank)
        grad_norm, stats = attempt(graphs)
        if stats["overflow"]:  # a padded exchange left rows out (on some rank): the step again, exactly and eagerly
            reruns += 1
            with exact_exchanges(stages):
                grad_norm, stats = attempt(None)
            if graphs is not None:  # the grown bounds change the exchange's shapes: warm up and capture again
                graphs.drop()
        lr = scheduler.get_last_lr()[0]
        status = guard.verdict(step, stats["loss"], stats["grad_norm"])
        phases.enter("optimizer", step)
        if status == "ok":
            optimizer.step()
            scheduler.step()
            update_expert_bias(stages, cfg, stats["loads_on_device"])
            window.add(step, stats["loads"])  # every rebalance_every steps: a new placement of the spare slots
            refresh_replicas(stages)  # the owners' updated weights into their replicas
        else:
            skipped += 1
        elapsed = time.perf_counter() - began
        record = step_metrics(step, cfg, stats, {"grad_norm": stats["grad_norm"], "lr": lr, "step_status": status,
                                                 "skipped_steps": skipped, "dispatch_reruns": reruns},
                              global_tokens, elapsed, grad_norm.device)
        record.update({key: stats[key] for key in ("traffic_bytes", "traffic", "ranks") if key in stats})
        if status == "spike" and cfg.ops.spike_policy == "rollback" and checkpointer:
            phases.enter("load", step, long=True)
            back = checkpointer.load(state, restore_data=False)  # 0: no checkpoint yet, the spike is only skipped
            refresh_replicas(stages)
            if graphs is not None:  # a load may bind new tensors: capture again
                graphs.drop()
            if back:
                saved = record["rolled_back_to"] = back
        last = step + 1 == settings.steps
        if eval_batches is not None and (last or (settings.eval_every and step % settings.eval_every == 0)):
            phases.enter("eval", step, long=True)
            record["eval_lm_loss"] = evaluate(stages, runtime, eval_batches, cfg, eos)
        if lead:
            for writer in writers:
                writer.write(record)
            records.append(record)
            bar.set_postfix(loss=f"{record['lm_loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update()
        step = record.get("rolled_back_to", step + 1)
        if checkpointer and settings.checkpoint_every and step % settings.checkpoint_every == 0 and step != saved:
            phases.enter("save", step, long=True)
            checkpointer.save(state, step, dataclasses.asdict(cfg))
            saved = step
        if stats["stop"]:  # a rank got SIGTERM/SIGINT: every rank leaves after the same step
            break
    for writer in writers:
        writer.close()
    if step != saved and checkpointer is not None:
        phases.enter("save", step, long=True)
        checkpointer.save(state, step, dataclasses.asdict(cfg))
    return records

