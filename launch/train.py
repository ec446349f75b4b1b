"""The training loop, on any layout: pipeline stages x data parallel x expert parallel, ZeRO-1, one config.

Read top to bottom, one step is: every DP rank takes its slice of the global batch -> the pipeline
runtime (or, with pp = 1, a loop over micro-batches) runs forward and backward through this rank's
stages -> ZeRO-1 sums grads over each parameter's replicas -> one global grad norm clips them ->
AdamW updates the shards -> routing loads summed over all ranks drive the expert-bias update and
the metrics rank 0 writes. A single process runs the same code on a 1-rank mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import resource
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm

from dispatch import EPDispatcher, Traffic
from launch.checkpoint import Checkpointer, TrainState
from launch.config import RunConfig
from launch.data import ByteTokenizer, PackedBatches, load_token_stream
from launch.faults import Preemption, StepGuard, Watchdog
from launch.mesh import Mesh
from launch.metrics import (JsonlWriter, expert_load_summary, model_flops_per_token, moe_layer_metrics,
                            peak_flops_for_device, rank_metrics, step_record, throughput_metrics, traffic_metrics,
                            TensorBoardWriter)
from launch.stages import Stage, build_stages, lm_loss
from moe.model import MoETransformer
from moe.tp import tp_replicated_params
from optim import ZeRO1
from optim.lr_schedule import warmup_cosine
from pipeline import ZB1P, DualPipe, DualPipeV, OneFOneB, PipelineRuntime, build

RUNTIMES = {"dualpipev": DualPipeV, "dualpipe": DualPipe, "1f1b": OneFOneB, "zb1p": ZB1P}
LOSS_KINDS = ("load_balance", "seq_balance", "z")
TRAFFIC_KINDS = ("dispatch", "combine", "dispatch_backward", "combine_backward")
TRAFFIC_FIELDS = ("intra_payload", "inter_payload", "intra_meta", "inter_meta")


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """The launcher's process group, or a 1-rank gloo group for a single-process run."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def stage_ids(cfg: RunConfig, pp_rank: int) -> list[int]:
    """Positions along the pipeline of the stages pipeline rank pp_rank holds, one per phase of its schedule."""
    if cfg.parallel.pp == 1:
        return [0]
    layout = build(cfg.parallel.schedule, cfg.parallel.pp, cfg.chunks_per_step).layout
    return [layout.stage_of(pp_rank, phase) for phase in range(layout.num_phases)]


def build_model(cfg: RunConfig, mesh: Mesh) -> tuple[list[Stage], PipelineRuntime | None]:
    """This rank's stages (one per pipeline phase) cut from the seeded full model, and their runtime."""
    par = cfg.parallel
    torch.manual_seed(cfg.train.seed)
    model = MoETransformer(cfg.model).to(getattr(torch, cfg.train.dtype))
    if par.tp > 1:  # before the runtime is built, so its B/W split patches every TP linear
        model.to_tensor_parallel(mesh.tp, par.sequence_parallel, grad_group=mesh.tp_grad)
    loss_scale = 1.0 / cfg.train.grad_accum_steps  # each micro-batch's share of the step's mean loss
    stages = build_stages(model, cfg.train.seq_len, par.num_stages, stage_ids(cfg, mesh.pp_rank), loss_scale)
    if par.ep > 1:
        for stage in stages:
            for layer in stage.moe_layers().values():
                layer.to_expert_parallel(EPDispatcher(
                    cfg.model.num_experts, group=mesh.ep, grad_group=mesh.ep_grad,
                    gpus_per_node=mesh.layout.ep_gpus_per_node(), backend=par.dispatch_backend,
                    payload=par.dispatch_payload))
    if par.pp == 1:
        return stages, None
    runtime = RUNTIMES[par.schedule](stages, process_group=mesh.pipeline, split_bw=par.split_bw,
                                     overlap=par.overlap, merge_w=par.merge_w)
    return stages, runtime


