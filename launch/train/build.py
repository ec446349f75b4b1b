"""Assembling one rank's part of the model and its optimizer from the config: the stages it holds (cut from
the whole model built on meta, materialised with their single-process initial values), their pipeline runtime,
and the ZeRO optimizer over their dense (DP) and expert (expert-DP) parameters. The planner and the benches
build models through these functions too."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dispatch import EPDispatcher
from kernels.backend import set_gemm_kernels
from launch.config.run import RunConfig
from launch.parallel.mesh import Mesh
from launch.parallel.stages import Stage, build_stages
from launch.train.materialize import materialize
from moe.cp import CPRegion
from moe.model import MoETransformer
from moe.replicas import ExpertReplicas, SlotLayout, check_slots
from moe.tp import tp_replicated_params
from optim import ZeroOptimizer
from pipeline import AFAB, ZB1P, DualPipe, DualPipeV, OneFOneB, PipelineRuntime, build
from pipeline.p2p import TensorMeta

RUNTIMES = {"dualpipev": DualPipeV, "dualpipe": DualPipe, "1f1b": OneFOneB, "zb1p": ZB1P, "afab": AFAB}



def stage_ids(cfg: RunConfig, pp_rank: int) -> list[int]:
    """Positions along the pipeline of the stages pipeline rank pp_rank holds, one per phase of its schedule."""
    if cfg.parallel.pp == 1:
        return [0]
    layout = build(cfg.parallel.schedule, cfg.parallel.pp, cfg.chunks_per_step).layout
    return [layout.stage_of(pp_rank, phase) for phase in range(layout.num_phases)]



def build_model(cfg: RunConfig, mesh: Mesh, device: torch.device) -> tuple[list[Stage], PipelineRuntime | None]:
    """This rank's stages (one per pipeline phase) and their runtime: the model is built on the meta device,
    cut to this rank's stages, TP shard and experts there, and only those are materialised on device,
    each piece with its single-process initial values (launch.train.materialize)."""
    par = cfg.parallel
    set_gemm_kernels(cfg.train.fp8_gemm)
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta"):
        model = MoETransformer(cfg.model, cfg.train.recompute).to(getattr(torch, cfg.train.dtype))
    if par.tp > 1:  # before the runtime is built, so its B/W split patches every TP linear
        model.to_tensor_parallel(mesh.tp, par.sequence_parallel, grad_group=mesh.tp_grad)
    if par.cp > 1:
        model.to_context_parallel(CPRegion(mesh.cp, par.cp_method, mesh.cp_grad), mesh.sequence, mesh.sequence_grad)
    stages = build_stages(model, cfg.train.seq_len, par.num_stages, stage_ids(cfg, mesh.pp_rank))
    slots = check_slots(cfg.model.num_experts, par.ep, par.redundant_experts)
    if par.ep > 1:
        for stage in stages:
            for layer in stage.moe_layers().values():
                layer.to_expert_parallel(EPDispatcher(
                    slots.num_slots, group=mesh.ep, grad_group=mesh.ep_grad,
                    gpus_per_node=mesh.layout.ep_gpus_per_node(), backend=par.dispatch_backend,
                    payload=par.dispatch_payload, hops=mesh.hops, chunks=par.dispatch_chunks,
                    fp8_rows=par.dispatch_payload == "fp8" and cfg.model.expert_precision == "fp8",
                    exchange=par.dispatch_exchange, headroom=par.dispatch_headroom),
                    replica_set(cfg, mesh, slots))
    materialize(stages, cfg.model, cfg.train.seed, device)
    for stage in stages:
        stage.reset_tallies()  # the routing tallies live on device too
    refresh_replicas(stages)
    if par.pp == 1:
        return stages, None
    runtime = RUNTIMES[par.schedule](stages, process_group=mesh.pipeline, split_bw=par.defer_weight_grads,
                                     overlap=par.overlap_fb_pairs, merge_w=par.chunks_per_weight_grad)
    runtime.fix_boundary(boundary_meta(cfg))
    return stages, runtime



def replica_set(cfg: RunConfig, mesh: Mesh, slots: SlotLayout) -> ExpertReplicas | None:
    """One MoE layer's redundant experts on this rank (parallel.redundant_experts; None without): with node-limited
    routing (model.topk_groups < num_groups) over an EP group spanning nodes, replicas stay on their owner's node."""
    if not slots.spares:
        return None
    limited = cfg.model.topk_groups < cfg.model.num_groups and mesh.layout.ep_nodes() > 1
    return ExpertReplicas(slots, dist.get_rank(mesh.ep), mesh.ep, mesh.layout.ep_gpus_per_node() if limited else 0)



