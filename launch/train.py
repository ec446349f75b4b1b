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
import itertools
import resource
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

from dispatch import EPDispatcher, Traffic
from dispatch.progress import ACTION, mark
from launch.checkpoint import Checkpointer, TrainState
from launch.config import RunConfig
from launch.data import DataFeed, MicroBatch
from launch.device import rank_device, to_host
from launch.faults import Preemption, StepGuard
from launch.materialize import materialize
from launch.mesh import Mesh
from launch.metrics import (JsonlWriter, TensorBoardWriter, expert_load_summary, mfu_peak, model_flops_per_token,
                            moe_layer_metrics, rank_metrics, step_record, throughput_metrics, traffic_metrics)
from launch.stages import LOSS_KINDS, Stage, build_stages
from launch.tokenizer import load_tokenizer
from launch.watchdog import Progress, run_watchdog
from moe.cp import CPRegion
from moe.documents import document_ids, document_labels
from moe.model import MoETransformer
from moe.tp import tp_replicated_params
from optim import ZeRO1
from optim.lr_schedule import warmup_cosine
from pipeline import AFAB, ZB1P, DualPipe, DualPipeV, OneFOneB, PipelineRuntime, build
from pipeline.p2p import TensorMeta

RUNTIMES = {"dualpipev": DualPipeV, "dualpipe": DualPipe, "1f1b": OneFOneB, "zb1p": ZB1P, "afab": AFAB}
TRAFFIC_KINDS = ("dispatch", "combine", "dispatch_backward", "combine_backward")
TRAFFIC_FIELDS = ("intra_payload", "inter_payload", "intra_meta", "inter_meta")


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


def stage_ids(cfg: RunConfig, pp_rank: int) -> list[int]:
    """Positions along the pipeline of the stages pipeline rank pp_rank holds, one per phase of its schedule."""
    if cfg.parallel.pp == 1:
        return [0]
    layout = build(cfg.parallel.schedule, cfg.parallel.pp, cfg.chunks_per_step).layout
    return [layout.stage_of(pp_rank, phase) for phase in range(layout.num_phases)]


def build_model(cfg: RunConfig, mesh: Mesh, device: torch.device) -> tuple[list[Stage], PipelineRuntime | None]:
    """This rank's stages (one per pipeline phase) and their runtime: the model is built on the meta device,
    cut to this rank's stages, TP shard and experts there, and only those are materialised on device,
    each piece with its single-process initial values (launch.materialize)."""
    par = cfg.parallel
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta"):
        model = MoETransformer(cfg.model, cfg.train.recompute).to(getattr(torch, cfg.train.dtype))
    if par.tp > 1:  # before the runtime is built, so its B/W split patches every TP linear
        model.to_tensor_parallel(mesh.tp, par.sequence_parallel, grad_group=mesh.tp_grad)
    if par.cp > 1:
        model.to_context_parallel(CPRegion(mesh.cp, par.cp_method, mesh.cp_grad), mesh.sequence, mesh.sequence_grad)
    stages = build_stages(model, cfg.train.seq_len, par.num_stages, stage_ids(cfg, mesh.pp_rank))
    if par.ep > 1:
        for stage in stages:
            for layer in stage.moe_layers().values():
                layer.to_expert_parallel(EPDispatcher(
                    cfg.model.num_experts, group=mesh.ep, grad_group=mesh.ep_grad,
                    gpus_per_node=mesh.layout.ep_gpus_per_node(), backend=par.dispatch_backend,
                    payload=par.dispatch_payload, hops=mesh.hops, chunks=par.dispatch_chunks,
                    fp8_rows=par.dispatch_payload == "fp8" and cfg.model.expert_precision == "fp8"))
    materialize(stages, cfg.model, cfg.train.seed, device)
    for stage in stages:
        stage.reset_tallies()  # the routing tallies live on device too
    if par.pp == 1:
        return stages, None
    runtime = RUNTIMES[par.schedule](stages, process_group=mesh.pipeline, split_bw=par.split_bw,
                                     overlap=par.overlap, merge_w=par.merge_w)
    runtime.fix_boundary(boundary_meta(cfg))
    return stages, runtime