def sum_tp_partial_grads(stages: list[Stage], mesh: Mesh) -> None:
    """All-reduce over the TP group (one flat collective, before ZeRO-1 sums over DP) the grads of dense
    params held whole on every TP rank whose local grads are partial sums (SP norms, routers, replicated
    KV); routed experts are left out: their expert-DP group already spans the TP ranks holding them."""
    params = [p for stage in stages for name, p, grads in tp_replicated_params(stage)
              if grads == "partial" and ".experts." not in name and p.grad is not None]
    if mesh.layout.tp == 1 or not params:
        return
    flat = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat, group=mesh.tp)
    for p, piece in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(piece.view_as(p.grad))


def build_optimizer(stages: list[Stage], cfg: RunConfig, mesh: Mesh) -> ZeRO1:
    """ZeRO-1 AdamW: dense params sharded over their replicas (DP, and DualPipe's twin stage copy; per TP
    rank), experts over expert-DP; grads summed (each micro-batch's loss already carries its share).
    Dense params held whole on every TP rank count 1/tp each in the grad norm summed over the world."""
    groups = []
    for stage in sorted(stages, key=lambda s: s.layer_ids[0]):  # the same order on every replica
        named = list(stage.named_parameters())
        whole = {id(p) for name, p, _ in tp_replicated_params(stage) if ".experts." not in name}
        for expert, replicated, decay in itertools.product((False, True), (False, True), (True, False)):
            params = [p for name, p in named if (".experts." in name) == expert and (id(p) in whole) == replicated
                      and (p.dim() >= 2) == decay]
            if params:
                groups.append({"params": params, "weight_decay": cfg.train.weight_decay if decay else 0.0,
                               "process_group": mesh.expert_replicas if expert else mesh.dense_replicas,
                               "grad_divisor": 1, "norm_weight": 1 / mesh.layout.tp if replicated else 1.0})
    return ZeRO1(groups, torch.optim.AdamW, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2))


def my_micro_batches(batches: list[tuple[Tensor, Tensor]], cfg: RunConfig, mesh: Mesh) -> list[tuple[Tensor, Tensor]]:
    """This DP rank's contiguous slice of the global batch's micro-batches."""
    share = len(batches) // cfg.parallel.dp
    return batches[mesh.dp_rank * share:(mesh.dp_rank + 1) * share]


def forward_backward(stages: list[Stage], runtime: PipelineRuntime | None, micro: list[tuple[Tensor, Tensor]],
                     chunks: int, loss_scale: float) -> tuple[float, float]:
    """Forward and backward over this rank's micro-batches (grads accumulate); returns (sum of the LM
    losses computed here, each times loss_scale; seconds the pipeline spent busy, or 0 without one)."""
    if runtime is None:
        total = 0.0
        for inputs, labels in micro:
            loss = lm_loss(stages[0](inputs), labels, loss_scale, stages[0].tp)
            if torch.is_grad_enabled():
                loss.backward()
            total += loss.item()
        return total, 0.0
    total, busy = 0.0, 0.0
    layout = runtime.schedule(chunks).layout
    entry, exit_ = layout.entry_chunks(runtime.rank), layout.exit_chunks(runtime.rank)
    for first in range(0, len(micro), chunks):
        step = micro[first:first + chunks]
        inputs = torch.cat([step[c][0] for c in entry]) if entry else None
        labels = torch.cat([step[c][1] for c in exit_]) if exit_ else None
        runtime.timeline = []
        losses, _ = runtime.step(*([inputs] if entry else []), num_chunks=chunks,
                                 criterion=lambda logits, y: lm_loss(logits, y, loss_scale, stages[0].tp),
                                 labels=(labels,) if exit_ else ())
        busy += sum(b for *_, b in runtime.timeline)
        runtime.timeline = None
        if losses is not None:
            total += losses.sum().item()
    return total, busy


