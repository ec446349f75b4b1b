"""Measured figures of a config's layout: the trainer's own model, runtime and ZeRO-1 run a few optimizer
steps on gloo ranks while counters and hooks record what the plan predicts (parameters, optimizer bytes,
activations saved for backward, pipeline idle, EP and p2p bytes)."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from dispatch import Traffic, make_topology
from launch.parallel.spawn import run_processes
from launch.config.run import RunConfig
from launch.metrics.flops import model_flops_per_token
from launch.data.feed import MicroBatch
from launch.parallel.mesh import Mesh
from launch.plan.planner import Machine, Plan, chunk_tokens
from launch.plan.presets import GPU
from launch.plan.profile import profile
from launch.plan.traffic import moe_layer_traffic
from launch.parallel.device import rank_device
from launch.train.build import build_model, build_optimizer
from launch.train.step import forward_backward
from optim.memory import held_optimizer_bytes, model_state_bytes
from pipeline.memory import SavedTensorMeter


LOCAL_LINK_GBPS = 1.0  # gloo over loopback between local processes, the order of magnitude assumed


def cpu_machine(config: RunConfig, repeats: int = 15) -> Machine:
    """This machine's CPU as the plan's device: each stage's seconds profiled on the layout's ranks here
    (launch.plan.profile) for the pipeline, the FLOP/s of one rank's forward through all of them as its peak
    (for MFU), loopback links, the config's simulated nodes."""
    measured = profile(config, repeats)
    cfg, train = config.model, config.train
    flops = model_flops_per_token(cfg, train.seq_len) / 3  # a forward: a third of training's
    rate = chunk_tokens(config) / config.parallel.tp * flops / sum(s.f for s in measured.stages)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    gpu = GPU("CPU", rate / 1e12, rate / 1e12, memory, LOCAL_LINK_GBPS, LOCAL_LINK_GBPS,
              f"profiled here, {measured.ranks} ranks on {measured.cores} cores, a pipeline rank at a time, "
              f"one chunk of {train.micro_batch_size} x {train.seq_len} tokens: {measured.describe()}; "
              f"loopback ~{LOCAL_LINK_GBPS:g} GB/s assumed")
    return Machine(gpu, config.parallel.gpus_per_node or measured.ranks, gemm_efficiency=1.0, profile=measured,
                   comm_sm_share=0.0)  # the profile's pair factor holds what sharing the cores costs


@dataclass
class RankMeasure:
    """What one rank measured: bytes and memory of its last step, parameters, optimizer state bytes, the
    median pipeline idle fraction of its steps after the first (warm-up)."""

    rank: int
    pp_rank: int
    dense_params: int
    expert_params: int
    optimizer_bytes: int                   # optim.memory.held_optimizer_bytes: state and masters kept apart
    model_state_bytes: dict[str, int]      # optim.memory.model_state_bytes after the step: params, grads, optimizer
    activation_peak: int
    idle: float
    ep: dict[str, dict[str, int]]          # EPDispatcher counters summed over the rank's MoE layers, by kind
    routes: dict[int, list[Tensor]]        # router indices of each MoE layer, in call order
    p2p: dict[str, int] = field(default_factory=dict)  # pipeline payload bytes sent: intra_node, inter_node


def _count_p2p(runtime, layout, totals: dict[str, int]) -> None:
    """Wrap the runtime channel's send so the payload bytes it sends add to totals by link class."""
    channel = runtime._channel
    send, group, me = channel.send, runtime.group, dist.get_rank()

    def counted(tensors: list[Tensor], peer: int, stream: int) -> None:
        inter = layout.node(dist.get_global_rank(group, peer)) != layout.node(me)
        totals["inter_node" if inter else "intra_node"] += sum(t.nbytes for t in tensors)
        send(tensors, peer, stream)

    channel.send = counted


