"""A plan for one config and machine: parameters, memory, bytes per link and time of each pipeline rank."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from dispatch import Traffic, make_topology
from dispatch.routes import padded_bounds, routes_for
from launch.config.run import RunConfig
from launch.metrics.flops import attention_shape, layer_flops, mixed_peak, model_flops_per_token
from launch.plan.compute import (GEMM, ROUTING, Precisions, Seconds, Work, elementwise_seconds, head_seconds,
                                 layer_seconds, moe_block_seconds, mtp_seconds)
from launch.plan.efficiency import (ATTENTION_SUSTAINED_CLOCK, PRECISIONS, SYNCED_SLOT_SECONDS, SUSTAINED_CLOCK,
                                    GemmModel)
from launch.plan.memory import (FP8_CACHED, RERUN_EXCHANGES, ActivationModel, ModelStates, backward_workspace,
                                offloaded, schedule_peaks, zero_model_states)
from launch.plan.params import ModelParams, count_params
from launch.plan.presets import GPU, RECIPES, StateBytes
from launch.plan.timing import Rates, StageCost, interleave, paired, simulate_step
from launch.plan.traffic import EPStats, cp_attention_bytes, cp_kv_width, ep_stats, ring_bytes, total
from launch.parallel.stages import stage_ranges
from moe.replicas import check_slots
from pipeline.schedules import StageLayout, Schedule, build, merge_weight_grads

if TYPE_CHECKING:
    from launch.parallel.mesh import Layout
    from launch.plan.profile import Profile

BYTE_KINDS = ("ep", "pp", "dp", "tp", "cp")  # what a rank's bytes are sent for
LAYOUT_KINDS = {"none": "linear", "afab": "linear", "1f1b": "linear", "zb1p": "linear", "dualpipe": "bidirectional",
                "dualpipev": "v"}
COMM_SM_SHARE = 20 / 132  # DeepSeek-V3 (report section 3.2.2): 20 of an H800's 132 SMs drive its communication
# Share of the EP exchanges a paired 1F1B (Megatron-Core's combined 1F1B, --paired-1f1b) hides of what the paired half's
# compute could cover: fitted to a published A/B of that overlap (`moe-plan --validate` refits it; which A/B, and the
# runs that test it: docs/planner.md). DualPipe's pairs (this runtime's F&B overlap) hide all of it.
PAIR_HIDDEN = 0.5


@dataclass(frozen=True)
class Machine:
    """The cluster: a GPU (peaks, memory, links), GPUs per node, how GEMMs are priced (gemm_efficiency None:
    launch.plan.efficiency's model by shape and precision; a number: that share of peak for every GEMM) and
    the share of SMs communication kernels hold while they run beside compute; with a profile, each stage's
    compute and EP seconds are the ones measured on this machine instead."""

    gpu: GPU
    gpus_per_node: int
    gemm_efficiency: float | None = None
    profile: Profile | None = None
    comm_sm_share: float = COMM_SM_SHARE
    slot_seconds: float = SYNCED_SLOT_SECONDS  # per routed slot of an MoE layer (efficiency.SLOT_SECONDS: synced)
    clock: float = SUSTAINED_CLOCK  # share of the boost clock GEMMs hold through a run (efficiency.SUSTAINED_CLOCK)
    attention_clock: float = ATTENTION_SUSTAINED_CLOCK  # the same for attention
    pair_hidden: float = PAIR_HIDDEN  # share of a paired 1F1B's EP exchanges its pairs hide (timing.paired)

    def rates(self) -> Rates:
        """Link bytes/s and the fixed cost of an exchange."""
        return Rates(self.gpu.intra_node_gbps * 1e9, self.gpu.inter_node_gbps * 1e9,
                     self.gpu.exchange_latency_us * 1e-6)

    @property
    def gemms(self) -> GemmModel:
        """What prices this machine's GEMMs and attention."""
        return GemmModel(self.gpu, self.gemm_efficiency, self.slot_seconds, self.clock, self.attention_clock)


@dataclass(frozen=True)
class Options:
    """Planner-side choices the run config does not hold."""

    recompute: str = "none"
    kernels: str | None = None   # activation bytes by kernels (memory.KERNELS); default: the runtime's, runtime_kernels
    recipe: str | None = None    # model-state bytes (presets.RECIPES); default: default_recipe(config)
    sample_tokens: int = 1024    # tokens per EP rank routed to estimate dispatch bytes
    linears: str | None = None   # precision of every linear (efficiency.PRECISIONS); default BF16 + the config's experts
    virtual_stages: int = 1      # interleaved 1F1B: model chunks per rank (Megatron's VPP), shrinking the bubble
    paired: bool = False         # 1F1B whose steady-state F, B neighbours run as overlapped pairs (EP A2A overlap)
    dp_overlap: bool = False     # DP grad reduce runs behind the step's last backward (Megatron --overlap-grad-reduce)
    # per routed MoE layer (model.num_routed_layers), the busiest EP rank's rows over the balanced share in one
    # exchange (launch.plan.imbalance: --loads, --imbalance); empty: forced balance, every layer at 1
    imbalance: tuple[float, ...] = ()


@dataclass
class RankPlan:
    """One pipeline rank (any of its DP/TP replicas): what it holds and its memory."""

    rank: int
    stages: list[int]
    dense_params: float
    expert_params: float
    states: ModelStates
    activations: float
    transient: float  # what recompute's reruns add to the schedule's peak (schedule_peaks' backward_bytes)
    workspace: float = 0.0  # launch.plan.memory.backward_workspace of the rank's stages
    bytes: dict[str, Traffic] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        """Model states plus the schedule's peak activations (and a recomputed layer's, and the most one
        backward op holds beyond them)."""
        return self.states.total + self.activations + self.transient + self.workspace


@dataclass
class Plan:
    """Everything predicted for one config on one machine."""

    config: RunConfig
    machine: Machine
    options: Options
    params: ModelParams
    layers: list[range]
    ranks: list[RankPlan]
    ep: EPStats | None
    stage_costs: list[StageCost]
    p2p_seconds: float
    makespan: float
    idle_fraction: float  # the bubble: idle share of all ranks' time in the pipeline step (mean over ranks)
    dp_sync_seconds: float
    tokens_per_step: int
    flops_per_token: float
    pipeline_steps: int = 1
    idle_fractions: list[float] = field(default_factory=list)  # per pipeline rank, from the simulator
    offload_seconds: float = 0.0  # optim.offload: the grad shards' copy to the host and the params' back
    # per stage, the compute of one chunk by kind of work (StageCost's f, b, w split: launch.plan.kinds.step_kinds);
    # empty when the stages' seconds come from a measured profile
    stage_work: list[Work] = field(default_factory=list)

    @property
    def step_seconds(self) -> float:
        """The pipeline steps of one optimizer step plus the gradient sync and the offloaded optimizer's copies
        after them (the host's AdamW itself is not priced)."""
        return self.pipeline_steps * self.makespan + self.dp_sync_seconds + self.offload_seconds

    @property
    def tokens_per_second(self) -> float:
        """Tokens trained per second by the whole cluster."""
        return self.tokens_per_step / self.step_seconds

    @property
    def peak_flops(self) -> float:
        """The peak FLOP/s per GPU MFU divides by: dense BF16, with the routed experts' share of the FLOPs at
        the FP8 peak when they run in FP8 (launch.metrics.flops.mixed_peak, as the trainer's MFU)."""
        gpu = self.machine.gpu
        return mixed_peak(self.config.model, self.config.train.seq_len, gpu.bf16_tflops * 1e12, gpu.fp8_tflops * 1e12)

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the cluster's peak (peak_flops per GPU)."""
        world = self.config.parallel.world_size
        return self.flops_per_token * self.tokens_per_second / (world * self.peak_flops)

    @property
    def peak_memory(self) -> float:
        """The largest per-GPU peak of any pipeline rank."""
        return max(r.peak for r in self.ranks)

    @property
    def fits(self) -> bool:
        """Whether every rank's peak fits in the GPU's memory."""
        return self.peak_memory <= self.machine.gpu.memory_gb * 1e9


def runtime_kernels(config: RunConfig) -> str:
    """The activation bytes (memory.KERNELS) this runtime keeps for the config: "fused-fp8" with DeepSeek-V3's
    recipe on (model.linear_precision, expert_precision and activation_cache all "fp8": FP8 linears keeping their
    e4m3 input tiles, FP8-cached SwiGLU inputs, norms rebuilt into their FP8 consumers, no expert output kept by
    combine), else "project" (its ops with native activations)."""
    cfg = config.model
    recipe = (cfg.linear_precision, cfg.expert_precision, cfg.activation_cache)
    return "fused-fp8" if recipe == ("fp8", "fp8", "fp8") else "project"


def runtime_handling(config: RunConfig) -> str:
    """How this runtime handles an MoE layer's routed slots (efficiency.MOE_HANDLING) for the config: "captured" with
    train.cuda_graphs (the step captured whole: nothing read to the host, no eager launches), else "synced" (sizes
    read to the host and eager launches, or at least the launches)."""
    return "captured" if config.train.cuda_graphs else "synced"


def default_recipe(config: RunConfig) -> StateBytes:
    """The recipe the runtime's ZeroOptimizer holds for the config: its training dtype (bf16 weights with fp32
    masters, or weights that are their own masters) and optim.moment_dtype; grads are reduce-scattered in place."""
    bf16_moments = config.optim.moment_dtype == "bfloat16"
    if config.train.dtype == "bfloat16":
        return RECIPES["deepseek-v3" if bf16_moments else "project-bf16"]
    return RECIPES["project-fp32-bf16-moments" if bf16_moments else "project-fp32"]


def make_schedule(config: RunConfig) -> Schedule | None:
    """The pipeline schedule the runtime would run (None without pipeline parallelism)."""
    par = config.parallel
    if par.schedule == "none":
        return None
    schedule = build(par.schedule, par.pp, config.chunks_per_step, split_bw=par.defer_weight_grads)
    merge = par.chunks_per_weight_grad
    return merge_weight_grads(schedule, merge) if merge > 1 else schedule


def _layout(config: RunConfig) -> StageLayout:
    par = config.parallel
    return StageLayout(LAYOUT_KINDS[par.schedule], par.pp, config.chunks_per_step)


def node_of(ranks: Layout, gpus_per_node: int, pp: int, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
    """Node of the global rank at (pp, dp, tp, cp) (config.layout's rank order: launch.parallel.mesh.Layout)."""
    return ranks.rank(pp, dp, tp, cp) // gpus_per_node


def chunk_tokens(config: RunConfig) -> int:
    """Tokens of one chunk one rank's TP group holds: a micro-batch, each sequence's CP share of it."""
    return config.train.micro_batch_size * config.train.seq_len // config.parallel.cp


def _groups(config: RunConfig, gpus_per_node: int, rank: int) -> tuple[int, int, bool, bool]:
    """(dense shard group size, expert shard group size, whether each spans nodes) for pipeline rank."""
    par = config.parallel
    twins = [rank, par.pp - 1 - rank] if par.schedule == "dualpipe" and par.pp - 1 - rank != rank else [rank]
    ranks = config.layout
    dense = {node_of(ranks, gpus_per_node, p, d, 0, c) for p in twins for d in range(par.dp) for c in range(par.cp)}
    expert = {(p * par.stage_ranks + i) // gpus_per_node for p in twins for i in range(0, par.stage_ranks, par.ep)}
    replicas = len(twins)
    return par.dp * par.cp * replicas, par.stage_ranks // par.ep * replicas, len(dense) > 1, len(expert) > 1


def make_plan(config: RunConfig, machine: Machine, options: Options = Options(), timed: bool = True) -> Plan:
    """Predict memory, traffic and time of config on machine (timed=False: memory only, no traffic or time)."""
    par, cfg, train = config.parallel, config.model, config.train
    gpn = min(machine.gpus_per_node, par.world_size)  # a world smaller than a node sits in one
    if par.world_size % gpn:
        raise ValueError(f"gpus_per_node = {gpn} must divide the world size pp x dp x cp x tp = {par.world_size}")
    machine = replace(machine, gpus_per_node=gpn)
    _check_options(config, options)
    options = replace(options, kernels=options.kernels or runtime_kernels(config))
    num_stages = par.num_stages
    layers = stage_ranges(cfg, train.seq_len, num_stages)  # the trainer's own split
    params = count_params(cfg, layers)
    recipe = RECIPES[options.recipe] if options.recipe else default_recipe(config)
    dtype = getattr(torch, train.dtype)
    itemsize = dtype.itemsize
    chunks = config.chunks_per_step
    tokens = chunk_tokens(config)
    acts = ActivationModel(cfg, params.attention, itemsize, par.tp, par.sequence_parallel, options.recompute,
                           options.kernels, par.cp, par.cp_method, padded_slot_rows(config, gpn, tokens))
    schedule = make_schedule(config)
    layout = _layout(config)
    moe_layers = [sum(i >= cfg.first_k_dense for i in span) for span in layers]
    moe_layers[-1] += cfg.mtp_depth if cfg.num_moe_layers else 0  # the MTP depths' blocks, on the last stage
    spare_numel, copied = replica_numels(config)
    stage_bytes = [acts.stage(layers[s], s == num_stages - 1, tokens) + moe_layers[s] * copied * itemsize
                   for s in range(num_stages)]
    ep = (ep_stats(cfg, par.ep, gpn, tokens // par.tp, par.dispatch_backend, par.dispatch_payload, dtype,
                   options.sample_tokens) if timed and cfg.num_layers > cfg.first_k_dense else None)
    ep_layer = total(ep.layer) if ep else Traffic()
    if ep and options.recompute in RERUN_EXCHANGES:  # the forward's exchanges again before each backward
        ep_layer = ep_layer + ep.layer["dispatch"] + ep.layer["combine"]
    rates = machine.rates()
    if machine.profile and len(machine.profile.stages) != num_stages:
        raise ValueError(f"the machine's profile has {len(machine.profile.stages)} stages, the layout {num_stages}: "
                         f"profile the config being planned")
    by_stage = [] if machine.profile else [
        _stage_cost(config, params, layers[s], s == num_stages - 1, moe_layers[s], ep, machine, gpn, options)
        for s in range(num_stages)]
    costs = ([machine.profile.stage_cost(s) for s in range(num_stages)] if machine.profile
             else [cost for cost, _ in by_stage])
    # overlap: the runtime runs each F&B pair's halves at once (the backward on a helper thread)
    deferred = [acts.deferred_stage(layers[s], s == num_stages - 1, tokens) for s in range(num_stages)]
    # a pair's halves allocate and free over their kernels' time: the slot cost is fitted to throughput, not memory
    kernels = [c.without_slots() for c in costs] if par.overlap_fb_pairs else None
    peaks = (schedule_peaks(schedule, stage_bytes, kernels, deferred) if schedule
             else [stage_bytes[0]])
    # recompute full, moe or layer: the same schedule with each backward's rerun segments held beside the rest
    backward = [acts.backward_stage(layers[s], s == num_stages - 1, tokens) + moe_layers[s] * copied * itemsize
                for s in range(num_stages)]
    reruns = (schedule_peaks(schedule, stage_bytes, kernels, deferred, backward) if schedule
              else [backward[0]])
    act_bytes = tokens * cfg.hidden_size * itemsize / (par.tp if par.sequence_parallel else 1)
    ranks, syncs, prefetched = [], [], []
    for rank in range(par.pp):
        held = sorted({layout.stage_of(rank, phase) for phase in range(layout.num_phases)})
        dense = sum(params.stages[s].on_rank(par.tp, par.ep)[0] for s in held)
        expert = sum(params.stages[s].on_rank(par.tp, par.ep)[1] for s in held)
        dense_group, expert_group, dense_inter, expert_inter = _groups(config, gpn, rank)
        parts = [(dense, dense_group, config.optim.zero_stage), (expert, expert_group, min(config.optim.zero_stage, 2))]
        states = ModelStates(0.0, 0.0, 0.0)
        for numel, group, stage in parts:
            part = zero_model_states(numel, group, stage, recipe)
            states += offloaded(part, numel, group, recipe) if config.optim.offload == "optimizer" else part
        spares = spare_numel * sum(moe_layers[s] for s in held)  # redundant experts' weights: no optimizer state
        states += ModelStates(spares * recipe.param, 0.0, 0.0)
        transient = reruns[rank] - peaks[rank]
        workspace = max(backward_workspace(cfg, layers[s], s == 0, s == num_stages - 1, par.ep, par.tp, itemsize,
                                           tokens) for s in held)
        plan = RankPlan(rank, held, dense, expert, states, peaks[rank], transient, workspace)
        grad_sync = [(dense, dense_group, dense_inter, True), (expert, expert_group, expert_inter, False)]
        ranks.append(plan)
        if timed:
            plan.bytes = _rank_bytes(config, layout, rank, held, moe_layers, layers, ep_layer, act_bytes, grad_sync,
                                     itemsize, recipe, gpn, options.recompute == "layer")
            replicas = replica_bytes(config, gpn, spares * itemsize)
            plan.bytes["ep"] = plan.bytes["ep"] + replicas
            syncs.append(rates.link_seconds(plan.bytes["dp"].intra_node + replicas.intra_node,
                                            plan.bytes["dp"].inter_node + replicas.inter_node))
            in_step = _gathers(config, layout, rank, held) if config.optim.zero_stage == 3 else 0
            gathers = in_step * ring_bytes(dense, dense_group, recipe.param)
            prefetched.append(gathers / (rates.inter_bps if dense_inter else rates.intra_bps))
    p2p_inter = par.stage_ranks >= gpn and par.pp > 1
    p2p_seconds = act_bytes / (rates.inter_bps if p2p_inter else rates.intra_bps)
    busy = [0.0] * par.pp  # compute seconds of each pipeline rank in one pipeline step
    if not timed:
        makespan, idles = 0.0, [0.0] * par.pp
    elif schedule:
        profile = machine.profile
        priced = paired(costs, machine.comm_sm_share, machine.pair_hidden) if options.paired else costs
        result = simulate_step(schedule, priced, p2p_seconds, par.overlap_fb_pairs, profile.pair_factor if profile else 1.0,
                               profile.speed(par.pp) if profile else None, machine.comm_sm_share)
        makespan, idles, busy = result.makespan, result.idle_fractions, result.busy
        if options.virtual_stages > 1:
            makespan, idles = interleave(result, options.virtual_stages)
    else:  # one stage: the micro-batches in turn (paired: each F beside the previous one's B, as Megatron-Core's EP
        # overlap runs them without a pipeline; the first F and last B, unpaired, are not told apart)
        serial = (paired(costs, machine.comm_sm_share, machine.pair_hidden) if options.paired else costs)[0].serial
        makespan, idles, busy = chunks * serial, [0.0], [chunks * serial]
    steps = train.grad_accum_steps // par.dp // chunks
    # ZeRO-3's in-step gathers are prefetched beside the compute (the module ahead): exposed only beyond it
    sync = max((s - min(g, steps * b) for s, g, b in zip(syncs, prefetched, busy)), default=0.0)
    if options.dp_overlap:
        sync = max(0.0, sync - max(c.b for c in costs))
    offload = 0.0
    if config.optim.offload == "optimizer" and timed:  # fp32 grad shard out, params back, the two directions at once
        offload = max(max(4, recipe.param) * (r.dense_params / _groups(config, gpn, r.rank)[0]
                                              + r.expert_params / _groups(config, gpn, r.rank)[1]) for r in ranks
                      ) / (machine.gpu.host_gbps * 1e9)
    return Plan(config, machine, options, params, layers, ranks, ep, costs, p2p_seconds, makespan,
                sum(idles) / len(idles), sync,
                train.grad_accum_steps * tokens * par.cp, model_flops_per_token(cfg, train.seq_len),
                steps, list(idles), offload, [work for _, work in by_stage])


def padded_slot_rows(config: RunConfig, gpus_per_node: int, tokens: int) -> float:
    """Rows the routed experts take per routed slot (ActivationModel.slot_rows): 1, but with a padded exchange over
    EP ranks (parallel.dispatch_exchange = "padded" or "device_split") the fixed rows dispatch.routes.padded_bounds
    hands a rank's experts for a chunk of tokens (tokens / tp of them routed on each TP rank, in
    parallel.dispatch_chunks chunks, at parallel.dispatch_headroom, redundant experts' slots included), over those
    tokens' top_k slots."""
    par, cfg = config.parallel, config.model
    routed = tokens // par.tp
    if par.dispatch_exchange == "exact" or par.ep == 1 or not cfg.num_moe_layers or not routed:
        return 1.0
    slots = check_slots(cfg.num_experts, par.ep, par.redundant_experts)
    topology = make_topology(par.ep, min(gpus_per_node, par.ep))
    stages = routes_for(par.dispatch_backend, topology, slots.num_slots, 0, torch.device("meta"))
    _, rows = padded_bounds(stages, slots.num_slots // par.ep, routed, cfg.top_k, par.dispatch_headroom,
                            par.dispatch_chunks)
    return rows / (routed * cfg.top_k)


def replica_numels(config: RunConfig) -> tuple[int, int]:
    """(elements of one MoE layer's redundant experts on an EP rank, of the expert weights one chunk through that
    layer keeps): parallel.redundant_experts spare copies of w_gate_up and w_down (moe.replicas), and, with
    spares, the owned and spare weights the grouped GEMMs run on, concatenated per call and saved for backward
    (moe.experts.GroupedExperts); (0, 0) without spares."""
    cfg, spares = config.model, config.parallel.redundant_experts
    if not spares or config.parallel.ep == 1:
        return 0, 0
    per_expert = 3 * cfg.hidden_size * cfg.expert_ffn_size
    return spares * per_expert, (cfg.num_experts // config.parallel.ep + spares) * per_expert


def replica_bytes(config: RunConfig, gpus_per_node: int, nbytes: float) -> Traffic:
    """Bytes one rank sends per optimizer step for its redundant experts (nbytes: their weights on the rank): the
    owners' weights into their replicas after the step and the replicas' grads back into the owners before it, as
    much each way on average; across nodes in the share of EP peers on other nodes, unless node-limited routing
    keeps replicas on their owner's node (launch.train.build.replica_set)."""
    cfg, ep = config.model, config.parallel.ep
    node = min(gpus_per_node, ep)
    limited = cfg.topk_groups < cfg.num_groups
    inter = 0.0 if ep <= node or limited else (ep - node) / (ep - 1)
    out = Traffic()
    out.add(False, "payload", round(2 * nbytes * (1 - inter)))
    out.add(True, "payload", round(2 * nbytes * inter))
    return out


def busiest(options: Options, rows: list[int]) -> float:
    """The mean busiest-over-balanced factor of routed MoE layers `rows` (their index among
    model.num_routed_layers; 1 under forced balance or for no rows)."""
    if not options.imbalance or not rows:
        return 1.0
    return sum(options.imbalance[r] for r in rows) / len(rows)


def _check_options(config: RunConfig, options: Options) -> None:
    """Planner options that only apply to some layouts: a clear error naming the option otherwise."""
    schedule = config.parallel.schedule
    if options.virtual_stages < 1:
        raise ValueError(f"virtual stages = {options.virtual_stages} must be >= 1")
    if options.virtual_stages > 1 and schedule != "1f1b":
        raise ValueError(f"virtual stages apply to parallel.schedule = '1f1b' only (this config: {schedule!r})")
    if options.paired and options.recompute in RERUN_EXCHANGES:
        raise ValueError(f"paired 1F1B does not run with recompute {options.recompute!r}: its checkpoints rerun their "
                         "EP exchanges before their backward, which no pair overlaps")
    if options.paired and schedule not in ("1f1b", "none"):
        raise ValueError(f"paired 1F1B applies to parallel.schedule = '1f1b' or 'none' (one stage: consecutive "
                         f"micro-batches paired) only (this config: {schedule!r})")
    routed = config.model.num_routed_layers
    if options.imbalance and (len(options.imbalance) != routed or not all(f > 0 for f in options.imbalance)):
        raise ValueError(f"imbalance: {len(options.imbalance)} factors for {routed} routed MoE layers, each must be "
                         f"> 0 (the busiest EP rank's rows over the balanced share)")
    if options.linears is not None and options.linears not in PRECISIONS:
        raise ValueError(f"linear precision {options.linears!r} is not allowed; choose one of "
                         f"{', '.join(PRECISIONS)}")


def _add(bucket: dict[str, Traffic], kind: str, inter: bool, nbytes: float) -> None:
    bucket.setdefault(kind, Traffic()).add(inter, "payload", round(nbytes))


def _rank_bytes(config: RunConfig, layout: StageLayout, rank: int, held: list[int], moe_layers: list[int],
                layers: list[range], ep_layer: Traffic, act_bytes: float, grad_sync: list, itemsize: int,
                recipe: StateBytes, gpn: int, rerun: bool) -> dict[str, Traffic]:
    """Bytes one rank sends per optimizer step by purpose ("ep", "pp", "dp", "tp", "cp"), intra- and inter-node
    (ep_layer holds any rerun exchanges; rerun: each layer's TP and CP forward collectives run again in backward)."""
    par, chunks = config.parallel, config.chunks_per_step
    steps = config.train.grad_accum_steps // par.dp // chunks  # pipeline steps per optimizer step
    out = {kind: Traffic() for kind in BYTE_KINDS}
    visits = {s: sum(layout.locate(chunk, s)[0] == rank for chunk in range(chunks)) for s in held}  # DualPipe: half
    moe_calls = steps * sum(moe_layers[s] * visits[s] for s in held)
    out["ep"] = Traffic(*(v * moe_calls for v in (ep_layer.intra_payload, ep_layer.inter_payload,
                                                   ep_layer.intra_meta, ep_layer.inter_meta)))
    ranks = config.layout
    me = node_of(ranks, gpn, rank)
    for s in held:
        for chunk in range(chunks):
            if layout.locate(chunk, s)[0] != rank:
                continue
            for neighbour in (s - 1, s + 1):
                if 0 <= neighbour < layout.num_stages:
                    peer = layout.locate(chunk, neighbour)[0]
                    if peer != rank:
                        _add(out, "pp", node_of(ranks, gpn, peer) != me, steps * act_bytes)
    stage = config.optim.zero_stage
    reductions = steps * (chunks if par.pp == 1 else 1) if stage >= 2 else 1  # ZeRO-2: one per backward
    for numel, group, inter, dense in grad_sync:
        gathers = _gathers(config, layout, rank, held) if dense else 1
        _add(out, "dp", inter, reductions * ring_bytes(numel, group, 4) + gathers * ring_bytes(numel, group, recipe.param))
    if par.tp > 1:
        tp_layers = sum(len(layers[s]) * visits[s] for s in held)
        all_reduce = 2 * ring_bytes(act_bytes * par.tp / itemsize, par.tp, itemsize)
        _add(out, "tp", par.tp > gpn, (6 if rerun else 4) * tp_layers * steps * all_reduce)
    if par.cp > 1:
        cp_layers = sum(len(layers[s]) * visits[s] for s in held)
        forward, backward = cp_layer_bytes(config)
        _add(out, "cp", par.cp * par.tp > gpn, cp_layers * steps * ((2 if rerun else 1) * forward + backward))
    return out


def _gathers(config: RunConfig, layout: StageLayout, rank: int, held: list[int]) -> int:
    """All-gathers of a rank's dense params per optimizer step: one after the step (ZeRO-1/2); ZeRO-3 gathers them
    before every micro-batch's forward and backward through the rank's busiest stage instead."""
    if config.optim.zero_stage != 3:
        return 1
    chunks = config.chunks_per_step
    steps = config.train.grad_accum_steps // config.parallel.dp // chunks
    return 2 * steps * max(sum(layout.locate(chunk, s)[0] == rank for chunk in range(chunks)) for s in held)


def cp_layer_bytes(config: RunConfig) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends over its CP group for one attention layer and chunk (K/V in at
    least float32, moe.cp's compute dtype)."""
    par = config.parallel
    kv = cp_kv_width(config.model, attention_shape(config.model), par.tp) * chunk_tokens(config)
    return cp_attention_bytes(kv * max(getattr(torch, config.train.dtype).itemsize, 4), par.cp, par.cp_method)


def _stage_cost(config: RunConfig, params: ModelParams, layers: range, has_head: bool, moe_layers: int,
                ep: EPStats | None, machine: Machine, gpn: int, options: Options) -> tuple[StageCost, Work]:
    """Compute and communication seconds of one chunk through one stage, and its compute by kind of work."""
    cfg, par, train = config.model, config.parallel, config.train
    tokens = chunk_tokens(config)
    gemms, rates = machine.gemms, machine.rates()
    precisions = Precisions.of(cfg, options.linears)
    itemsize = getattr(torch, train.dtype).itemsize
    first = cfg.first_k_dense
    mtp_rows = list(range(cfg.num_moe_layers, cfg.num_routed_layers)) if has_head else []
    layers_cost = sum((layer_seconds(gemms, cfg, params.attention, i, train.seq_len, tokens, par.tp, par.ep, precisions,
                                     busiest(options, [i - first] if i >= first else []))
                       + elementwise_seconds(gemms, cfg, params.attention, i, tokens, par.tp, par.sequence_parallel,
                                             itemsize, precisions)
                       for i in layers), Work())
    cost = layers_cost
    mtp = Work()
    if has_head:
        mtp = mtp_seconds(gemms, cfg, params.attention, train.seq_len, tokens, par.tp, par.ep, par.sequence_parallel,
                          itemsize, precisions, busiest(options, mtp_rows))
        cost += head_seconds(gemms, cfg, tokens, par.tp) + mtp
    ep_f = ep_b = 0.0
    # each exchange waits on its busiest rank: the balanced bytes times its factor (launch.plan.imbalance)
    skew = busiest(options, [i - first for i in layers if i >= first] + mtp_rows)
    if ep is not None and moe_layers:
        # an FP8 dispatch moves no faster than a BF16 one: its rows cross at BF16 cost (why: docs/planner.md)
        slow = 2 / FP8_CACHED if par.dispatch_payload == "fp8" else 1.0
        dispatch, combine = ep.layer["dispatch"], ep.layer["combine"]
        backward = ep.layer["dispatch_backward"] + ep.layer["combine_backward"]
        # exchanges per hop: dispatch sends counts then rows, combine rows; backward one each way
        hops = 2 if par.dispatch_backend == "hierarchical" and 1 < ep.nodes < ep.ep else 1
        ep_f = moe_layers * (skew * rates.link_seconds(slow * dispatch.intra_node + combine.intra_node,
                                                       slow * dispatch.inter_node + combine.inter_node)
                             + 3 * hops * rates.exchange_s)
        ep_b = moe_layers * (skew * rates.link_seconds(backward.intra_node, backward.inter_node)
                             + 2 * hops * rates.exchange_s)
    tp = 0.0  # each way
    if par.tp > 1:
        ar = 2 * ring_bytes(tokens * cfg.hidden_size, par.tp, itemsize)
        tp = 2 * len(layers) * (ar / rates.inter_bps if par.tp > gpn else ar / rates.intra_bps)
    cp_f, cp_b = _cp_seconds(config, layers, machine, gpn)
    tp_b = tp
    slots = gemms.routed_slots(moe_layers * tokens / par.tp * cfg.top_k)
    recompute, rerun_slots = Work(), 0.0
    if options.recompute == "full":  # this runtime's: router, dispatch and combine (the slots' handling) not rerun
        recompute = cost.rerun() + Work.of(ROUTING, Seconds(0.0, -slots / 2, 0.0))
    elif options.recompute == "selective":
        recompute = Work.of(GEMM, Seconds(0.0, _selective_recompute(config, params, len(layers), gemms,
                                                                    precisions.dense), 0.0))
    elif options.recompute == "moe":  # Megatron-Core's: each MoE block's forward and exchanges again before its B
        recompute = moe_block_seconds(gemms, cfg, tokens, par.tp, par.ep, precisions, skew).rerun(moe_layers)
        ep_b, rerun_slots = ep_b + ep_f, slots / 2
    elif options.recompute == "layer":  # each block's whole forward again (MTP's too), exchanges and collectives
        recompute = (layers_cost + mtp).rerun()  # mtp: zero off the last stage
        ep_b, tp_b, cp_b, rerun_slots = ep_b + ep_f, 2 * tp, cp_b + cp_f, slots / 2
    work = cost + recompute
    return StageCost(work.f, work.b, work.w, ep_f + tp + cp_f, ep_b + tp_b + cp_b, slots, ep_f, ep_b,
                     rerun_slots), work


def _cp_seconds(config: RunConfig, layers: range, machine: Machine, gpn: int) -> tuple[float, float]:
    """Exposed CP seconds of one chunk through layers, forward and backward: the ring's hops each hide behind
    one of the cp blocks' attention (the core's time split evenly over them by the zig-zag layout; backward:
    two core-times a block, and the last dK/dV hop exposed); the all-gather and its reduce-scatter exposed whole."""
    par = config.parallel
    if par.cp == 1:
        return 0.0, 0.0
    rates = machine.rates()
    bps = rates.inter_bps if par.cp * par.tp > gpn else rates.intra_bps
    fwd, bwd = (b / bps for b in cp_layer_bytes(config))
    if par.cp_method == "allgather":
        return len(layers) * (fwd + rates.exchange_s), len(layers) * (bwd + rates.exchange_s)
    tokens, hops = chunk_tokens(config), par.cp - 1
    f = b = 0.0
    for i in layers:
        core = machine.gemms.attention(layer_flops(config.model, i, config.train.seq_len).core
                                       * tokens / par.tp) / par.cp  # one block's forward
        f += hops * max(0.0, fwd / hops - core)
        b += hops * max(0.0, (bwd - fwd / hops) / hops - 2 * core) + fwd / hops
    return f, b


def _selective_recompute(config: RunConfig, params: ModelParams, num_layers: int, gemms: GemmModel,
                         precision: str) -> float:
    """Seconds to recompute the MLA up-projections of a stage's layers for one chunk (norms and SwiGLU
    products are elementwise: not counted; GQA recomputes no matmul)."""
    up = params.attention.up
    if not up:
        return 0.0
    cfg = config.model
    tokens = chunk_tokens(config)
    return num_layers * gemms.gemm(tokens, up / cfg.hidden_size / config.parallel.tp, cfg.hidden_size, precision)