def gather_step_stats(stages: list[Stage], cfg: RunConfig, lm_part: float) -> dict:
    """Sum the step's losses and per-layer routing statistics over every rank (each layer counted once
    per micro-batch, DualPipe's twin copies seeing disjoint chunks; losses, the same on every TP rank,
    divided by tp; TP ranks route disjoint tokens); expert biases averaged over their holders."""
    first_moe = cfg.model.first_k_dense
    layers, experts = cfg.model.num_moe_layers, cfg.model.num_experts
    loads = torch.zeros(layers, experts, dtype=torch.float64)
    biases = torch.zeros(layers, experts, dtype=torch.float64)
    extra = torch.zeros(layers, 3 + len(LOSS_KINDS), dtype=torch.float64)  # dropped, aux, holders, losses by kind
    for stage in stages:
        for i, layer in stage.moe_layers().items():
            tally = stage.tallies[i]
            loads[i - first_moe] += tally.tokens_per_expert.double()
            biases[i - first_moe] += layer.router.expert_bias.detach().double().cpu()
            extra[i - first_moe] += torch.stack([tally.dropped.double(), tally.aux_loss, torch.tensor(1.0).double(), *(
                torch.as_tensor(tally.losses.get(k, 0.0), dtype=torch.float64) for k in LOSS_KINDS)])
        stage.reset_tallies()
    parts = [torch.tensor([lm_part], dtype=torch.float64), loads, biases, extra]
    flat = torch.cat([p.flatten() for p in parts])
    dist.all_reduce(flat)
    _, loads, biases, extra = (chunk.view_as(p) for chunk, p in zip(flat.split([p.numel() for p in parts]), parts))
    tp = cfg.parallel.tp
    extra[:, 1], extra[:, 3:] = extra[:, 1] / tp, extra[:, 3:] / tp
    return {"lm_loss": flat[0].item() / tp, "loads": [row.long() for row in loads], "dropped": extra[:, 0],
            "aux_loss": extra[:, 1].sum().item(), "biases": biases / extra[:, 2:3].clamp(min=1),
            "losses": [dict(zip(LOSS_KINDS, row.tolist())) for row in extra[:, 3:]]}


def update_expert_bias(stages: list[Stage], cfg: RunConfig, loads: list[Tensor]) -> None:
    """Aux-loss-free balancing of this rank's MoE layers from their global loads."""
    if cfg.model.bias_update_rate:
        for stage in stages:
            for i, layer in stage.moe_layers().items():
                layer.router.update_bias(loads[i - cfg.model.first_k_dense])


def rank_figures(idle: float) -> dict:
    """The "ranks" metrics section: every rank's peak memory and pipeline idle fraction (a collective)."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    table = torch.zeros(dist.get_world_size(), 2, dtype=torch.float64)
    table[dist.get_rank()] = torch.tensor([peak, idle], dtype=torch.float64)
    dist.all_reduce(table)
    return rank_metrics(table[:, 0].long().tolist(), table[:, 1].tolist())


def step_traffic(stages: list[Stage], mesh: Mesh) -> dict:
    """Bytes the EP dispatchers sent this step (a collective; Stage.reset_tallies restarts the counters):
    "traffic_bytes" by call kind, per rank [intra payload, inter payload, intra meta, inter meta], and
    the "traffic" section's EP-peer matrix, summed over EP groups by position."""
    world, ep = dist.get_world_size(), mesh.layout.ep
    by_kind = torch.zeros(world, len(TRAFFIC_KINDS), len(TRAFFIC_FIELDS), dtype=torch.float64)
    peers = torch.zeros(ep, ep, dtype=torch.float64)
    me = dist.get_rank(mesh.ep)
    for stage in stages:
        for layer in stage.moe_layers().values():
            meter = getattr(layer.dispatcher, "meter", None)
            if meter is None:
                continue
            for k, kind in enumerate(TRAFFIC_KINDS):
                counts = meter.total.get(kind, Traffic())
                by_kind[dist.get_rank(), k] += torch.tensor([getattr(counts, f) for f in TRAFFIC_FIELDS],
                                                            dtype=torch.float64)
            for peer, nbytes in meter.sent_to.items():
                peers[me, peer] += nbytes
    flat = torch.cat([by_kind.flatten(), peers.flatten()])
    dist.all_reduce(flat)
    by_kind, peers = flat[:by_kind.numel()].view_as(by_kind), flat[by_kind.numel():].view_as(peers)
    return {"traffic_bytes": {kind: by_kind[:, k].long().tolist() for k, kind in enumerate(TRAFFIC_KINDS)},
            **traffic_metrics(peers.long().tolist(), mesh.layout.ep_gpus_per_node() if ep > 1 else 0)}