def _random_batches(config: RunConfig, step: int) -> list[tuple[Tensor, Tensor]]:
    """The global batch's micro-batches of random tokens (the same on every rank)."""
    train, generator = config.train, torch.Generator().manual_seed(step)
    out = []
    for _ in range(train.grad_accum_steps):
        tokens = torch.randint(0, config.model.vocab_size, (train.micro_batch_size, train.seq_len + 1),
                               generator=generator)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def measure_rank(rank: int, world: int, config: RunConfig, steps: int) -> RankMeasure:
    """Run `steps` forward-backward steps of config's global batch on this rank from the initial weights
    (the routing the plan assumes), then one optimizer step; return the figures. Every step starts at a
    barrier and ends at one (its idle fraction: 1 - time in compute actions / time from barrier to barrier,
    as the simulator counts it against the makespan); the last one records the saved tensors, the others
    the idle fraction (the first, a warm-up, left out of the median when there are more)."""
    mesh = Mesh(config.layout)
    stages, runtime = build_model(config, mesh, rank_device(config.train.device))
    optimizer = build_optimizer(stages, config, mesh)
    params = [p for stage in stages for p in stage.parameters()]
    named = [(n, p) for stage in stages for n, p in stage.named_parameters()]
    expert = sum(p.numel() for n, p in named if ".experts." in n)
    routes: dict[int, list[Tensor]] = {}
    for stage in stages:
        for i, layer in stage.moe_layers().items():
            layer.router.register_forward_hook(
                lambda _m, _a, result, i=i: routes.setdefault(i, []).append(result.indices.clone()))
    p2p = {"intra_node": 0, "inter_node": 0}
    if runtime is not None:
        _count_p2p(runtime, config.layout, p2p)
    # a split backward's weight-grad closures keep their inputs and output grads past the graph until their W
    held = (lambda: runtime.store.held_bytes) if runtime is not None else (lambda: 0)
    idle, saved = [], SavedTensorMeter(extra=held, params=params)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=False)
        for stage in stages:
            stage.reset_tallies()
        routes.clear()
        p2p.update(intra_node=0, inter_node=0)
        share = config.train.grad_accum_steps // config.parallel.dp  # this DP rank's contiguous share
        micro = [MicroBatch.of(inputs, labels) for inputs, labels
                 in _random_batches(config, step)[mesh.dp_rank * share:(mesh.dp_rank + 1) * share]]
        last = step == steps - 1  # records the saved tensors (its hooks cost time: not timed for idle)
        dist.barrier()  # every rank starts the step together
        began = time.perf_counter()
        with saved.hooks() if last else contextlib.nullcontext():
            _, busy = forward_backward(stages, runtime, micro, config.chunks_per_step,
                                       1 / config.train.grad_accum_steps)
        dist.barrier()  # the step ends when its last rank is done (the optimizer step's collectives wait for it)
        if runtime is not None and (not last or steps == 1):
            idle.append(1 - busy / (time.perf_counter() - began))
    optimizer.step()  # once, for its state bytes: the measured steps keep the initial (balanced) routing
    ep: dict[str, Traffic] = {}
    for stage in stages:
        for layer in stage.moe_layers().values():
            meter = getattr(layer.dispatcher, "meter", None)
            for kind, traffic in (meter.total.items() if meter else ()):
                ep[kind] = ep.get(kind, Traffic()) + traffic
    return RankMeasure(rank, mesh.pp_rank, sum(p.numel() for p in params) - expert, expert,
                       held_optimizer_bytes(optimizer), model_state_bytes(optimizer, params), saved.peak,
                       statistics.median(idle[1:] or idle) if idle else 0.0,
                       {k: v.as_dict() for k, v in ep.items()}, routes, dict(p2p))


def measure(config: RunConfig, steps: int = 2, timeout_s: float = 300.0) -> list[RankMeasure]:
    """Every rank's figures of config's layout (world = pp x dp x cp x tp local gloo processes)."""
    return run_processes(measure_rank, config.parallel.world_size, config, steps, timeout_s=timeout_s)


def routed_traffic(config: RunConfig, measured: list[RankMeasure]) -> list[dict[str, Traffic]]:
    """Per rank, dispatch.predict's bytes for the routings the ranks' routers actually chose (each EP
    group's calls of one layer lined up in order), summed over layers and calls: what the counters must say."""
    layout, cfg = config.layout, config.model
    dtype = getattr(torch, config.train.dtype)
    out: list[dict[str, Traffic]] = [{} for _ in measured]
    if config.parallel.ep == 1:
        return out
    topology = make_topology(config.parallel.ep, layout.ep_gpus_per_node())
    for group in layout.ep_groups():
        for layer, calls in measured[group[0]].routes.items():
            for call in range(len(calls)):
                indices = [measured[r].routes[layer][call] for r in group]
                predicted = moe_layer_traffic(indices, cfg.num_experts, topology, cfg.hidden_size,
                                              config.parallel.dispatch_backend, config.parallel.dispatch_payload,
                                              dtype, chunks=config.parallel.dispatch_chunks)
                for r, traffic in zip(group, predicted):
                    for kind, t in traffic.items():
                        out[r][kind] = out[r].get(kind, Traffic()) + t
    return out


IDLE_TOLERANCE = 0.05  # the bubble, as a share of all ranks' time: the median moves ~10% run to run here


