"""The checks that read two or more sections of a run config, or a section and the rank layout.

Each section checks its own keys when it is made (moe.config, launch.config.sections, launch.config.ops);
RunConfig runs check_sections once all are made. Every error names the fields and what is allowed."""

from __future__ import annotations

from kernels.quant_ref import ALIGN as FP8_ALIGN
from launch.config.ops import OpsSettings
from launch.config.sections import ENDS_TOGETHER, DataSettings, OptimSettings, ParallelSettings, TrainSettings
from launch.parallel.mesh import Layout
from moe.config import ModelConfig
from moe.replicas import check_slots
from moe.tp import check_tp_shapes
from pipeline.schedules import min_chunks


def check_sections(model: ModelConfig, train: TrainSettings, data: DataSettings, par: ParallelSettings,
                   ops: OpsSettings, optim: OptimSettings) -> None:
    """Raise ValueError naming the fields unless the sections, each valid alone, make one runnable layout."""
    _check_seq_len(model, train)
    _check_experts_over_ep(model, par)
    _check_cp_chunks(train, par)
    _check_stages(model, par)
    _check_chunks(train, par)
    _check_hang_rank(ops, par)
    _check_recompute(train, par)
    check_tp_shapes(model, train.seq_len, par.tp, par.sequence_parallel, par.cp)
    _check_mtp(model, par)
    _check_document_mask(data, model, par)
    _check_optim(optim, par)
    _check_fp8_sizes(model, par)
    _check_node_limited_routing(model, par.layout(model))
    _check_redundant_experts(model, par)
    _check_cuda_graphs(train, par)


def _check_seq_len(model: ModelConfig, train: TrainSettings) -> None:
    """A sequence fits the model's positions."""
    if train.seq_len > model.max_seq_len:
        raise ValueError(f"train.seq_len = {train.seq_len} must be <= model.max_seq_len = {model.max_seq_len}")


def _check_cp_chunks(train: TrainSettings, par: ParallelSettings) -> None:
    """Under CP a sequence cuts into 2 x cp zig-zag chunks."""
    if par.cp > 1 and train.seq_len % (2 * par.cp):
        raise ValueError(f"train.seq_len = {train.seq_len} must be divisible by 2 x parallel.cp = {2 * par.cp} "
                         f"(each sequence is cut into 2 x cp zig-zag chunks)")


def _check_experts_over_ep(model: ModelConfig, par: ParallelSettings) -> None:
    """The routed experts split evenly over the EP ranks."""
    if model.num_experts % par.ep:
        allowed = [d for d in range(1, par.stage_ranks + 1) if par.stage_ranks % d == 0 and model.num_experts % d == 0]
        raise ValueError(f"parallel.ep = {par.ep} must divide model.num_experts = {model.num_experts} "
                         f"(allowed with dp x cp x tp = {par.stage_ranks}: {', '.join(map(str, allowed))})")


def _check_stages(model: ModelConfig, par: ParallelSettings) -> None:
    """Every pipeline stage holds at least one layer."""
    if model.num_layers < par.num_stages:
        raise ValueError(f"model.num_layers = {model.num_layers} is fewer than the {par.num_stages} pipeline "
                         f"stages of parallel.pp = {par.pp} with schedule {par.schedule!r} (allowed: "
                         f"model.num_layers >= {par.num_stages}, or a smaller parallel.pp)")


def _check_chunks(train: TrainSettings, par: ParallelSettings) -> None:
    """A step's micro-batches split evenly over the DP ranks, then into pipeline steps of parallel.num_chunks,
    enough of them to fill the schedule."""
    if train.grad_accum_steps % par.dp:
        raise ValueError(f"train.grad_accum_steps = {train.grad_accum_steps} (micro-batches per step, "
                         f"global) must be a multiple of parallel.dp = {par.dp}")
    per_rank = train.grad_accum_steps // par.dp
    chunks = par.chunks_per_step(train.grad_accum_steps)
    if per_rank % chunks:
        raise ValueError(f"parallel.num_chunks = {chunks} must divide the {per_rank} micro-batches each DP rank "
                         f"runs per step (train.grad_accum_steps / parallel.dp)")
    minimum = 1 if par.schedule == "none" else min_chunks(par.schedule, par.pp)
    if chunks < minimum or (par.schedule == "dualpipe" and chunks % 2):
        even = " and even" if par.schedule == "dualpipe" else ""
        raise ValueError(f"parallel.num_chunks = {chunks} is too small for schedule {par.schedule!r} with pp = "
                         f"{par.pp}: it needs >= {minimum}{even} chunks per pipeline step (raise "
                         f"train.grad_accum_steps or parallel.num_chunks)")