def refresh_replicas(stages: list[Stage]) -> None:
    """Every MoE layer with redundant experts: its spare slots take the placement in its replica_placement buffer
    (a checkpoint's after a load) and their owners' weights (MoELayer.attach_replicas); call after materialising,
    after each optimizer step and after loading a checkpoint, on every rank in the same order."""
    for stage in stages:
        for layer in stage.moe_layers().values():
            if layer.replicas is not None:
                layer.attach_replicas()



def fold_replica_grads(stages: list[Stage], optimizer: ZeroOptimizer) -> None:
    """Sum each redundant expert's grad into its owner's (as ZeRO holds it, before the reduction over expert-DP:
    the expert groups then reduce after the backward, build_optimizer), so one optimizer state per expert sees
    every row's gradient."""
    for stage in stages:
        for layer in stage.moe_layers().values():
            if layer.replicas is not None:
                layer.replicas.fold_grads(optimizer.local_grads([layer.experts.w_gate_up, layer.experts.w_down]))



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
def sum_tp_partial_grads(stages: list[Stage], mesh: Mesh, optimizer: ZeroOptimizer) -> None:
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



def build_optimizer(stages: list[Stage], cfg: RunConfig, mesh: Mesh) -> ZeroOptimizer:
    """ZeRO-1 AdamW: dense params sharded over their replicas (DP, and DualPipe's twin stage copy; per TP
    rank), experts over expert-DP; grads summed (each micro-batch's loss already carries its share).
    Dense params held whole on every TP rank count 1/tp each in the grad norm summed over the world; groups
    holding TP-partial grads are reduced after the backward (sum_tp_partial_grads first), the others during it.
    A param two stages share (the embedding MTP uses on DualPipe's ends) is counted once; an embedding copy on
    another pipeline rank (MTP under 1F1B-like schedules) forms a group of its own over every rank holding it.
    AdamW's moments are stored in optim.moment_dtype; optim.ema_decay keeps a weight EMA in host memory.
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
                    folded = expert and cfg.parallel.redundant_experts > 0  # fold_replica_grads first
                    groups.append({"params": part, **base,
                                   "overlap": not (folded or any(id(p) in partial for p in part)),
                                   **({"module": module} if module is not None else {})})
    groups += [{"params": [p], "weight_decay": cfg.train.weight_decay, "process_group": mesh.embed_replicas,
                "grad_divisor": 1} for p in copies.values()]
    host = _host(stages)
    return ZeroOptimizer(groups, torch.optim.AdamW, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2),
                         stage=cfg.optim.zero_stage, offload=host if cfg.optim.offload == "optimizer" else None,
                         state_dtype=getattr(torch, cfg.optim.moment_dtype), ema_decay=cfg.optim.ema_decay,
                         ema_host=host)



def _host(stages: list[Stage]) -> torch.device:
    """Host memory, where optim.offload "optimizer" keeps the optimizer and optim.ema_decay the weight EMA; in a
    rehearsal the meta device too."""
    device = next(stages[0].parameters()).device
    return device if device.type == "meta" else torch.device("cpu")



def _by_owner(stage: Stage, params: list[Tensor]) -> list[tuple[nn.Module, list[Tensor]]]:
    """params split by the module holding each directly, in the stage's module order."""
    wanted = {id(p) for p in params}
    return [(module, [p for p in module.parameters(recurse=False) if id(p) in wanted]) for module in stage.modules()]