@dataclass(frozen=True)
class MeasuredFigure:
    """One predicted figure beside its measurement; tolerance is relative (0: must be equal), or absolute (a
    difference of fractions, e.g. the pipeline's idle share)."""

    rank: int
    figure: str
    predicted: float
    measured: float
    tolerance: float | None  # None: shown for information, not checked
    absolute: bool = False

    @property
    def error(self) -> float:
        """(predicted - measured) / measured (0 when both are 0)."""
        if self.measured == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return (self.predicted - self.measured) / self.measured

    @property
    def ok(self) -> bool | None:
        """Whether the prediction is within tolerance (None when not checked)."""
        if self.tolerance is None:
            return None
        if self.absolute:
            return abs(self.predicted - self.measured) <= self.tolerance
        return self.predicted == self.measured if self.tolerance == 0 else abs(self.error) <= self.tolerance

    def describe_error(self) -> str:
        """The error as the check reads it: a difference for an absolute tolerance, else relative."""
        return f"{self.predicted - self.measured:+.3f}" if self.absolute else f"{self.error:+.1%}"

    def describe_tolerance(self) -> str:
        """The tolerance as the check applies it."""
        if self.tolerance is None:
            return "-"
        return f"±{self.tolerance:g}" if self.absolute else ("exact" if self.tolerance == 0 else f"{self.tolerance:.0%}")


def _links(traffic: dict, kinds: Iterable[str]) -> tuple[int, int]:
    """(intra-node, inter-node) bytes summed over kinds of a {kind: Traffic or its dict} map."""
    sums = [0, 0]
    for kind in kinds:
        t = traffic.get(kind)
        t = t.as_dict() if isinstance(t, Traffic) else (t or {})
        sums[0] += t.get("intra_node", 0)
        sums[1] += t.get("inter_node", 0)
    return sums[0], sums[1]


def compare(plan: Plan, measured: list[RankMeasure]) -> list[MeasuredFigure]:
    """Every rank's measured figures beside the plan's (of the same config); activations are checked on the
    busiest replica of each pipeline rank (the plan assumes balanced routing, the GPU must hold the peak); the
    pipeline's bubble over all ranks (rank -1), each rank's idle fraction shown beside it."""
    routed = routed_traffic(plan.config, measured)
    checks = []
    for m, seen in zip(measured, routed):
        r = plan.ranks[m.pp_rank]
        kinds = sorted(set(m.ep) | set(seen))
        ep_pred, ep_meas = _links(seen, kinds), _links(m.ep, kinds)
        ep_plan = (r.bytes["ep"].intra_node, r.bytes["ep"].inter_node) if r.bytes else (0, 0)
        pp_plan = (r.bytes["pp"].intra_node, r.bytes["pp"].inter_node) if r.bytes else (0, 0)
        rows = [("dense params", r.dense_params, m.dense_params, 0.01),
                ("expert params", r.expert_params, m.expert_params, 0.01),
                ("optimizer bytes", r.states.optimizer, m.optimizer_bytes, 0.01),
                ("model-state bytes", r.states.total,  # gloo's receive rows apart: a GPU's NCCL has none
                 sum(v for k, v in m.model_state_bytes.items() if k != "receive_rows"), 0.10),
                ("activation peak bytes", r.activations + r.transient, m.activation_peak, None),
                ("pipeline idle fraction", plan.idle_fractions[m.pp_rank], m.idle, None),
                ("EP bytes intra (routing seen)", ep_pred[0], ep_meas[0], 0),
                ("EP bytes inter (routing seen)", ep_pred[1], ep_meas[1], 0),
                ("EP bytes intra (plan's routing)", ep_plan[0], ep_meas[0], None),
                ("EP bytes inter (plan's routing)", ep_plan[1], ep_meas[1], None),
                ("PP p2p bytes intra", pp_plan[0], m.p2p.get("intra_node", 0), 0),
                ("PP p2p bytes inter", pp_plan[1], m.p2p.get("inter_node", 0), 0)]
        checks += [MeasuredFigure(m.rank, *row) for row in rows]
    if plan.config.parallel.pp > 1:
        checks.append(MeasuredFigure(-1, "pipeline bubble: idle share of all ranks' time", plan.idle_fraction,
                            statistics.mean(m.idle for m in measured), IDLE_TOLERANCE, absolute=True))
    for pp_rank, plan_rank in enumerate(plan.ranks):
        replicas = [m for m in measured if m.pp_rank == pp_rank]
        busiest = max(replicas, key=lambda m: m.activation_peak)
        checks.append(MeasuredFigure(busiest.rank, f"activation peak bytes, max of {len(replicas)} replicas",
                            plan_rank.activations + plan_rank.transient, busiest.activation_peak, 0.10))
    return checks