def _check_hang_rank(ops: OpsSettings, par: ParallelSettings) -> None:
    """The hang drill's rank exists."""
    hang = ops.inject_hang
    if hang and hang["rank"] >= par.world_size:
        raise ValueError(f"ops.inject_hang.rank = {hang['rank']} must be < the world size parallel.pp x dp x cp x tp = "
                         f"{par.world_size}")


def _check_recompute(train: TrainSettings, par: ParallelSettings) -> None:
    """Full recomputation reruns attention, which must then issue no TP or CP collective."""
    if train.recompute == "full" and (par.tp > 1 or par.cp > 1):
        raise ValueError(f"train.recompute = 'full' reruns attention in backward, which under parallel.tp = "
                         f"{par.tp} and parallel.cp = {par.cp} would issue its collectives again: with tp or cp > 1 "
                         f"use 'none' or 'selective'")


def _check_mtp(model: ModelConfig, par: ParallelSettings) -> None:
    """Multi-token prediction runs without CP, and its embedding copy (first and last stage on different pipeline
    ranks) is sharded by ZeRO-1 over a group of 2 x dp x cp ranks, which must divide the world."""
    if model.mtp_depth and par.cp > 1:
        raise ValueError(f"model.mtp_depth = {model.mtp_depth} does not run with parallel.cp = {par.cp}: "
                         f"set parallel.cp = 1 or model.mtp_depth = 0")
    if model.mtp_depth and par.schedule not in ENDS_TOGETHER and par.pp > 1 and par.pp % 2:
        raise ValueError(f"model.mtp_depth = {model.mtp_depth} with parallel.schedule = {par.schedule!r} needs an "
                         f"even parallel.pp (got {par.pp}): the last rank's embedding copy shares ZeRO-1 shards with "
                         f"the first's; choose an even pp or schedule 'dualpipev'")


def _check_document_mask(data: DataSettings, model: ModelConfig, par: ParallelSettings) -> None:
    """Document masking runs without context parallelism and without multi-token prediction."""
    if data.document_mask and par.cp > 1:
        raise ValueError(f"data.document_mask = true does not run with parallel.cp = {par.cp}: set parallel.cp = 1 "
                         f"or data.document_mask = false")
    if data.document_mask and model.mtp_depth:
        raise ValueError(f"data.document_mask = true does not run with model.mtp_depth = {model.mtp_depth}: set "
                         f"model.mtp_depth = 0 or data.document_mask = false")


def _check_optim(optim: OptimSettings, par: ParallelSettings) -> None:
    """Layouts the ZeRO stages do not run: ZeRO-2 frees each full grad bucket once reduced over DP, so it needs the
    reduction inside the backward and no TP-partial grads still to be summed over TP after it; ZeRO-3's gathers
    and reductions share the DP group, so a pipeline must not run a backward beside a forward
    (parallel.overlap_fb_pairs)."""
    if optim.zero_stage >= 2 and not par.overlap_grad_reduce:
        raise ValueError(f"optim.zero_stage = {optim.zero_stage} reduce-scatters grads during every backward: "
                         f"parallel.overlap_grad_reduce must be true (allowed with false: optim.zero_stage = 1)")
    if optim.zero_stage >= 2 and par.tp > 1:
        raise ValueError(f"optim.zero_stage = {optim.zero_stage} does not run with parallel.tp = {par.tp} (TP-partial "
                         f"grads are summed over TP after the backward): allowed optim.zero_stage = 1, or parallel.tp = 1")
    if optim.offload != "none" and optim.zero_stage == 3:
        raise ValueError(f"optim.offload = {optim.offload!r} does not run with optim.zero_stage = 3 (its params are "
                         f"gathered from device masters): allowed optim.zero_stage = 1 or 2, or optim.offload = 'none'")
    if optim.zero_stage == 3 and par.pp > 1 and par.overlap_fb_pairs:
        raise ValueError("optim.zero_stage = 3 with parallel.pp > 1 gathers params in the forward and the backward on "
                         "one group: parallel.overlap_fb_pairs must be false (allowed with it: optim.zero_stage = 1 or "
                         "2)")