def boundary_meta(cfg: RunConfig) -> list[TensorMeta]:
    """What crosses every pipeline stage boundary: one micro-batch's hidden states [B, S (S/tp with SP, S/cp with
    CP), H]."""
    seq = cfg.train.seq_len // (cfg.parallel.tp if cfg.parallel.sequence_parallel else 1) // cfg.parallel.cp
    return [TensorMeta(getattr(torch, cfg.train.dtype), True,
                       (cfg.train.micro_batch_size, seq, cfg.model.hidden_size))]


def tp_partial_params(stage: Stage) -> list[Tensor]:
    """Dense params held whole on every TP rank whose local grads are partial sums (SP norms, routers, replicated
    KV); routed experts are left out: their expert-DP group already spans the TP ranks holding them."""
    return [p for name, p, grads in tp_replicated_params(stage) if grads == "partial" and ".experts." not in name]


@torch.no_grad()
def sum_tp_partial_grads(stages: list[Stage], mesh: Mesh, optimizer: ZeRO1) -> None:
    """All-reduce over the TP group (one flat collective, before ZeRO-1 sums over DP) the grads of
    tp_partial_params, as ZeRO-1 holds them (its fp32 sums: a bf16 param's .grad is gone by now)."""
    params = [p for stage in stages for p in tp_partial_params(stage)]
    if mesh.layout.tp == 1 or not params:
        return
    grads = optimizer.local_grads(params)
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=mesh.tp)
    for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(piece.view_as(grad))


def build_optimizer(stages: list[Stage], cfg: RunConfig, mesh: Mesh) -> ZeRO1:
    """ZeRO-1 AdamW: dense params sharded over their replicas (DP, and DualPipe's twin stage copy; per TP
    rank), experts over expert-DP; grads summed (each micro-batch's loss already carries its share).
    Dense params held whole on every TP rank count 1/tp each in the grad norm summed over the world; groups
    holding TP-partial grads are reduced after the backward (sum_tp_partial_grads first), the others during it.
    A param two stages share (the embedding MTP uses on DualPipe's ends) is counted once; an embedding copy on
    another pipeline rank (MTP under 1F1B-like schedules) forms a group of its own over every rank holding it.
    optim.zero_stage 3: the dense params of each module holding them directly (a norm, a linear, a router, the
    embedding) form groups of their own, named by that module: ZeRO-3 gathers them around its forward and
    backward (optim.zero3); experts stay sharded as ZeRO-2 (over expert-DP)."""
    groups, seen = [], set()
    zero3 = cfg.optim.zero_stage == 3
    copies = {id(s.embed.weight): s.embed.weight for s in stages if s.embed is not None and mesh.layout.embed_copy}
    for stage in sorted(stages, key=lambda s: s.layer_ids[0]):  # the same order on every replica
        named = [(name, p) for name, p in stage.named_parameters() if id(p) not in seen and id(p) not in copies]
        seen.update(id(p) for _, p in named)
        whole = {id(p) for name, p, _ in tp_replicated_params(stage) if ".experts." not in name}
        partial = {id(p) for p in tp_partial_params(stage)}
        for expert, replicated, decay in itertools.product((False, True), (False, True), (True, False)):
            params = [p for name, p in named if (".experts." in name) == expert and (id(p) in whole) == replicated
                      and (p.dim() >= 2) == decay]
            base = {"weight_decay": cfg.train.weight_decay if decay else 0.0,
                    "process_group": mesh.expert_replicas if expert else mesh.dense_replicas,
                    "grad_divisor": 1, "norm_weight": 1 / mesh.layout.tp if replicated else 1.0}
            for module, part in (_by_owner(stage, params) if zero3 and not expert else [(None, params)]):
                if part:
                    groups.append({"params": part, **base, "overlap": not any(id(p) in partial for p in part),
                                   **({"module": module} if module is not None else {})})
    groups += [{"params": [p], "weight_decay": cfg.train.weight_decay, "process_group": mesh.embed_replicas,
                "grad_divisor": 1} for p in copies.values()]
    return ZeRO1(groups, torch.optim.AdamW, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2),
                 stage=cfg.optim.zero_stage, offload=_host(cfg, stages))