def step_metrics(step: int, cfg: RunConfig, stats: dict, scalars: dict, tokens: int, seconds: float) -> dict:
    """The step's metrics record (launch/dashboard/SCHEMA.md): scalars, throughput and MFU, the "moe" section."""
    peak = cfg.train.peak_tflops_per_gpu * 1e12 or (
        peak_flops_for_device(torch.cuda.get_device_name()) if torch.cuda.is_available() else None)
    return step_record(step, {"loss": stats["lm_loss"] + stats["aux_loss"], "lm_loss": stats["lm_loss"],
                              "aux_loss": stats["aux_loss"], "dropped_tokens": int(stats["dropped"].sum())},
                       scalars, throughput_metrics(tokens, seconds, model_flops_per_token(cfg.model, cfg.train.seq_len),
                                                   peak * cfg.parallel.world_size if peak else None),
                       expert_load_summary(stats["loads"]),
                       moe_layer_metrics(stats["loads"], stats["biases"].numpy(), stats["dropped"].long().tolist(),
                                         stats["losses"]))


@torch.no_grad()
def evaluate(stages: list[Stage], runtime: PipelineRuntime | None, batches: PackedBatches, cfg: RunConfig,
             mesh: Mesh) -> float:
    """Mean LM loss over the first held-out micro-batches (train.eval_batches, rounded up to fill
    every DP rank's pipeline steps), the same ones every time."""
    unit = cfg.parallel.dp * (cfg.chunks_per_step if runtime is not None else 1)
    count = -(-cfg.train.eval_batches // unit) * unit
    held_out = batches.in_order(count)
    if len(held_out) < count:
        raise ValueError(f"the held-out data has {len(held_out)} micro-batches, fewer than the {count} evaluation "
                         f"needs: raise data.eval_fraction or lower train.eval_batches")
    for stage in stages:
        stage.eval()
    total, _ = forward_backward(stages, runtime, my_micro_batches(held_out, cfg, mesh), cfg.chunks_per_step, 1 / count)
    for stage in stages:
        stage.train()
        stage.reset_tallies()
    result = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(result)
    return result.item() / cfg.parallel.tp  # every TP rank computed the same loss


def checkpoint_dir(cfg: RunConfig) -> Path:
    """Root of the run's checkpoints: one sharded DCP folder per saved step (launch.checkpoint)."""
    return Path(cfg.train.run_dir) / "checkpoint"


def train(cfg: RunConfig, metrics_out: str | Path | None = None, resume: bool = False,
          progress: bool = True) -> list[dict]:
    """Train cfg's model on cfg's corpus with cfg's layout; returns the metric records on rank 0 ([] elsewhere)."""
    with process_group():
        return _train(cfg, metrics_out, resume, progress)


def _train(cfg: RunConfig, metrics_out: str | Path | None, resume: bool, progress: bool) -> list[dict]:
    settings = cfg.train
    mesh = Mesh(cfg.layout)
    lead = mesh.rank == 0
    if lead and mesh.layout.world_size > 1:
        print(mesh.layout.describe(), flush=True)
    stages, runtime = build_model(cfg, mesh)
    optimizer = build_optimizer(stages, cfg, mesh)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, settings.warmup_steps, settings.steps, settings.min_lr_ratio))
    stream = load_token_stream(cfg.data.corpus, cfg.data.max_bytes, ByteTokenizer())
    eval_tokens = int(stream.numel() * cfg.data.eval_fraction)
    batches = PackedBatches(stream[: stream.numel() - eval_tokens], settings.seq_len,
                            settings.micro_batch_size, settings.seed)
    eval_batches = (PackedBatches(stream[stream.numel() - eval_tokens:], settings.seq_len,
                                  settings.micro_batch_size, settings.seed)
                    if eval_tokens and settings.eval_batches else None)
    checkpointer = Checkpointer(checkpoint_dir(cfg), cfg.ops.keep_checkpoints, cfg.ops.async_checkpoint)
    state = TrainState(stages, optimizer, scheduler, batches)
    start = checkpointer.load(state) if resume else 0
    with Preemption() as preemption, Watchdog(Path(settings.run_dir) / "heartbeat", mesh.rank,
                                              mesh.layout.world_size, cfg.ops.heartbeat_timeout_s):
        records = _loop(cfg, mesh, stages, runtime, state, checkpointer, eval_batches, start, metrics_out,
                        progress, preemption)
    checkpointer.finish()
    return records


