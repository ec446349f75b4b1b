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
"""

from __future__ import annotations

import dataclasses
import tempfile
import traceback
from collections import defaultdict
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

from launch.config.run import RunConfig
from launch.plan.planner import Machine, Options, default_recipe, make_plan
from launch.plan.presets import gpu_preset

META = torch.device("meta")
CATEGORIES = ("params", "grads", "optimizer", "activations")
SEND_BUFFERS_FROM = {"alltoall_base_": 1, "_allgather_base_": 1, "_reduce_scatter_base_": 1, "gather_": 1}  # arg 0: out


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
            if hasattr(optimizer, "buffer_bytes"):  # forward and backward are over: their peak is the step's
                self.before_step = self._peak_by_kind()

        def after_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
            if hasattr(optimizer, "buffer_bytes"):
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


class RehearsalMode(TorchDispatchMode):
    """Fails on any op leaving a tensor off device unless all its inputs are host tensors; records collectives."""

    def __init__(self, device: torch.device, collectives: Collectives) -> None:
        super().__init__()
        self.device, self.collectives = device, collectives

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self._record(func, args)
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host_work = bool(inputs) and all(t.device.type == "cpu" for t in inputs)  # bookkeeping on host values
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device != self.device and not host_work:
                raise DeviceError(f"{func} created a tensor of shape {list(tensor.shape)} on {tensor.device}, not on "
                                  f"the trainer's device {self.device}, at {_user_line()}")
        return out

    def _record(self, func, args: tuple) -> None:
        name = func._schema.name.split("::")[-1]
        group = next((dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject)
                      and "ProcessGroup" in str(a._type())), None)
        tensors = [t for t in tree_flatten(list(args[SEND_BUFFERS_FROM.get(name, 0):]))[0]
                   if isinstance(t, torch.Tensor)]
        self.collectives.add(name, group.size() if group is not None else 1, sum(t.nbytes for t in tensors))


@dataclass
class Rehearsal:
    """What one rehearsed step showed."""

    rank: int
    world_size: int
    peak: dict[str, int]        # bytes by category at the tracker's peak
    planned: dict[str, float]   # moe-plan's bytes by category for the same pipeline rank
    basis: str                  # what moe-plan planned for: activation kernels and model-state recipe
    collectives: Collectives
    cuda: bool                  # the capability check that switches CUDA-only pieces


def planned_memory(cfg: RunConfig) -> tuple[list[dict[str, float]], str]:
    """moe-plan's bytes by category for each pipeline rank (memory only; the layout's own gpus_per_node), with the
    activation kernels and model-state recipe it planned them for: the runtime's own for cfg (planner.runtime_kernels,
    planner.default_recipe)."""
    machine = Machine(gpu_preset("h800"), cfg.parallel.gpus_per_node or cfg.parallel.world_size)
    plan = make_plan(cfg, machine, Options(cfg.train.recompute), timed=False)
    basis = f"kernels {plan.options.kernels}, recipe {default_recipe(cfg).name}"
    return [{"params": r.states.params, "grads": r.states.grads, "optimizer": r.states.optimizer,
             "activations": r.activations + r.transient + r.workspace} for r in plan.ranks], basis


def rehearsal_config(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """cfg for one training step with nothing written but the rehearsal's own folder (no eval, no checkpoint)."""
    train = dataclasses.replace(cfg.train, steps=1, eval_every=0, eval_batches=0, checkpoint_every=0,
                                tensorboard=False, run_dir=str(run_dir))
    return dataclasses.replace(cfg, train=train)


def rehearse(cfg: RunConfig, rank: int | None = None) -> Rehearsal:
    """Run one training step of cfg as rank (default: the first rank of the pipeline rank moe-plan gives the
    largest peak) on the meta device under the fake process group; return what it showed."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from launch.train.loop import train

    planned, basis = planned_memory(cfg)
    if rank is None:
        pp_rank = max(range(len(planned)), key=lambda p: sum(planned[p].values()))
        rank = cfg.layout.rank(pp_rank, 0, 0)
    world = cfg.parallel.world_size
    if not 0 <= rank < world:
        raise ValueError(f"--rank {rank} is outside the layout's {world} ranks (allowed: 0..{world - 1})")
    if dist.is_initialized():
        raise RuntimeError("a rehearsal needs its own fake process group: none may be initialised in this process")
    collectives = Collectives()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with tempfile.TemporaryDirectory(prefix="moe-rehearsal-") as folder:
            tracker = StepMemTracker()
            with tracker, RehearsalMode(META, collectives), FusedAttention():
                train(rehearsal_config(cfg, Path(folder)), progress=False, device=META)
    finally:
        dist.destroy_process_group()
    peak = tracker.categories()
    pp_rank = cfg.layout.coords(rank)[0]
    return Rehearsal(rank, world, peak, planned[pp_rank], basis, collectives, torch.cuda.is_available())


def render(result: Rehearsal) -> str:
    """The rehearsal's memory table beside moe-plan's, then its collectives."""
    gib = 2 ** 30
    lines = [f"rehearsal of rank {result.rank} of {result.world_size} on the meta device under the fake process group "
             f"(CUDA available here: {result.cuda}; CUDA-only pieces off)",
             f"moe-plan for the same pipeline rank ({result.basis})",
             f"{'memory':<12}{'rehearsal GiB':>15}{'moe-plan GiB':>15}{'ratio':>8}"]
    for cat in CATEGORIES:
        got, plan = result.peak[cat], result.planned[cat]
        ratio = f"{got / plan:.3f}" if plan else "-"
        lines.append(f"{cat:<12}{got / gib:>15.3f}{plan / gib:>15.3f}{ratio:>8}")
    total, plan = sum(result.peak.values()), sum(result.planned.values())
    lines.append(f"{'total':<12}{total / gib:>15.3f}{plan / gib:>15.3f}{total / plan:>8.3f}")
    lines.append(f"{'collective':<24}{'group':>7}{'calls':>8}{'MiB':>12}")
    for kind, group, calls, nbytes in result.collectives.rows():
        lines.append(f"{kind:<24}{group:>7}{calls:>8}{nbytes / 2 ** 20:>12.2f}")
    return "\n".join(lines)