def _host(cfg: RunConfig, stages: list[Stage]) -> torch.device | None:
    """Where optim.offload "optimizer" keeps the optimizer: host memory, or in a rehearsal the meta device too."""
    if cfg.optim.offload == "none":
        return None
    device = next(stages[0].parameters()).device
    return device if device.type == "meta" else torch.device("cpu")


def _by_owner(stage: Stage, params: list[Tensor]) -> list[tuple[nn.Module, list[Tensor]]]:
    """params split by the module holding each directly, in the stage's module order."""
    wanted = {id(p) for p in params}
    return [(module, [p for p in module.parameters(recurse=False) if id(p) in wanted]) for module in stage.modules()]


def last_backward(optimizer: ZeRO1 | None, runtime: PipelineRuntime | None,
                  last: bool = True) -> contextlib.AbstractContextManager:
    """Around the step's last backward (the last micro-batch's, or the last pipeline step; ZeRO-2: around every
    one, `last` or not): ZeRO-1 starts reducing each bucket as soon as all its grads are final, while the backward
    goes on; with a pipeline the runtime says which grads are (runtime.last_grad: a deferred weight grad once its
    last W ran). The reductions still in flight are waited for in the clip (ZeRO1.clip_grad_norm_)."""
    if optimizer is None or not (last or optimizer.stage >= 2):
        return contextlib.nullcontext()
    return optimizer.reduce_during_backward(runtime.last_grad if runtime is not None else None)


def document_eos(cfg: RunConfig) -> int | None:
    """The EOS id that ends documents when data.document_mask is on (data.tokenizer's), else None."""
    return load_tokenizer(cfg.data.tokenizer).eos_id if cfg.data.document_mask else None


