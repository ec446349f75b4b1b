"""ZeRO-1: fp32 master params and optimizer state sharded over each param group's process group."""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence, get_args

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from optim.ema import HostEMA
from optim.grad_norm import global_sq_norm
from optim.shard import MASTER_KEY, Piece, ShardedParams
from optim.zero3 import Unit

LAYOUT_KEYS = ("process_group", "norm_groups", "grad_divisor", "norm_weight", "overlap", "module")
COLLECTIVES = ("auto", "scatter_gather", "p2p")
ZeroStage = Literal[1, 2, 3]  # what is sharded: optimizer state; also grads; also params
STAGES = get_args(ZeroStage)
MomentDtype = Literal["float32", "bfloat16"]  # what a trainer may store AdamW's moments in (state_dtype)
FUSED_BY_DEFAULT = (torch.optim.Adam, torch.optim.AdamW)
IMPLEMENTATION_KEYS = ("fused", "foreach", "differentiable")


def _param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Validate the params argument (tensors or dicts) into a list of group dicts."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of Tensors or dicts, got a single Tensor")
    groups = list(params)
    if not groups:
        raise ValueError("params is empty: ZeroOptimizer needs at least one parameter")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen: dict[int, int] = {}
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"param group {i} must be a dict with a 'params' entry")
        group = dict(group)
        group["params"] = ([group["params"]] if isinstance(group["params"], torch.Tensor)
                           else list(group["params"]))
        if not group["params"]:
            raise ValueError(f"param group {i} is empty: every group needs at least one parameter")
        for p in group["params"]:
            if not isinstance(p, torch.Tensor) or not p.is_floating_point() or not p.requires_grad:
                raise ValueError(f"param group {i}: every param must be a floating-point tensor "
                                 f"with requires_grad=True (pass only trainable params)")
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is in param group "
                                 f"{seen[id(p)]} and again in group {i}: each param must be in "
                                 f"exactly one group")
            seen[id(p)] = i
        dtypes = {p.dtype for p in group["params"]}
        if len(dtypes) > 1:
            raise ValueError(f"param group {i} mixes dtypes {sorted(map(str, dtypes))}: "
                             f"put params of each dtype in their own group")
        out.append(group)
    return out


def _inner_defaults(optimizer_class: type[torch.optim.Optimizer], defaults: dict[str, Any],
                    device: torch.device) -> dict[str, Any]:
    """defaults plus fused=True for torch's Adam/AdamW on CPU/CUDA unless the caller picked an
    implementation (the fused kernel is the faster on a flat fp32 shard: docs/parallelism.md, ZeRO)."""
    if (optimizer_class in FUSED_BY_DEFAULT and device.type in ("cpu", "cuda")
            and not any(k in defaults for k in IMPLEMENTATION_KEYS)):
        return {**defaults, "fused": True}
    return defaults


def _check_group(i: int, group: dict[str, Any]) -> None:
    """Check that a group's process group can shard it: this rank is in it, its size divides the world."""
    pg = group["process_group"]
    world = dist.get_world_size()
    size = dist.get_world_size(pg) if dist.get_rank(pg) >= 0 else -1
    if size < 1:
        raise ValueError(f"param group {i}: this rank ({dist.get_rank()}) is not a member of "
                         f"its process_group")
    if world % size:
        raise ValueError(f"param group {i}: process_group size {size} does not divide the world "
                         f"size {world}; allowed sizes are the divisors of {world}")
    divisor = group.setdefault("grad_divisor", size)
    if not divisor > 0:
        raise ValueError(f"param group {i}: grad_divisor must be > 0, got {divisor}")