def _loop(cfg: RunConfig, mesh: Mesh, stages: list[Stage], runtime: PipelineRuntime | None, state: TrainState,
          checkpointer: Checkpointer, eval_batches: PackedBatches | None, start: int, metrics_out: str | Path | None,
          progress: bool, preemption: Preemption) -> list[dict]:
    """Steps start..train.steps (a spike may roll back, SIGTERM ends early); saves the last step reached."""
    settings, optimizer, scheduler, batches = cfg.train, state.optimizer, state.scheduler, state.data
    lead = mesh.rank == 0
    guard = StepGuard(cfg.ops)
    skipped = 0
    writers = [JsonlWriter(Path(metrics_out) if metrics_out else Path(settings.run_dir) / "metrics.jsonl",
                           append=start > 0)] if lead else []
    if lead and settings.tensorboard:
        writers.append(TensorBoardWriter(Path(settings.run_dir) / "tensorboard"))
    records = []
    global_tokens = settings.grad_accum_steps * settings.micro_batch_size * settings.seq_len
    bar = tqdm(total=settings.steps, initial=start, disable=not (progress and lead), desc="train", unit="step")
    step, saved = start, start
    while step < settings.steps:
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        micro = my_micro_batches([batches.next_batch() for _ in range(settings.grad_accum_steps)], cfg, mesh)
        lm_part, busy = forward_backward(stages, runtime, micro, cfg.chunks_per_step,
                                         guard.loss_scale(step, 1 / settings.grad_accum_steps))
        sum_tp_partial_grads(stages, mesh)
        compute_s = time.perf_counter() - began
        grad_norm = optimizer.clip_grad_norm_(settings.grad_clip, group=mesh.world)
        lr = scheduler.get_last_lr()[0]
        traffic = step_traffic(stages, mesh)
        stats = gather_step_stats(stages, cfg, lm_part)
        status = guard.verdict(step, stats["lm_loss"] + stats["aux_loss"], grad_norm.item())
        if status == "ok":
            optimizer.step()
            scheduler.step()
            update_expert_bias(stages, cfg, stats["loads"])
        else:
            skipped += 1
        figures = rank_figures(1 - busy / compute_s if runtime is not None else 0.0)
        elapsed = time.perf_counter() - began
        record = step_metrics(step, cfg, stats, {"grad_norm": grad_norm.item(), "lr": lr, "step_status": status,
                                                 "skipped_steps": skipped}, global_tokens, elapsed)
        record.update(traffic, **figures)
        if status == "spike" and cfg.ops.spike_policy == "rollback":
            back = checkpointer.load(state, restore_data=False)  # 0: no checkpoint yet, the spike is only skipped
            if back:
                saved = record["rolled_back_to"] = back
        last = step + 1 == settings.steps
        if eval_batches is not None and (last or (settings.eval_every and step % settings.eval_every == 0)):
            record["eval_lm_loss"] = evaluate(stages, runtime, eval_batches, cfg, mesh)
        if lead:
            for writer in writers:
                writer.write(record)
            records.append(record)
            bar.set_postfix(loss=f"{record['lm_loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update()
        step = record.get("rolled_back_to", step + 1)
        if settings.checkpoint_every and step % settings.checkpoint_every == 0 and step != saved:
            checkpointer.save(state, step, dataclasses.asdict(cfg))
            saved = step
        if preemption.agreed():
            break
    for writer in writers:
        writer.close()
    if step != saved:
        checkpointer.save(state, step, dataclasses.asdict(cfg))
    return records