def forward_backward(stages: list[Stage], runtime: PipelineRuntime | None, micro: list[MicroBatch],
                     chunks: int, loss_scale: float, optimizer: ZeRO1 | None = None,
                     eos: int | None = None) -> tuple[Tensor, float]:
    """Forward and backward over this rank's micro-batches (grads accumulate), every LM, MTP and router loss
    scaled by loss_scale (the micro-batch's share of the step's loss); returns (sum of the scaled LM losses
    computed here (without MTP's), a float64 tensor on the stages' device; seconds the pipeline spent busy, or 0 without one).
    optimizer: the ZeRO-1 optimizer to overlap its gradient reduction with the last backward (last_backward).
    eos: document masking (moe.documents) at this EOS id: every stage of the rank gets each micro-batch's document
    ids, computed on the device from its tokens (which every pipeline rank of a DP rank reads), and the labels
    after an EOS are ignored."""
    for stage in stages:
        stage.loss_scale = loss_scale
    device = next(stages[0].parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    last = next((stage for stage in stages if stage.lm_head is not None), None)
    lm_parts: list[Tensor] = []  # the LM losses of a micro-batch or pipeline step, summed into total after it

    def criterion(*outputs: Tensor) -> Tensor:
        """The last stage's loss (Stage.loss), its LM part kept for total."""
        loss, lm_part = last.loss(*outputs)
        lm_parts.append(lm_part.detach())
        return loss

    def add_lm_parts() -> None:
        if lm_parts:
            total.add_(torch.stack(lm_parts).sum())
            lm_parts.clear()

    def labels_of(batch: MicroBatch) -> Tensor:
        return batch.labels if eos is None else document_labels(batch.labels, batch.inputs, eos)

    def documents_of(batch: MicroBatch) -> list[Tensor]:
        return [] if eos is None else [document_ids(batch.inputs, eos)]

    if runtime is None:
        for m, batch in enumerate(micro):
            mark(f"forward of micro-batch {m}", ACTION)
            out = stages[0](batch.inputs, *documents_of(batch))
            loss = criterion(*(out if isinstance(out, tuple) else (out,)), labels_of(batch))
            if torch.is_grad_enabled():
                mark(f"backward of micro-batch {m}", ACTION)
                with last_backward(optimizer, None, m == len(micro) - 1):
                    loss.backward()
            add_lm_parts()
        return total, 0.0
    busy = 0.0
    layout = runtime.schedule(chunks).layout
    entry, exit_ = layout.entry_chunks(runtime.rank), layout.exit_chunks(runtime.rank)
    for first in range(0, len(micro), chunks):
        step = micro[first:first + chunks]
        inputs = torch.cat([step[c].inputs for c in entry]) if entry else None
        labels = torch.cat([labels_of(step[c]) for c in exit_]) if exit_ else None
        context = [torch.cat(parts) for parts in zip(*map(documents_of, step))]
        runtime.timeline = []
        with last_backward(optimizer, runtime, first + chunks >= len(micro)):
            runtime.step(*([inputs] if entry else []), num_chunks=chunks, criterion=criterion,
                         labels=(labels,) if exit_ else (), context=context)
        busy += sum(b for *_, b in runtime.timeline)
        runtime.timeline = None
        add_lm_parts()
    return total, busy


def gather_step_stats(stages: list[Stage], cfg: RunConfig, mesh: Mesh, lm_part: Tensor, grad_norm: Tensor,
                      idle: float, stop: bool, per_rank: bool) -> dict:
    """The step's one stats all-reduce and its one copy to the host: losses and per-layer routing statistics
    summed over every rank (each layer counted once per micro-batch, DualPipe's twin copies seeing disjoint
    chunks; router losses, the same on every TP and CP rank, divided by tp x cp; they route disjoint tokens), expert biases
    averaged over their holders, each MTP depth's loss, the EP-peer traffic matrix, and whether any rank was asked
    to stop (MTP blocks' MoE layers are rows after the model's: ModelConfig.num_routed_layers); none of
    it grows with the world. "loads_on_device" keeps the global loads on the device for the bias update.
    per_rank (every train.rank_metrics_every steps): also each rank's traffic, peak memory and idle share,
    gathered to rank 0 (launch.train.gather_rank_rows)."""
    device = lm_part.device
    by_kind, peers = traffic_table(stages, mesh)
    first_moe, layers, experts = cfg.model.first_k_dense, cfg.model.num_routed_layers, cfg.model.num_experts
    mtp = torch.zeros(cfg.model.mtp_depth, dtype=torch.float64, device=device)  # each MTP depth's loss
    loads = torch.zeros(layers, experts, dtype=torch.float64, device=device)
    biases = torch.zeros(layers, experts, dtype=torch.float64, device=device)
    extra = torch.zeros(layers, 3 + len(LOSS_KINDS), dtype=torch.float64, device=device)  # dropped, aux, holders, losses
    for stage in stages:
        for i, layer in stage.moe_layers().items():
            tally, row = stage.tallies[i], i - first_moe
            loads[row] += tally.tokens_per_expert
            biases[row] += layer.router.expert_bias.detach()
            extra[row, 0] += tally.dropped
            extra[row, 1] += tally.aux_loss
            extra[row, 2] += 1
            extra[row, 3:] += tally.losses
        if stage.mtp_tally is not None:
            mtp += stage.mtp_tally
        stage.reset_tallies()  # and the EP traffic counters, read above
    # host numbers to the device for the all-reduce (a blocking copy: the step's compute is done by now)
    host_tables = [*peers.ravel().tolist(), float(stop)]
    parts = [lm_part.view(1), loads, biases, extra, mtp, torch.tensor(host_tables, dtype=torch.float64, device=device)]
    flat = torch.cat([p.flatten() for p in parts])
    dist.all_reduce(flat)
    host = to_host(torch.cat([flat, grad_norm.detach().view(1).double()]))  # the step's one device-to-host copy
    _, loads_h, biases_h, extra_h, mtp_h, tables, norm = (chunk.view_as(p) for chunk, p in zip(
        host.split([p.numel() for p in parts] + [1]), parts + [grad_norm.view(1)]))
    tp, ep = cfg.parallel.tp, mesh.layout.ep
    shards = tp * cfg.parallel.cp  # the router losses are the same on every TP and CP rank of a sequence
    extra_h[:, 1], extra_h[:, 3:] = extra_h[:, 1] / shards, extra_h[:, 3:] / shards
    ranks = gather_rank_rows(np.concatenate([by_kind.ravel(), rank_row(device, idle)]), device) if per_rank else {}
    lm, aux, mtp_losses = float(host[0]) / tp, float(extra_h[:, 1].sum()), (mtp_h / tp).tolist()
    mtp_term = cfg.model.mtp_loss_coeff / cfg.model.mtp_depth * sum(mtp_losses) if mtp_losses else 0.0
    return {"loss": lm + aux + mtp_term, "lm_loss": lm, "mtp_losses": mtp_losses, "loads": [row.long() for row in loads_h], "dropped": extra_h[:, 0],
            "aux_loss": aux, "biases": biases_h / extra_h[:, 2:3].clamp(min=1),
            "losses": [dict(zip(LOSS_KINDS, row.tolist())) for row in extra_h[:, 3:]], "grad_norm": float(norm[0]),
            "stop": bool(tables[-1] > 0), "loads_on_device": flat[1:1 + loads.numel()].view_as(loads),
            **traffic_metrics(tables[:-1].view(ep, ep).long().tolist(), mesh.layout.ep_gpus_per_node() if ep > 1 else 0),
            **ranks}


def update_expert_bias(stages: list[Stage], cfg: RunConfig, loads: Tensor) -> None:
    """Aux-loss-free balancing of this rank's MoE layers from their global loads [moe layers, E] (on device)."""
    if cfg.model.bias_update_rate:
        for stage in stages:
            for i, layer in stage.moe_layers().items():
                layer.router.update_bias(loads[i - cfg.model.first_k_dense])


def rank_row(device: torch.device, idle: float) -> np.ndarray:
    """This rank's peak memory (bytes allocated on a GPU, the process's peak RSS on a CPU) and pipeline idle share."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return np.array([peak, idle], dtype=np.float64)


def traffic_table(stages: list[Stage], mesh: Mesh) -> tuple[np.ndarray, np.ndarray]:
    """This rank's EP traffic counters of the step (host numbers; Stage.reset_tallies restarts them): float64
    [call kind, (intra payload, inter payload, intra meta, inter meta)], and its row of the EP-peer byte matrix
    by position in the EP group ([ep, ep], summed over ranks in the stats all-reduce)."""
    ep = mesh.layout.ep
    by_kind = np.zeros((len(TRAFFIC_KINDS), len(TRAFFIC_FIELDS)))
    peers = np.zeros((ep, ep))
    me = dist.get_rank(mesh.ep)
    for stage in stages:
        for layer in stage.moe_layers().values():
            meter = getattr(layer.dispatcher, "meter", None)
            if meter is None:
                continue
            for k, kind in enumerate(TRAFFIC_KINDS):
                counts = meter.total.get(kind, Traffic())
                by_kind[k] += [getattr(counts, f) for f in TRAFFIC_FIELDS]
            for peer, nbytes in meter.sent_to.items():
                peers[me, peer] += nbytes
    return by_kind, peers


def gather_rank_rows(row: np.ndarray, device: torch.device) -> dict:
    """Every rank's row (traffic by kind, peak memory, idle share) gathered to rank 0 (O(1) bytes per other rank):
    there, the "traffic_bytes" and "ranks" metrics sections; elsewhere nothing."""
    mine = torch.tensor(row.tolist(), dtype=torch.float64, device=device)
    lead = dist.get_rank() == 0
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())] if lead else None
    dist.gather(mine, rows, dst=0)
    if not lead:
        return {}
    table = to_host(torch.stack(rows))  # rank 0's copy of the gathered rows, on the rank-metrics steps only
    by_kind = table[:, :-2].view(len(table), len(TRAFFIC_KINDS), len(TRAFFIC_FIELDS))
    return {"traffic_bytes": {kind: by_kind[:, k].long().tolist() for k, kind in enumerate(TRAFFIC_KINDS)},
            **rank_metrics(table[:, -2].long().tolist(), table[:, -1].tolist())}


def step_metrics(step: int, cfg: RunConfig, stats: dict, scalars: dict, tokens: int, seconds: float,
                 device: torch.device) -> dict:
    """The step's metrics record (launch/dashboard/SCHEMA.md): scalars, throughput and MFU (against the peaks of
    the precisions the GEMMs run in on this rank's GPU: launch.metrics.mfu_peak), the "moe" section."""
    peak = mfu_peak(cfg.model, cfg.train.seq_len, device, cfg.train.peak_tflops_per_gpu)
    mtp = {f"mtp_loss_{k}": loss for k, loss in enumerate(stats["mtp_losses"], start=1)}
    return step_record(step, {"loss": stats["loss"], "lm_loss": stats["lm_loss"], **mtp,
                              "aux_loss": stats["aux_loss"], "dropped_tokens": int(stats["dropped"].sum())},
                       scalars, throughput_metrics(tokens, seconds, model_flops_per_token(cfg.model, cfg.train.seq_len),
                                                   peak * cfg.parallel.world_size if peak else None),
                       expert_load_summary(stats["loads"]),
                       moe_layer_metrics(stats["loads"], stats["biases"].numpy(), stats["dropped"].long().tolist(),
                                         stats["losses"]))


@torch.no_grad()
def evaluate(stages: list[Stage], runtime: PipelineRuntime | None, batches: DataFeed, cfg: RunConfig,
             eos: int | None = None) -> float:
    """Mean LM loss over the first held-out micro-batches (train.eval_batches, rounded up to fill
    every DP rank's pipeline steps), the same ones every time; eos: document masking (forward_backward)."""
    unit = cfg.parallel.dp * (cfg.chunks_per_step if runtime is not None else 1)
    count = -(-cfg.train.eval_batches // unit) * unit
    held_out = batches.held_out(count)  # this DP rank's share; raises when the held-out rows are too few
    for stage in stages:
        stage.eval()
    total, _ = forward_backward(stages, runtime, held_out, cfg.chunks_per_step, 1 / count, eos=eos)
    for stage in stages:
        stage.train()
        stage.reset_tallies()
    dist.all_reduce(total)
    return float(to_host(total)) / cfg.parallel.tp  # every TP rank computed the same loss


def checkpoint_dir(cfg: RunConfig) -> Path:
    """Root of the run's checkpoints: one sharded DCP folder per saved step (launch.checkpoint)."""
    return Path(cfg.train.run_dir) / "checkpoint"


def train(cfg: RunConfig, metrics_out: str | Path | None = None, resume: bool = False,
          progress: bool = True, device: torch.device | None = None) -> list[dict]:
    """Train cfg's model on cfg's corpus with cfg's layout; returns the metric records on rank 0 ([] elsewhere).

    device: where this rank computes; default train.device's choice (launch.device: cuda:LOCAL_RANK or
    the CPU). A rehearsal (launch.rehearse) hands in `meta` under a fake process group: the step runs
    without storage, checkpoints and the step-progress watchdog are skipped (it says so).
    """
    device = device or rank_device(cfg.train.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with process_group(device):
        return _train(cfg, metrics_out, resume, progress, device)


def _train(cfg: RunConfig, metrics_out: str | Path | None, resume: bool, progress: bool,
           device: torch.device) -> list[dict]:
    settings = cfg.train
    mesh = Mesh(cfg.layout)
    lead = mesh.rank == 0
    if lead and 1 < mesh.layout.world_size and device.type != "meta":  # a rehearsal's world may be thousands
        print(mesh.layout.describe(), flush=True)
    stages, runtime = build_model(cfg, mesh, device)
    optimizer = build_optimizer(stages, cfg, mesh)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, settings.warmup_steps, settings.steps, settings.min_lr_ratio))
    batches = DataFeed(cfg, mesh.dp_rank, device)
    eval_batches = (DataFeed(cfg, mesh.dp_rank, device, "eval")
                    if cfg.data.has_held_out and settings.eval_batches else None)
    rehearsal = device.type == "meta"
    if rehearsal:
        print("rehearsal on the meta device: checkpoints (DCP writes real storage) and the step-progress watchdog "
              "(the rendezvous store of every rank) are skipped", flush=True)
    checkpointer = None if rehearsal else Checkpointer(checkpoint_dir(cfg), cfg.ops.keep_checkpoints,
                                                       cfg.ops.async_checkpoint)
    state = TrainState(stages, optimizer, scheduler, batches, StepGuard(cfg.ops))
    with Preemption() as preemption, run_watchdog(cfg.ops, settings.run_dir, mesh.rank, mesh.layout.world_size,
                                                  enabled=not rehearsal) as phases:
        phases.enter("load", long=True)
        start = checkpointer.load(state) if resume and checkpointer else 0
        records = _loop(cfg, mesh, stages, runtime, state, checkpointer, eval_batches, start, metrics_out,
                        progress, preemption, phases)
    if checkpointer is not None:
        checkpointer.finish()
    return records


def _loop(cfg: RunConfig, mesh: Mesh, stages: list[Stage], runtime: PipelineRuntime | None, state: TrainState,
          checkpointer: Checkpointer | None, eval_batches: DataFeed | None, start: int, metrics_out: str | Path | None,
          progress: bool, preemption: Preemption, phases: Progress) -> list[dict]:
    """Steps start..train.steps (a spike may roll back, SIGTERM ends early); saves the last step reached.
    Every rank enters the same phases in phases (launch.watchdog); the first step of a process is a long one."""
    settings, optimizer, scheduler, batches = cfg.train, state.optimizer, state.scheduler, state.data
    lead = mesh.rank == 0
    guard = state.guard
    skipped = 0
    writers = [JsonlWriter(Path(metrics_out) if metrics_out else Path(settings.run_dir) / "metrics.jsonl",
                           append=start > 0)] if lead else []
    if lead and settings.tensorboard:
        writers.append(TensorBoardWriter(Path(settings.run_dir) / "tensorboard"))
    records = []
    global_tokens = settings.grad_accum_steps * settings.micro_batch_size * settings.seq_len
    eos = document_eos(cfg)
    bar = tqdm(total=settings.steps, initial=start, disable=not (progress and lead), desc="train", unit="step")
    step, saved = start, start
    while step < settings.steps:
        began = time.perf_counter()
        phases.enter("forward/backward", step, long=step == start)
        optimizer.zero_grad(set_to_none=False)  # fp32 grads accumulate into ZeRO-1's flat buffer: no second copy
        micro = batches.next_step()
        lm_part, busy = forward_backward(stages, runtime, micro, cfg.chunks_per_step,
                                         guard.loss_scale(step, 1 / settings.grad_accum_steps),
                                         optimizer if cfg.parallel.overlap_grad_reduce else None, eos)
        phases.enter("grad sync", step)
        sum_tp_partial_grads(stages, mesh, optimizer)
        compute_s = time.perf_counter() - began
        grad_norm = optimizer.clip_grad_norm_(settings.grad_clip, group=mesh.world)
        lr = scheduler.get_last_lr()[0]
        phases.enter("step stats", step)
        per_rank = (step + 1) % settings.rank_metrics_every == 0 or step + 1 == settings.steps
        stats = gather_step_stats(stages, cfg, mesh, lm_part, grad_norm,
                                  1 - busy / compute_s if runtime is not None else 0.0, preemption.requested, per_rank)
        status = guard.verdict(step, stats["loss"], stats["grad_norm"])
        phases.enter("optimizer", step)
        if status == "ok":
            optimizer.step()
            scheduler.step()
            update_expert_bias(stages, cfg, stats["loads_on_device"])
        else:
            skipped += 1
        elapsed = time.perf_counter() - began
        record = step_metrics(step, cfg, stats, {"grad_norm": stats["grad_norm"], "lr": lr, "step_status": status,
                                                 "skipped_steps": skipped}, global_tokens, elapsed,
                              lm_part.device)
        record.update({key: stats[key] for key in ("traffic_bytes", "traffic", "ranks") if key in stats})
        if status == "spike" and cfg.ops.spike_policy == "rollback" and checkpointer:
            phases.enter("load", step, long=True)
            back = checkpointer.load(state, restore_data=False)  # 0: no checkpoint yet, the spike is only skipped
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