class ZeroOptimizer(torch.optim.Optimizer):
    """Any torch optimizer with fp32 master params and state sharded evenly over process groups.

    Call shape of torch.distributed.optim.ZeroRedundancyOptimizer; one optimizer_class instance
    per bucket, built with **defaults and the group's hyper-parameters (torch's Adam and AdamW
    default to fused=True unless fused, foreach or differentiable is given). Model grads are the
    local, un-averaged sums over micro-batches (no DDP wrapper; non-fp32 grads are summed in
    fp32 inside ZeroOptimizer) and nothing is communicated during backward unless the last one runs
    inside reduce_during_backward(), which overlaps the reduction with it. step() (or
    reduce_gradients()) reduce-scatters the sums in fp32 in place (each rank's reduced grads are its own pieces of
    the full fp32 buffer: no separate reduced copy), divided by each group's grad_divisor
    (default: its process-group size), updates the local shard and all-gathers the new params
    into the model. Param-group keys besides the optimizer's hyper-parameters: process_group
    (shard group, e.g. expert-data-parallel for experts), norm_groups (extra groups the grad
    norm is summed over, e.g. expert-parallel, pipeline), grad_divisor, norm_weight (factor on the
    group's squared grad norm, e.g. 1/tp for params held whole on every TP rank), overlap (default
    True; False: the group is reduced only after the backward, e.g. grads still to be summed over
    TP, even inside reduce_during_backward). bucket_cap_mb caps one
    collective's fp32 bucket; collectives picks the primitives (see ShardedParams; "auto"
    chooses by backend).

    stage=2 (ZeRO-2) also shards the grads: every backward run inside reduce_during_backward() (each
    micro-batch's, or each pipeline step's) reduce-scatters its buckets as they are ready into the fp32
    grad shards, which sum them, and each bucket's full buffer is freed once its reduction is done (it
    comes back, zeroed, with the bucket's next grad). The full grads live only from a bucket's first grad
    of one backward to its reduction, at the cost of one reduce-scatter per backward instead of per step.
    stage=3 (ZeRO-3) also shards the params of every group given a "module" key (a layout key: the module the
    params belong to; groups without one run as ZeRO-2): they are freed, all-gathered from the masters before
    each forward and backward of their module and freed after (optim.zero3), and step() gathers nothing.
    offload=host device ("cpu"; ZeRO-Offload, stage 1 or 2): the fp32 masters and the inner optimizers' state
    live there and the update runs there; step() copies each bucket's reduced grad shard to the host and its updated
    masters back (see ShardedParams.step).
    state_dtype (e.g. torch.bfloat16, DeepSeek-V3's AdamW moments; None: the masters' dtype) stores every elementwise
    entry of the inner optimizers' state (AdamW's exp_avg, exp_avg_sq) in that dtype, on the device or offloaded;
    each step widens them to the masters' dtype, updates them there and rounds them once (ShardedParams._widen, _narrow).
    ema_decay > 0 keeps an exponential moving average of this rank's masters on ema_host (host memory; optim.ema), updated
    in the background after each step; pieces() hand it out beside the masters (checkpointed and resharded as they are).
    """

    def __init__(self, params: Iterable[Any],
                 optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 process_group: ProcessGroup | None = None, *, bucket_cap_mb: float = 25.0,
                 norm_groups: Sequence[ProcessGroup] = (), collectives: str = "auto",
                 stage: int = 1, offload: torch.device | str | None = None, state_dtype: torch.dtype | None = None,
                 ema_decay: float = 0.0, ema_host: torch.device | str = "cpu", **defaults: Any) -> None:
        groups = _param_groups(params)
        if state_dtype is not None and not (isinstance(state_dtype, torch.dtype) and state_dtype.is_floating_point):
            raise ValueError(f"state_dtype must be a floating-point torch.dtype (or None: the masters' dtype), "
                             f"got {state_dtype!r}")
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        if offload is not None and stage == 3:
            raise ValueError("offload keeps the masters in host memory, which ZeRO-3 gathers from on the device: "
                             "allowed with offload: stage 1 or 2")
        self.stage = stage
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, "
                            f"got {optimizer_class!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if not dist.is_initialized():
            raise RuntimeError("ZeroOptimizer needs torch.distributed initialised (init_process_group)")
        for i, group in enumerate(groups):
            if "module" in group and stage != 3:
                raise ValueError(f"param group {i} names a module (ZeRO-3 gathers its params around it): "
                                 f"needs stage=3, got stage={stage}")
            group.setdefault("process_group", process_group)
            group["norm_groups"] = tuple(group.get("norm_groups", norm_groups))
            group.setdefault("norm_weight", 1.0)
            group.setdefault("overlap", True)
            _check_group(i, group)
        bucket_cap = max(1, int(bucket_cap_mb * 2**20) // 4)
        self._shards = [ShardedParams(g["params"], g["process_group"], bucket_cap,
                                      g["grad_divisor"], collectives, stage >= 2, "module" in g,
                                      None if offload is None else torch.device(offload), state_dtype) for g in groups]
        self.ema: HostEMA | None = None
        if ema_decay:
            self.ema = HostEMA([m for shard in self._shards for m in shard.masters], ema_decay, torch.device(ema_host))
            first = 0
            for shard in self._shards:
                shard.ema_values = self.ema.values[first:first + len(shard.masters)]
                first += len(shard.masters)
        self._unit_order: list[Unit] = []
        by_module: dict[int, tuple[torch.nn.Module, list[ShardedParams]]] = {}
        for group, shard in zip(groups, self._shards):
            if "module" in group:
                by_module.setdefault(id(group["module"]), (group["module"], []))[1].append(shard)
        self._units = [Unit(module, shards, self._unit_order) for module, shards in by_module.values()]
        for group, shard in zip(groups, self._shards):
            shard.build_optimizers(optimizer_class, _hyper(group),
                                   _inner_defaults(optimizer_class, defaults, shard.masters[0].device))
            group.update(_hyper(shard.optims[0].param_groups[0]))
        # one launch order for every bucket of every group (overlapped groups first, last bucket first): the
        # same on every rank, since collectives on a process group must start in the same order everywhere
        self._order = sorted(((s, b) for s in range(len(groups)) for b in range(len(self._shards[s].layout.buckets))),
                             key=lambda sb: (not groups[sb[0]]["overlap"], -sb[0], -sb[1]))
        self._final: Callable[[torch.Tensor], bool] | None = None  # armed: is a param's grad just in its last?
        self._ready: list[list[set[int]]] = []  # per group and bucket: indices of params whose grad is final
        self._next = 0  # position in _order of the next bucket to launch
        for s, shard in enumerate(self._shards):
            shard.listener = functools.partial(self._grad_in, s)
        self._reset()
        self._reduced = False
        super().__init__(groups, dict(self._shards[0].optims[0].defaults))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only allowed during construction: the flat layout is fixed once built."""
        if len(self.param_groups) >= len(self._shards):
            raise NotImplementedError("ZeroOptimizer cannot add param groups after construction; "
                                      "build a new ZeroOptimizer with all groups")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers (fp32 params keep .grad bound to them)."""
        for shard in self._shards:
            shard.zero_grad(set_to_none)
        self.release_params()
        self._reset()
        self._reduced = False

    def release_params(self) -> None:
        """ZeRO-3: free every module's gathered params (the next forward gathers them from the masters)."""
        for unit in self._units:
            unit.release()

    def _reset(self) -> None:
        """No bucket launched, none ready, not armed."""
        self._final, self._next = None, 0
        self._ready = [[set() for _ in shard.layout.buckets] for shard in self._shards]

    @contextlib.contextmanager
    def reduce_during_backward(self, final: Callable[[torch.Tensor], bool] | None = None) -> Iterator[None]:
        """Wrap the last backward(s) of a step: a bucket's reduction starts as soon as every param in it has its
        final grad. final(param), asked from param's post-accumulate-grad hook, says whether the grad just
        accumulated is param's last this step (default: every grad is, for one last backward; a pipeline
        runtime's last_grad for deferred weight grads). Buckets start in one fixed order, the same on every
        rank, so a bucket also waits for those before it; the rest start in reduce_gradients() or step().
        ZeRO-2 wraps every backward: the previous one's reductions are finished on entry (their full buffers
        freed) and the buckets still waiting start on exit."""
        if self.stage >= 2:
            self._finish_all()
        self._reset()
        self._final = final or (lambda param: True)
        yield
        if self.stage >= 2:
            self._launch(flush=True)

    def _finish_all(self) -> None:
        """Wait for every bucket reduction started (each group's shard now holds its sums)."""
        for shard in self._shards:
            shard.finish_reduce()

    def _grad_in(self, s: int, i: int) -> None:
        """Group s's param i got a grad: when armed and it is final, start the buckets now complete."""
        if self._final is None or not self.param_groups[s]["overlap"]:
            return
        shard = self._shards[s]
        if self._final(shard.params[i]):
            self._ready[s][shard.layout.bucket_of[i]].add(i)
            self._launch(flush=False)
        if self.stage >= 2:  # free the full buffers of reductions already done, while the backward goes on
            for other in self._shards:
                other.finish_completed()

    def _launch(self, flush: bool) -> None:
        """Start bucket reductions in the fixed order while they are ready (flush: all the rest)."""
        while self._next < len(self._order):
            s, b = self._order[self._next]
            shard = self._shards[s]
            if not (flush or len(self._ready[s][b]) == len(shard.bucket_params[b])):
                return
            shard.launch(b)
            self._next += 1

    def local_grads(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The local (not yet reduced) grad sums of params as ZeRO-1 holds them: views of its flat fp32 buffers,
        whatever the params' dtype (a bf16 param's grad is moved there as it arrives and its .grad dropped)."""
        where = {id(p): (shard, i) for shard in self._shards for i, p in enumerate(shard.params)}
        return [where[id(p)][0].local_grad(where[id(p)][1]) for p in params]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the accumulated local grads into the fp32 shards (once per step)."""
        if not self._reduced:
            self._launch(flush=True)
            self._finish_all()
            self._reset()
            self._reduced = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, group: ProcessGroup | None = None) -> torch.Tensor:
        """Scale the reduced grad shards so their global L2 norm is <= max_norm; return the norm.

        The norm covers every shard of every group, summed over each group's process_group and
        norm_groups, so each parameter counts once. With `group`, all shards' squares are summed
        over that one group instead: right when every element lies in exactly one shard across it
        (each param group sharded over all ranks holding copies of its params, as the trainer does).
        Clip factor as torch.nn.utils.clip_grad_norm_.
        """
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self.reduce_gradients()
        if group is not None:
            parts = [(sum(s.sq_norm() * g["norm_weight"] for s, g in zip(self._shards, self.param_groups)), (group,))]
        else:
            parts = [(s.sq_norm() * g["norm_weight"], (g["process_group"], *g["norm_groups"]))
                     for s, g in zip(self._shards, self.param_groups)]
        norm = global_sq_norm(parts).sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # on the device: no host sync (x 1.0 is exact)
        for shard in self._shards:
            shard.scale_grads(coef)
        return norm

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Reduce grads (if not yet), update the local shards, all-gather params into the model.

        Without a prior reduce_gradients() (no clipping), each bucket is updated and gathered
        as soon as its own reduction is done, while the others are still in flight.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._reduced:
            self._launch(flush=True)
        self._ema_wait()  # the previous step's average may still be reading host masters
        for group, shard in zip(self.param_groups, self._shards):
            shard.step(_hyper(group))
        if self.ema is not None:
            self.ema.update()
        self.release_params()
        self._reset()
        self._reduced = False
        return loss

    def _ema_wait(self) -> None:
        """Finish the weight EMA's update in flight, if any (before the masters or the EMA are written or read)."""
        if self.ema is not None:
            self.ema.wait()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the optimizer: fp32 master shards and each state entry.

        The master shards of fp32 params are counted although they are the model's own memory.
        """
        out = {MASTER_KEY: sum(m.numel() * m.element_size() for s in self._shards
                               for m in s.masters)}
        for _, state in (cs for s in self._shards for cs in s.chunk_states()):
            for key, value in state.items():
                if torch.is_tensor(value):
                    out[key] = out.get(key, 0) + value.numel() * value.element_size()
        out["total"] = sum(out.values())
        return out

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of this rank's ZeRO-1 buffers besides the params, their .grad and the inner optimizers' state:
        the full fp32 grad sums of params whose .grad is not bound to them (bf16 params), ZeRO-2's grad shards (ZeRO-1
        reduces in place: its reduced grads are its own pieces of the full sums, no separate copy), fp32 master shards held apart from the params (bf16 params), masters of the params' dtype held apart
        from them (param_shards: ZeRO-3, offload), the p2p receive scratch, the host copies of the reduced grad
        shards (offload), the weight EMA's host buffers (host_ema: never on the device)."""
        return {"grad_sums": sum(g.untyped_storage().nbytes() for s in self._shards if not s.binds_grads
                                 for g in s.grad_buckets),
                "grad_shards": sum(s.grad.nbytes for s in self._shards if s.shard_grads),
                "masters": sum(m.nbytes for s in self._shards for m in s.masters if m.dtype != s.param_flat.dtype),
                "param_shards": sum(m.nbytes for s in self._shards for m in s.masters
                                    if (s.shard_params or s.host is not None) and m.dtype == s.param_flat.dtype),
                "host_grads": sum(s.host_grad.nbytes for s in self._shards if s.host is not None),
                "scratch": sum(s._scratch.nbytes for s in self._shards),
                "host_ema": 0 if self.ema is None else self.ema.nbytes()}

    def pieces(self) -> list[Piece]:
        """This rank's pieces of every param: the runs of its flattened elements the local shards hold, each with
        views of its master and optimizer state (no copy, no collective). A checkpoint writes and reads these
        directly; every element of a param lies in exactly one piece across the param group's process group. With a
        weight EMA, its update in flight is finished first (the pieces hold views of it)."""
        self._ema_wait()
        return [piece for shard in self._shards for piece in shard.pieces()]

    def reset_state(self, elementwise: Sequence[str], scalars: dict[str, torch.Tensor]) -> None:
        """Replace the inner optimizers' state by zeros for the elementwise entries and copies of scalars, so
        pieces() has views a checkpoint can be read into (nothing given: the state of a fresh optimizer)."""
        self._ema_wait()
        for shard in self._shards:
            shard.reset_state(elementwise, scalars)
        self._reduced = False

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather the masters into the model params (a collective over every group's process group), after
        the masters were written through pieces(); ZeRO-3 frees its params instead, gathered where used)."""
        self.release_params()
        for shard in self._shards:
            shard.gather_params()

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """Full (unsharded) state keyed by param index; a collective over every group's process group.

        Each entry holds the fp32 master param and the optimizer's state, shaped like the param,
        so the dict loads at any world size. Every rank gets the same dict; save it on one.
        """
        state: dict[int, dict[str, Any]] = {}
        elementwise = []
        for shard in self._shards:
            inner, scalars = shard.get_state()
            full = {k: shard.layout.views(shard.gather_full(v)) for k, v in inner.items()}
            full[MASTER_KEY] = shard.layout.views(shard.gather_full(torch.cat(shard.masters)))
            for j in range(len(shard.params)):
                entry = {k: views[j].clone() for k, views in full.items()}
                entry.update(copy.deepcopy(scalars))
                state[len(state)] = entry
            elementwise.append(sorted(inner))
        groups, first = [], 0
        for group in self.param_groups:
            groups.append({**_hyper(group), "params": list(range(first, first + len(group["params"])))})
            first += len(group["params"])
        return {"state": state, "param_groups": groups, "elementwise_keys": elementwise}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict() saved at any world size: re-slice this rank's shards, set the model params."""
        self._ema_wait()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer "
                             f"has {len(self.param_groups)}")
        for i, (saved, shard) in enumerate(zip(saved_groups, self._shards)):
            entries = [state_dict["state"][k] for k in saved["params"]]
            shapes = [e[MASTER_KEY].shape for e in entries]
            if shapes != [p.shape for p in shard.params]:
                raise ValueError(f"param group {i}: saved param shapes {shapes} do not match "
                                 f"the model's {[p.shape for p in shard.params]}")
            self._load_group(shard, entries, state_dict["elementwise_keys"][i])
            self.param_groups[i].update({k: v for k, v in saved.items() if k != "params"})
        self.release_params()  # ZeRO-3: the next forward gathers the loaded masters
        if self.ema is not None:  # a state_dict holds no EMA: it restarts from the loaded masters
            self.ema.reset()
        self._reduced = False

    def _load_group(self, shard: ShardedParams, entries: list[dict[str, Any]],
                    keys: list[str]) -> None:
        """Set one group's master shard, model params and optimizer state from full per-param entries."""
        layout = shard.layout
        shard.set_params(layout.flatten([e[MASTER_KEY] for e in entries], shard.master_dtype))
        elementwise = {k: layout.shard_of(layout.flatten([e[k] for e in entries],
                                                         entries[0][k].dtype)) for k in keys}
        scalars = {k: v for k, v in entries[0].items() if k != MASTER_KEY and k not in keys}
        converted = sorted(k for k, v in elementwise.items() if v.dtype != shard.state_dtype)
        if converted:
            warnings.warn(f"state_dict holds {', '.join(converted)} in {elementwise[converted[0]].dtype}, this "
                          f"optimizer keeps them in {shard.state_dtype} (state_dtype): converted on load", stacklevel=3)
        shard.set_state(elementwise, scalars)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's optimizer hyper-parameters (no params, no layout keys)."""
    return {k: v for k, v in group.items() if k != "params" and k not in LAYOUT_KEYS}