def _check_fp8_sizes(model: ModelConfig, par: ParallelSettings) -> None:
    """FP8 payload rows and FP8 expert GEMM operands are e4m3 rows the GPU kernels read 16 bytes at a time
    (kernels.quant_ref.ALIGN): fp8 payload or fp8 experts need hidden_size, fp8 experts also expert_ffn_size,
    to be multiples of it."""
    fields = {"model.hidden_size": model.hidden_size} if "fp8" in (par.dispatch_payload, model.expert_precision) else {}
    if model.expert_precision == "fp8":
        fields["model.expert_ffn_size"] = model.expert_ffn_size
    for name, size in fields.items():
        if size % FP8_ALIGN:
            low = size // FP8_ALIGN * FP8_ALIGN
            raise ValueError(f"{name} = {size} must be a multiple of {FP8_ALIGN} with parallel.dispatch_payload = "
                             f"{par.dispatch_payload!r} and model.expert_precision = {model.expert_precision!r} "
                             f"(FP8 rows are read {FP8_ALIGN} bytes at a time; allowed e.g. {low or FP8_ALIGN}, "
                             f"{low + FP8_ALIGN}, or 'bf16' / 'native')")


def _check_node_limited_routing(model: ModelConfig, layout: Layout) -> None:
    """Node-limited routing (topk_groups < num_groups) over an EP group spanning nodes keeps each expert group
    inside one node."""
    nodes = layout.ep_nodes()
    if nodes > 1 and layout.ep_gpus_per_node() and model.topk_groups < model.num_groups and model.num_groups % nodes:
        raise ValueError(f"model.num_groups = {model.num_groups} with model.topk_groups = {model.topk_groups}: the EP "
                         f"group spans {nodes} nodes, so node-limited routing needs each expert group inside one "
                         f"node: num_groups must be a multiple of {nodes} (e.g. {nodes}, one group per node)")


def _check_redundant_experts(model: ModelConfig, par: ParallelSettings) -> None:
    """Spare expert slots: at most the experts per EP rank, over an EP group, with dropless routing (capacity is
    counted per logical expert by the router but per physical slot by the rehearsal's rule: the semantics would
    differ)."""
    if not par.redundant_experts:
        return
    check_slots(model.num_experts, par.ep, par.redundant_experts)
    if par.ep == 1:
        raise ValueError(f"parallel.redundant_experts = {par.redundant_experts} needs parallel.ep > 1 (spare slots "
                         f"hold copies on other EP ranks); allowed with ep = 1: 0")
    if model.capacity_factor is not None:
        raise ValueError(f"parallel.redundant_experts = {par.redundant_experts} with model.capacity_factor = "
                         f"{model.capacity_factor}: capacity dropping is per logical expert in the router but per "
                         f"physical slot in the rehearsal's dispatch rule, so the semantics would change; allowed: "
                         f"dropless routing (leave model.capacity_factor out) or parallel.redundant_experts = 0")


def _check_cuda_graphs(train: TrainSettings, par: ParallelSettings) -> None:
    """train.cuda_graphs captures steps that read nothing to the host: over EP ranks only the padded and device-split
    exchanges do (the exact one reads each exchange's sizes). The device is the machine's
    (launch.parallel.device.check_device)."""
    if train.cuda_graphs and par.ep > 1 and par.dispatch_exchange == "exact":
        raise ValueError(f"train.cuda_graphs = true captures steps that read nothing to the host, but "
                         f"parallel.dispatch_exchange = {par.dispatch_exchange!r} with parallel.ep = {par.ep} reads "
                         f"each expert exchange's sizes; allowed: parallel.dispatch_exchange = 'padded' or "
                         f"'device_split', or train.cuda_graphs = false")
