"""`moe-train --rehearse`: one rank of the config's whole layout runs one full training step in this CPU
process, as a GPU rank would, with the trainer handed the `meta` device and the `fake` process group at
the layout's full world size. Nothing but the device and the process group differs from a real run.

What it shows: every tensor of the step is created on the device the trainer was handed: a factory that
makes a tensor elsewhere, or an op that takes device tensors and leaves a tensor elsewhere (an unplanned
host copy), fails the rehearsal, named with its Python line; host bookkeeping on host values (tensors made
from Python or numpy numbers, such as AdamW's step count, and the step's one sanctioned copy to the host,
launch.parallel.device.to_host) is allowed, as on a GPU it stays on the host too. It also shows the rank's peak
memory by category
(torch's MemTracker) beside moe-plan's prediction for the same rank, and every collective it issues.

Rules where a meta tensor has no values: routing follows dispatch.rehearsal_rule's balanced rule (the planner's
assumption), and values the step copies to the host (losses, grad norm, loads) read as zeros
(launch.parallel.device.to_host), so the step takes its usual branches. Attention runs as a fused kernel would on a
GPU (FusedAttention: meta's own SDPA is the math form, which saves S x S scores). CUDA-only pieces are switched by one check,
`torch.cuda.is_available()` (streams, NCCL, Triton kernels on CUDA tensors); the rehearsal reports it.

On a real device (`moe-train --rehearse --device cuda|cpu`) the rank's stages are materialised there and run
--micro-batches micro-batches of random tokens for real, still under the fake process group: the routing is
forced to the rule's assignment (dispatch.rehearsal_rule.forcing, rule 8), and every fake collective's receive
buffers are written as if each peer had sent what this rank sends itself (rule 5: every rank routes alike), zeros
where there is no such part (a pipeline receive), so every count agrees with the rule (the step issues the meta
rehearsal's collectives, byte for byte) and every value is finite. The pipeline runs its F&B pairs on one thread,
as on meta: the dispatch modes that fill the receive buffers see one thread's ops only. The tensor-device check
is the meta rehearsal's (a real device reads the step's statistics to the host as a run does). Memory by category
is the tracker's over the first step, as on meta; warm-up steps (a GPU's first compiles and autotunes) run before
the measured step, which runs without the tracker's bookkeeping per op: its time of each phase (launch.plan.phases)
beside moe-plan's compute-only prediction and, on a GPU, torch.cuda.max_memory_allocated over it. Communication
is not measured (the fake group moves nothing): moe-plan's communication time is added to give a predicted step.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import traceback
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dispatch.progress import ACTION, listening
from dispatch.rehearsal_rule import forcing
from dispatch.topology import make_topology
from launch.config.run import RunConfig
from launch.data.feed import MicroBatch
from launch.errors import FAULT
from launch.plan.phases import OPTIMIZER, STEP_END, Phase, PhaseClock, phase_rows, planned_comm
from launch.plan.planner import Machine, Options, default_recipe, make_plan, make_schedule
from launch.plan.presets import GPUS, gpu_preset, preset_for_device
from launch.train.graphs import GraphBackend
from pipeline.schedules import min_chunks

META = torch.device("meta")
CATEGORIES = ("params", "grads", "optimizer", "activations")
SEND_BUFFERS_FROM = {"alltoall_base_": 1, "_allgather_base_": 1, "_reduce_scatter_base_": 1, "gather_": 1}  # arg 0: out
DEVICES = ("meta", "cpu", "cuda")  # where `moe-train --rehearse --device` runs the rank
MIN_MICRO_BATCHES = 4  # a real-device rehearsal's default micro-batches per rank (a full V3 step is 120)


class _NoHook:
    """The handle of a hook not registered."""

    def remove(self) -> None:
        """Nothing to remove."""


class StepMemTracker(MemTracker):
    """torch's MemTracker for a pipeline step, whose stage modules run once per micro-batch (a stage's repeated
    forward is more of the same step; MemTracker alone refuses it as a second iteration), plus what the
    step's optimizer reports of its own buffers (ZeroOptimizer.buffer_bytes, read at its step by a global hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer_buffers: dict[str, int] = {}
        self.final: dict[str, int] = {}
        self.before_step: dict[str, int] = {}
        self.paused = False  # the figures stay those of the steps before (pause: a measured step runs untracked)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if self.paused:  # a real-device rehearsal's measured step: no bookkeeping per op
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: object) -> None:
        if not self.memory_tracking:  # the step's first forward: its peak starts here, not in the build's copies
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            return  # its params, buffers and grad hooks are tracked already
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: object) -> None:
        # the device's peak only: MemTracker's per-module peaks cost a walk over every module per op
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev], self._peak_mem_snap[dev] = snap["Total"], dict(snap)

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True
                                         ) -> tuple[int, int]:
        """MemTracker's, plus the grads of buffers that take grads (the redundant experts' copies, moe.replicas):
        gradients, as their owners' are (the hooks go where MemTracker removes its own on exit)."""
        def grad_hook(grad: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        out = super()._track_module_params_and_buffers(module, install_grad_hooks)
        for buffer in module.buffers():
            if buffer.requires_grad and install_grad_hooks and buffer not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[buffer] = (
                    buffer.register_hook(grad_hook),
                    buffer.register_post_accumulate_grad_hook(lambda tensor: grad_hook(tensor.grad)))
        return out

    def _peak_by_kind(self) -> dict[str, int]:
        """The peak snapshot's bytes by MemTracker kind, summed over devices."""
        return {kind: sum(snap.get(kind, 0) for snap in self.get_tracker_snapshot("peak").values())
                for kind in ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Other")}

    def __enter__(self) -> StepMemTracker:
        # ModTracker's backward hooks (register_multi_grad_hook on every module's inputs and outputs) keep each
        # micro-batch's autograd graph alive through a cycle that runs through C++ nodes, and with it the stage
        # inputs and their grads: a growing leak a GPU run does not have. Only the device's peak is read here,
        # so backward module tracking is off.
        self._real_multi_grad_hook = mod_tracker.register_multi_grad_hook
        mod_tracker.register_multi_grad_hook = lambda *args, **kwargs: _NoHook()

        def before_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
            if hasattr(optimizer, "buffer_bytes") and not self.paused:  # forward and backward are over: their peak
                self.before_step = self._peak_by_kind()                 # is the step's

        def after_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
            if hasattr(optimizer, "buffer_bytes") and not self.paused:
                self.optimizer_buffers = optimizer.buffer_bytes()
                self.final = {kind: sum(snap.get(kind, 0) for snap in self._curr_mem_snap.values())
                              for kind in ("Optstate", "Activation", "Temp", "Other")}
        self._step_hooks = (register_optimizer_step_pre_hook(before_step), register_optimizer_step_post_hook(after_step))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        mod_tracker.register_multi_grad_hook = self._real_multi_grad_hook
        for hook in self._step_hooks:
            hook.remove()
        super().__exit__(*exc)

    def categories(self) -> dict[str, int]:
        """Bytes by category: model states as the step leaves them (params and buffers, with ZeRO-3's param shards;
        grads with ZeRO-1's fp32 sums, reduced shards and receive rows; optimizer state with its separate fp32
        masters), activations at the peak of
        forward and backward (MemTracker's activation and temporary bytes there, less the ZeRO-1 buffers it counted
        among them; the optimizer step's own temporaries, and the first step's lazily made AdamW state, which
        MemTracker counts as activations while they are made, are not activations)."""
        peak = self.before_step or self._peak_by_kind()
        extra = self.optimizer_buffers
        return {"params": peak["Parameter"] + peak["Buffer"] + extra.get("param_shards", 0),
                "grads": (peak["Gradient"] + extra.get("grad_sums", 0) + extra.get("grad_shards", 0)
                          + extra.get("scratch", 0)),
                "optimizer": self.final.get("Optstate", 0) + extra.get("masters", 0),
                "activations": peak["Activation"] + peak["Temp"] + peak["Other"] - sum(extra.values())}


class FusedAttention(TorchFunctionMode):
    """On meta, scaled_dot_product_attention decomposes into its math form, which saves an S x S score matrix
    per head; a GPU runs a fused kernel that saves the output and one logsumexp per row: FlashAttention, or
    the memory-efficient kernel when value heads are narrower than query/key heads (MLA), which flash does
    not take. This mode gives meta calls that kernel's op (with a meta kernel and autograd), so memory is a
    GPU's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].is_meta and kwargs.get("attn_mask") is None:
            q, k, v = args[:3]
            dropout, causal, scale = kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False), kwargs.get("scale")
            if v.shape[-1] != q.shape[-1]:
                return torch.ops.aten._scaled_dot_product_efficient_attention(
                    q, k, v, None, True, dropout, causal, scale=scale)[0]
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout, causal, scale=scale)[0]
        return func(*args, **kwargs)


class DeviceError(RuntimeError):
    """An op of the rehearsed step created a tensor off the device the trainer was handed."""


@dataclass
class Collectives:
    """Collectives issued by the rank: count and bytes it handed over, by (kind, group size)."""

    calls: dict[tuple[str, int], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def add(self, kind: str, group_size: int, nbytes: int) -> None:
        """Count one call of kind on a group of group_size ranks sending nbytes."""
        entry = self.calls[(kind, group_size)]
        entry[0] += 1
        entry[1] += nbytes

    def rows(self) -> list[tuple[str, int, int, int]]:
        """(kind, group size, calls, bytes), largest bytes first."""
        return sorted(((k, g, c, b) for (k, g), (c, b) in self.calls.items()), key=lambda r: (-r[3], r[0], r[1]))


def _user_line() -> str:
    """The innermost frame of this project's code on the stack (where the offending op was called)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "(no project frame)"


class RehearsalOutOfMemory(RuntimeError):
    """The rehearsed step ran out of device memory: names the op, its line and the tracker's bytes there."""

    exit_code = FAULT


def _zero(tensor: torch.Tensor) -> None:
    (tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor).zero_()  # fp8 has no fill kernel on CPU


def _copy_rows(out: torch.Tensor, src: torch.Tensor) -> None:
    """out <- src's leading rows (zeros past them)."""
    rows = min(out.shape[0], src.shape[0]) if out.dim() else 0
    if out.dim() == 0 or out.shape[1:] != src.shape[1:]:
        out.view(-1)[:src.numel()].copy_(src.reshape(-1)[:out.numel()])
        return
    out[:rows].copy_(src[:rows])
    if rows < out.shape[0]:
        _zero(out[rows:])


def loopback(name: str, args: tuple, rank: int, size: int) -> None:
    """Write a fake collective's receive buffers as if every peer sent what this rank (group rank `rank` of
    `size`) sends itself (dispatch.rehearsal_rule, rule 5), zeros where no part of the call is this rank's own (a
    pipeline receive, a scatter's non-root end); reductions in place (all-reduce, broadcast) keep their input."""
    out, inp = args[0], args[1] if len(args) > 1 else None
    if name == "alltoall_base_":
        out_splits = list(args[3]) or [out.shape[0] // size] * size
        in_splits = list(args[4]) or [inp.shape[0] // size] * size
        mine = inp.narrow(0, sum(in_splits[:rank]), in_splits[rank])
        for piece in out.split(out_splits):
            _copy_rows(piece, mine)
    elif name == "alltoall_":
        for piece in out:
            _copy_rows(piece, inp[rank])
    elif name in ("allgather_", "gather_", "allgather_coalesced_"):
        for pieces, sent in zip(out, inp):
            for piece in pieces:
                _copy_rows(piece, sent)
    elif name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
        for whole, sent in ([(out, inp)] if name == "_allgather_base_" else zip(out, inp)):
            whole.view(size, -1).copy_(sent.reshape(1, -1).expand(size, -1))
    elif name in ("reduce_scatter_", "scatter_"):
        for piece, sent in zip(out, inp or [None] * len(out)):
            _copy_rows(piece, sent[rank]) if sent else _zero(piece)
    elif name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        for piece, whole in ([(out, inp)] if name == "_reduce_scatter_base_" else zip(out, inp)):
            piece.view(-1).copy_(whole.reshape(size, -1)[rank])
    elif name in ("recv_", "recv_any_source_"):
        for piece in out:
            _zero(piece)


def _group(args: tuple) -> dist.ProcessGroup | None:
    return next((dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject)
                 and "ProcessGroup" in str(a._type())), None)


class RehearsalMode(TorchDispatchMode):
    """Records collectives. On meta: fails on any op leaving a tensor off device unless all its inputs are host
    tensors. On a real device: fills each fake collective's receive buffers (loopback), and an out-of-memory
    error names the op and the memory tracker's bytes there (tracker: the StepMemTracker running outside)."""

    def __init__(self, device: torch.device, collectives: Collectives, tracker: StepMemTracker | None = None) -> None:
        super().__init__()
        self.device, self.collectives, self.tracker = device, collectives, tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self._record(func, args)
        try:
            out = func(*args, **kwargs)
        except torch.OutOfMemoryError as error:
            raise self._out_of_memory(func, error) from None
        if not self.device.type == "meta":
            if func.namespace == "c10d" and (group := _group(args)) is not None:
                loopback(func._schema.name.split("::")[-1], args, group.rank(), group.size())
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host_work = bool(inputs) and all(t.device.type == "cpu" for t in inputs)  # bookkeeping on host values
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device != self.device and not host_work:
                raise DeviceError(f"{func} created a tensor of shape {list(tensor.shape)} on {tensor.device}, not on "
                                  f"the trainer's device {self.device}, at {_user_line()}")
        return out

    def _out_of_memory(self, func, error: torch.OutOfMemoryError) -> RehearsalOutOfMemory:
        gib = 2 ** 30
        held = ""
        if self.tracker is not None:
            now = {kind: sum(snap.get(kind, 0) for snap in self.tracker.get_tracker_snapshot().values())
                   for kind in ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other")}
            held = (f"; the memory tracker held {sum(now.values()) / gib:.2f} GiB there ("
                    + ", ".join(f"{kind} {n / gib:.2f}" for kind, n in now.items() if n) + ")")
        first = (str(error).splitlines() or [""])[0][:300]
        return RehearsalOutOfMemory(f"out of memory on {self.device} in {func} at {_user_line()}{held}: {first}")

    def _record(self, func, args: tuple) -> None:
        name = func._schema.name.split("::")[-1]
        group = _group(args)
        tensors = [t for t in tree_flatten(list(args[SEND_BUFFERS_FROM.get(name, 0):]))[0]
                   if isinstance(t, torch.Tensor)]
        self.collectives.add(name, group.size() if group is not None else 1, sum(t.nbytes for t in tensors))


@dataclass
class Rehearsal:
    """What one rehearsed step showed (the fields after `cuda`: a real-device rehearsal's)."""

    rank: int
    world_size: int
    peak: dict[str, int]        # bytes by category at the tracker's peak
    planned: dict[str, float]   # moe-plan's bytes by category for the same pipeline rank
    basis: str                  # what moe-plan planned for: activation kernels and model-state recipe
    collectives: Collectives
    cuda: bool                  # the capability check that switches CUDA-only pieces
    device: str = "meta"        # where the rank ran
    micro_batches: int = 0      # per rank in the step
    warmup_steps: int = 0       # unmeasured steps before it
    device_peak: int | None = None  # torch.cuda.max_memory_allocated over the measured step (a GPU's)
    phases: list[Phase] = field(default_factory=list)  # measured seconds of each phase beside moe-plan's
    intervals: list[tuple[str, int, float]] = field(default_factory=list)  # PhaseClock.intervals of the step
    planned_gpu: str = ""       # the preset moe-plan's times are for (launch.plan.presets.GPUS)
    planned_for: str = ""       # its words
    planned_comm: float | None = None  # moe-plan's communication seconds of this rank's actions in the step
    planned_step: float | None = None  # moe-plan's step seconds of this layout at these micro-batches

    @property
    def measured_compute(self) -> float:
        """Seconds of the measured step's phases (the MoE forward's parts are inside their F)."""
        return sum(p.seconds for p in self.phases if not p.inside)

    def to_dict(self) -> dict:
        """The report as JSON-ready data (moe-plan --measure-gpu reads it)."""
        return {"kind": "rehearsal", "rank": self.rank, "world_size": self.world_size, "device": self.device,
                "micro_batches": self.micro_batches, "warmup_steps": self.warmup_steps,
                "memory": {"measured": self.peak, "planned": self.planned, "device_peak": self.device_peak,
                           "basis": self.basis},
                "phases": [dataclasses.asdict(p) for p in self.phases], "intervals": self.intervals,
                "planned_gpu": self.planned_gpu, "planned_for": self.planned_for,
                "planned_comm_s": self.planned_comm, "planned_step_s": self.planned_step,
                "measured_compute_s": self.measured_compute,
                "collectives": [dict(zip(("kind", "group", "calls", "bytes"), r)) for r in self.collectives.rows()]}


def planned_memory(cfg: RunConfig) -> tuple[list[dict[str, float]], str]:
    """moe-plan's bytes by category for each pipeline rank (memory only; the layout's own gpus_per_node), with the
    activation kernels and model-state recipe it planned them for: the runtime's own for cfg (planner.runtime_kernels,
    planner.default_recipe)."""
    machine = Machine(gpu_preset("h800"), cfg.parallel.gpus_per_node or cfg.parallel.world_size)
    plan = make_plan(cfg, machine, Options(cfg.train.recompute), timed=False)
    basis = f"kernels {plan.options.kernels}, recipe {default_recipe(cfg).name}"
    return [{"params": r.states.params, "grads": r.states.grads, "optimizer": r.states.optimizer,
             "activations": r.activations + r.transient + r.workspace} for r in plan.ranks], basis


def rehearsal_config(cfg: RunConfig, run_dir: Path, steps: int = 1) -> RunConfig:
    """cfg for `steps` training steps with nothing written but the rehearsal's own folder (no eval, no checkpoint)."""
    train = dataclasses.replace(cfg.train, steps=steps, eval_every=0, eval_batches=0, checkpoint_every=0,
                                tensorboard=False, run_dir=str(run_dir))
    return dataclasses.replace(cfg, train=train)


def default_micro_batches(cfg: RunConfig) -> int:
    """A real-device rehearsal's micro-batches per rank: MIN_MICRO_BATCHES, or the fewest the schedule takes
    (even for DualPipe), whichever is more."""
    par = cfg.parallel
    least = 1 if par.schedule == "none" else min_chunks(par.schedule, par.pp)
    return max(MIN_MICRO_BATCHES, least + (least % 2 if par.schedule == "dualpipe" else 0))


def real_device_config(cfg: RunConfig, micro_batches: int | None) -> RunConfig:
    """cfg with micro_batches per DP rank in its step (None: default_micro_batches), all in one pipeline step;
    checked as any config."""
    count = default_micro_batches(cfg) if micro_batches is None else micro_batches
    if count < 1:
        raise ValueError(f"--micro-batches {count}: allowed >= 1")
    train = dataclasses.replace(cfg.train, grad_accum_steps=count * cfg.parallel.dp)
    return dataclasses.replace(cfg, train=train, parallel=dataclasses.replace(cfg.parallel, num_chunks=0))


class RandomFeed:
    """A DP rank's micro-batches of random tokens (seeded) on the device, the same every step: a real-device
    rehearsal reads no corpus (its routing does not depend on the tokens)."""

    def __init__(self, cfg: RunConfig, device: torch.device, seed: int = 0) -> None:
        train, gen = cfg.train, torch.Generator().manual_seed(seed)
        self.batches = []
        for _ in range(train.grad_accum_steps // cfg.parallel.dp):
            rows = torch.randint(0, cfg.model.vocab_size, (train.micro_batch_size, train.seq_len + 1), generator=gen)
            rows = rows.to(device)
            self.batches.append(MicroBatch.of(rows[:, :-1], rows[:, 1:]))

    def next_step(self) -> list[MicroBatch]:
        """This rank's micro-batches of a step."""
        return self.batches


def timing_gpu(device_name: str | None) -> tuple[str, str]:
    """(the preset moe-plan prices a real-device rehearsal's phases with, words naming it): the device's own
    preset, else the H800's, saying why."""
    gpu = preset_for_device(device_name) if device_name else None
    if gpu is not None:
        return next(key for key, known in GPUS.items() if known is gpu), gpu.name
    why = f"no preset for {device_name}" if device_name else "a CPU run: its ratios say nothing of the plan"
    return "h800", f"{GPUS['h800'].name} ({why})"


def predicted_phases(cfg: RunConfig, rank: int, intervals: list[tuple[str, int, float]], gpu: str
                     ) -> tuple[list[Phase], float, float]:
    """(the rank's measured phases beside moe-plan's compute seconds on preset gpu, moe-plan's communication
    seconds of the rank's actions, moe-plan's step seconds) for cfg as a real-device rehearsal ran it."""
    plan = make_plan(cfg, Machine(gpu_preset(gpu), cfg.parallel.gpus_per_node or cfg.parallel.world_size),
                     Options(cfg.train.recompute))
    pp_rank = cfg.layout.coords(rank)[0]
    schedule = make_schedule(cfg)
    actions = schedule.compute_actions(pp_rank) if schedule else None
    stage_of = (lambda phase: schedule.layout.stage_of(pp_rank, phase)) if schedule else (lambda phase: 0)
    micro_batches = cfg.train.grad_accum_steps // cfg.parallel.dp
    return (phase_rows(intervals, plan.stage_costs, actions, stage_of),
            planned_comm(plan.stage_costs, actions, stage_of, micro_batches), plan.step_seconds)


def rehearse(cfg: RunConfig, rank: int | None = None, device: torch.device | str = META,
             micro_batches: int | None = None, warmup_steps: int | None = None,
             graph_backend: GraphBackend | None = None) -> Rehearsal:
    """Run one training step of cfg as rank (default: the first rank of the pipeline rank moe-plan gives the
    largest peak) on `device` under the fake process group; return what it showed. On meta the config's own step
    runs; on a real device (see the module doc) micro_batches per rank (default_micro_batches), after warmup_steps
    unmeasured steps (default: 1 on a GPU, where the first step compiles and autotunes; 0 on a CPU).
    graph_backend: how train.cuda_graphs captures and replays (launch.train.loop.train's; default CUDA graphs)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from launch.train.loop import train

    device = torch.device(device)
    if device.type not in DEVICES:
        raise ValueError(f"--device {device.type}: allowed {', '.join(DEVICES)}")
    real = device.type != "meta"
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU here; allowed: meta, cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if real:
        cfg = real_device_config(cfg, micro_batches)
        warmup_steps = (1 if device.type == "cuda" else 0) if warmup_steps is None else warmup_steps
    elif micro_batches is not None or warmup_steps:
        raise ValueError("--micro-batches and warm-up steps are a real device's: give --device cpu or cuda")
    planned, basis = planned_memory(cfg)
    if rank is None:
        pp_rank = max(range(len(planned)), key=lambda p: sum(planned[p].values()))
        rank = cfg.layout.rank(pp_rank, 0, 0)
    world = cfg.parallel.world_size
    if not 0 <= rank < world:
        raise ValueError(f"--rank {rank} is outside the layout's {world} ranks (allowed: 0..{world - 1})")
    if dist.is_initialized():
        raise RuntimeError("a rehearsal needs its own fake process group: none may be initialised in this process")
    collectives, tracker, clock = Collectives(), StepMemTracker(), PhaseClock(device)
    clock.recording = not warmup_steps
    steps_done = [0]

    def before_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
        if hasattr(optimizer, "buffer_bytes"):
            clock.mark(OPTIMIZER, ACTION)

    def after_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
        if not hasattr(optimizer, "buffer_bytes"):
            return
        clock.mark(STEP_END, ACTION)
        steps_done[0] += 1
        if steps_done[0] == warmup_steps:  # the measured step starts, untracked: the categories are the first
            clock.recording = tracker.paused = True  # step's, as on meta; its time is not the tracker's bookkeeping
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

    hooks = [register_optimizer_step_pre_hook(before_step), register_optimizer_step_post_hook(after_step)]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        routing = forcing(make_topology(cfg.parallel.ep, cfg.layout.ep_gpus_per_node())) if real else nullcontext()
        with tempfile.TemporaryDirectory(prefix="moe-rehearsal-") as folder, listening(clock), routing:
            run = rehearsal_config(cfg, Path(folder), 1 + (warmup_steps or 0))
            feed = RandomFeed(run, device) if real else None
            with tracker, RehearsalMode(device, collectives, tracker), FusedAttention():
                train(run, progress=False, device=device, feed=feed, graph_backend=graph_backend)
    finally:
        for hook in hooks:
            hook.remove()
        dist.destroy_process_group()
    pp_rank = cfg.layout.coords(rank)[0]
    result = Rehearsal(rank, world, tracker.categories(), planned[pp_rank], basis, collectives,
                       torch.cuda.is_available(), device.type)
    if real:
        result.micro_batches, result.warmup_steps = cfg.train.grad_accum_steps // cfg.parallel.dp, warmup_steps
        result.device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        result.intervals = clock.intervals()
        result.planned_gpu, result.planned_for = timing_gpu(
            torch.cuda.get_device_name(device) if device.type == "cuda" else None)
        result.phases, result.planned_comm, result.planned_step = predicted_phases(
            cfg, rank, result.intervals, result.planned_gpu)
    return result


def render(result: Rehearsal) -> str:
    """The rehearsal's memory table beside moe-plan's, then (a real device's) its phases beside moe-plan's compute
    times, then its collectives."""
    gib = 2 ** 30
    if result.device == "meta":
        where = (f"on the meta device under the fake process group (CUDA available here: {result.cuda}; CUDA-only "
                 f"pieces off)")
    else:
        where = (f"on {result.device} under the fake process group: {result.micro_batches} micro-batches of random "
                 f"tokens after {result.warmup_steps} warm-up step(s), routing forced to the rehearsal rule, each "
                 f"fake collective receiving what this rank sends itself")
    lines = [f"rehearsal of rank {result.rank} of {result.world_size} {where}",
             f"moe-plan for the same pipeline rank ({result.basis})",
             f"{'memory':<12}{'rehearsal GiB':>15}{'moe-plan GiB':>15}{'ratio':>8}"]
    for cat in CATEGORIES:
        got, plan = result.peak[cat], result.planned[cat]
        ratio = f"{got / plan:.3f}" if plan else "-"
        lines.append(f"{cat:<12}{got / gib:>15.3f}{plan / gib:>15.3f}{ratio:>8}")
    total, plan = sum(result.peak.values()), sum(result.planned.values())
    lines.append(f"{'total':<12}{total / gib:>15.3f}{plan / gib:>15.3f}{total / plan:>8.3f}")
    if result.device_peak is not None:
        lines.append(f"{'allocated':<12}{result.device_peak / gib:>15.3f}{plan / gib:>15.3f}"
                     f"{result.device_peak / plan:>8.3f}   (torch.cuda.max_memory_allocated over the step)")
    if result.device != "meta":
        lines += render_phases(result)
    lines.append(f"{'collective':<24}{'group':>7}{'calls':>8}{'MiB':>12}")
    for kind, group, calls, nbytes in result.collectives.rows():
        lines.append(f"{kind:<24}{group:>7}{calls:>8}{nbytes / 2 ** 20:>12.2f}")
    return "\n".join(lines)


def render_phases(result: Rehearsal) -> list[str]:
    """The phase table and the predicted step."""
    clock = "CUDA events" if result.device == "cuda" else "the host clock (perf_counter)"
    lines = [f"phases of the step, timed by {clock}; moe-plan's compute-only seconds for the same actions on "
             f"{result.planned_for}",
             f"{'phase':<34}{'count':>6}{'measured ms':>13}{'moe-plan ms':>13}{'ratio':>11}"]
    for p in result.phases:
        plan = f"{p.planned * 1e3:>13.3f}" if p.planned is not None else f"{'-':>13}"
        ratio = f"{p.seconds / p.planned:>11.3f}" if p.planned else f"{'-':>11}"
        lines.append(f"{p.name:<34}{p.count:>6}{p.seconds * 1e3:>13.2f}{plan}{ratio}")
    compute = result.measured_compute
    lines.append(f"communication is not measured (the fake process group moves no data); moe-plan's for these "
                 f"actions: {result.planned_comm * 1e3:.2f} ms")
    lines.append(f"predicted step: measured {compute * 1e3:.2f} ms + moe-plan's communication "
                 f"{result.planned_comm * 1e3:.2f} ms = {(compute + result.planned_comm) * 1e3:.2f} ms with nothing "
                 f"overlapped; moe-plan's step for this layout: {result.planned_step * 1e3:.2f} ms")
    return lines


def write_json(result: Rehearsal, path: str | Path) -> None:
    """The report as JSON (Rehearsal.to_dict)."""
    Path(path).write_text(json.dumps(result.to_dict(), indent=1))
