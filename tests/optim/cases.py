"""Models, data, single-process references and spawned workers shared by the ZeroOptimizer tests."""

from __future__ import annotations

import contextlib
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from optim import ZeroOptimizer, warmup_cosine

STEPS = 10
SAVE_AT = 5
MICRO = 4
BATCH = 64
MAX_NORM = 0.05
COLLECTIVES_BY_WORLD = {2: "scatter_gather", 4: "p2p"}
COLLECTIVES = ("all_reduce", "reduce_scatter_single", "all_gather_single", "broadcast",
               "all_gather", "reduce_scatter_tensor", "all_gather_into_tensor",
               "all_to_all_single", "send", "recv", "isend", "irecv", "barrier")


def mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    """The small MLP every DP test trains (same init for a given dtype)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 8)).to(dtype)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 8, generator=g)


def groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups with their own lr and weight decay: weights, biases."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "lr": 1e-2,
             "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "lr": 2e-2,
             "weight_decay": 0.0}]


def reference(steps: int = STEPS, max_norm: float | None = MAX_NORM) -> dict[str, Any]:
    """Single-process AdamW on the whole batch, clipped to max_norm unless None: params, norms
    and state by step."""
    model = mlp()
    opt = torch.optim.AdamW(groups(model))
    norms, at_save = [], None
    for step in range(steps):
        if step == SAVE_AT:
            at_save = {"params": [p.detach().clone() for p in model.parameters()],
                       "state": [{k: v.clone() for k, v in opt.state[p].items()}
                                 for g in opt.param_groups for p in g["params"]]}
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if max_norm is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms,
            "at_save": at_save, "numel": sum(p.numel() for p in model.parameters())}


@contextmanager
def count_collectives() -> Iterator[list[str]]:
    """Record the name of every torch.distributed collective called inside the block."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def train(model: nn.Module, opt: ZeroOptimizer, steps: range, rank: int, world: int,
          dtype: torch.dtype = torch.float32, overlap: bool = False,
          max_norm: float | None = MAX_NORM) -> dict[str, Any]:
    """ZeroOptimizer data parallel with MICRO accumulation micro-batches, clipped to max_norm unless
    None (then step() reduces each bucket just before updating it); norms and comm log.

    With overlap, the last micro-batch's backward runs inside reduce_during_backward().
    At world 2, zero_grad keeps the grads bound to the zeroed flat buffer.
    backward_calls holds, per step, the collectives counted during each micro-batch.
    """
    norms, backward_calls, step_calls = [], [], []
    per_rank = BATCH // world
    for step in steps:
        x, y = batch(step)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad(set_to_none=world != 2)
        counts = []
        for m, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
            last = overlap and m == MICRO - 1
            with count_collectives() as calls, \
                    opt.reduce_during_backward() if last else contextlib.nullcontext():
                loss = nn.functional.mse_loss(model(xm.to(dtype)).float(), ym) / MICRO
                loss.backward()
            counts.append(len(calls))
        backward_calls.append(counts)
        with count_collectives() as calls:
            if max_norm is not None:
                norms.append(float(opt.clip_grad_norm_(max_norm)))
            opt.step()
        step_calls.append(len(calls))
    return {"norms": norms, "backward_calls": backward_calls, "step_calls": step_calls}


def params_of(model: nn.Module) -> list[torch.Tensor]:
    """Detached copies of a model's params."""
    return [p.detach().clone() for p in model.parameters()]


def dp_worker(rank: int, world: int, saved: dict[str, Any] | None) -> dict[str, Any]:
    """10 ZeroOptimizer steps, the unclipped and EP cases; with saved, also resume from it; more by world.

    World 2 and 4 use different collectives, so both paths are checked against the reference;
    world 4 also overlaps the last micro-batch's reduction with its backward;
    the resume, bf16 and LR cases use "auto" (p2p on gloo).
    """
    model = mlp()
    opt = ZeroOptimizer(groups(model), bucket_cap_mb=0.002, collectives=COLLECTIVES_BY_WORLD[world])
    overlap = world == 4
    out = train(model, opt, range(SAVE_AT), rank, world, overlap=overlap)
    state = opt.state_dict()
    more = train(model, opt, range(SAVE_AT, STEPS), rank, world, overlap=overlap)
    out = {k: out[k] + more[k] for k in out}
    out.update(params=params_of(model), state_bytes=opt.state_bytes(),
               buckets=len(opt._shards[0].layout.buckets), saved=state if rank == 0 else None,
               buffer_bytes=opt.buffer_bytes(), reduced_in_place=[
                   reduced.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
                   and reduced.data_ptr() == full[b.local_piece(b.rank)].data_ptr()
                   for shard in opt._shards for reduced, full, b in zip(shard.reduced, shard.grad_buckets,
                                                                          shard.layout.buckets)])
    out.update(unclipped_params=unclipped_case(rank, world), ep=ep_case(rank, world))
    if saved is not None:
        out.update(resume_case(rank, world, saved))
    if world == 2:
        out.update(bf16_case(rank, world))
        out.update(lr_scheduler_case(rank, world))
        out.update(overlap_misuse_case())
        out.update(implementation_case())
        out.update(foreign_p2p_case(rank))
    if world == 4:
        out.update(group_size_case())
    return out


def unclipped_case(rank: int, world: int) -> list[torch.Tensor]:
    """STEPS steps without clipping, so step() finishes each bucket's reduction just before
    updating it; the final params. The model gets the reference's init only after ZeroOptimizer is
    built (load_state_dict, then a no-op .to()): fp32 params are their own masters."""
    model = mlp()
    model[0].weight.data.mul_(3.0)
    opt = ZeroOptimizer(groups(model), bucket_cap_mb=0.002, collectives=COLLECTIVES_BY_WORLD[world])
    model.load_state_dict(mlp().state_dict())
    model.to(torch.float32)
    train(model, opt, range(STEPS), rank, world, overlap=True, max_norm=None)
    return params_of(model)


def foreign_p2p_case(rank: int) -> dict[str, Any]:
    """A tag-0 message on the same group, sent by rank 0 before its backward and received by
    rank 1 after its own, while ZeroOptimizer's p2p reductions are in flight; params after one step."""
    model = mlp()
    opt = ZeroOptimizer(model.parameters(), collectives="p2p")
    note = torch.full((3,), 7.0) if rank == 0 else torch.zeros(3)
    sent = dist.isend(note, dst=1) if rank == 0 else None
    with opt.reduce_during_backward():
        model(batch(0)[0][rank::2]).square().mean().backward()
    if sent is None:
        dist.recv(note, src=0)
    else:
        sent.wait()
    opt.step()
    return {"note": note, "foreign_params": params_of(model)}


def implementation_case() -> dict[str, Any]:
    """The inner AdamW's fused/foreach flags: by default, and when the caller picks foreach."""
    flags = {}
    for name, kwargs in (("default", {}), ("foreach", {"foreach": True})):
        opt = ZeroOptimizer(mlp().parameters(), **kwargs)
        flags[name] = {(o.defaults["fused"], o.defaults["foreach"])
                       for shard in opt._shards for o in shard.optims}
    return {"implementation": flags}


def resume_case(rank: int, world: int, saved: dict[str, Any]) -> dict[str, Any]:
    """Load a state saved at another world size into a fresh model and continue to STEPS."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 8))
    opt = ZeroOptimizer(groups(model), bucket_cap_mb=0.002)
    opt.load_state_dict(saved)
    resaved = opt.state_dict()
    train(model, opt, range(SAVE_AT, STEPS), rank, world)
    return {"resumed_params": params_of(model), "resaved": resaved if rank == 0 else None}


def bf16_reference(world: int, steps: int = STEPS) -> list[torch.Tensor]:
    """Single process: bf16 model, each rank's micro-batch grads summed in fp32, averaged over
    ranks, clipped AdamW on fp32 masters copied back into the bf16 model; final masters."""
    model = mlp(torch.bfloat16)
    masters = mlp()
    masters.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opt = torch.optim.AdamW(groups(masters))
    per_rank = BATCH // world
    for step in range(steps):
        x, y = batch(step)
        total = [torch.zeros_like(m) for m in masters.parameters()]
        for rank in range(world):
            rank_sum = [torch.zeros_like(m) for m in masters.parameters()]
            xr, yr = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
            for xm, ym in zip(xr.chunk(MICRO), yr.chunk(MICRO)):
                loss = nn.functional.mse_loss(model(xm.to(torch.bfloat16)).float(), ym) / MICRO
                for acc, g in zip(rank_sum, torch.autograd.grad(loss, list(model.parameters()))):
                    acc += g.float()
            total = [t + r for t, r in zip(total, rank_sum)]
        for m, t in zip(masters.parameters(), total):
            m.grad = t / world
        nn.utils.clip_grad_norm_(masters.parameters(), MAX_NORM)
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters.parameters()):
                p.copy_(m)
    return [m.detach().clone() for m in masters.parameters()]


def bf16_case(rank: int, world: int) -> dict[str, Any]:
    """bf16 model params with fp32 masters: the model ends equal to the masters cast to bf16."""
    model = mlp(torch.bfloat16)
    opt = ZeroOptimizer(groups(model))
    train(model, opt, range(STEPS), rank, world, torch.bfloat16)
    masters = [e["master"] for e in opt.state_dict()["state"].values()]
    return {"bf16_params": params_of(model), "bf16_masters": masters}


def lr_scheduler_case(rank: int, world: int) -> dict[str, Any]:
    """A torch LR scheduler drives ZeroOptimizer: the lr each step used, as seen by the inner optimizers."""
    model = mlp()
    opt = ZeroOptimizer(groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, 2, 6, 0.1))
    used = []
    for _ in range(6):
        opt.zero_grad()
        model(batch(0)[0]).square().mean().backward()
        opt.step()
        used.append([shard.optims[0].param_groups[0]["lr"] for shard in opt._shards])
        sched.step()
    return {"lr_used": used}


def overlap_misuse_case() -> dict[str, Any]:
    """A second backward inside reduce_during_backward() is refused (its buckets are in flight)."""
    model = mlp()
    opt = ZeroOptimizer(model.parameters())
    x = batch(0)[0]
    error = None
    with opt.reduce_during_backward():
        model(x).sum().backward()
        try:
            model(x).sum().backward()
        except RuntimeError as e:
            error = str(e)
    opt.step()
    return {"misuse_error": error}


EP = 2


def ep_model() -> nn.ModuleDict:
    """A dense layer shared by all ranks and EP experts, one per expert-parallel rank."""
    torch.manual_seed(1)
    return nn.ModuleDict({"dense": nn.Linear(8, 8),
                          "experts": nn.ModuleList(nn.Linear(8, 8) for _ in range(EP))})


def ep_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-local tokens of a step (all routed to the rank's own expert)."""
    g = torch.Generator().manual_seed(5000 + 10 * step + rank)
    return torch.randn(6 + rank, 8, generator=g), torch.randn(6 + rank, 8, generator=g)


def ep_loss(model: nn.ModuleDict, step: int, rank: int) -> torch.Tensor:
    """Rank-local mean loss through the dense layer and the rank's expert."""
    x, y = ep_batch(step, rank)
    h = torch.tanh(model["dense"](x))
    return nn.functional.mse_loss(model["experts"][rank % EP](h), y)


def ep_reference(world: int, steps: int) -> dict[str, Any]:
    """Single process: loss = mean over ranks of the rank-local losses, clipped AdamW."""
    model = ep_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        (sum(ep_loss(model, step, r) for r in range(world)) / world).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "norms": norms}


def ep_case(rank: int, world: int, steps: int = 5) -> dict[str, Any]:
    """Dense params sharded over all ranks, expert params over their expert-DP group (of one
    rank at world 2)."""
    ep_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(s, s + EP)) for s in range(0, world, EP)])
    edp_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(e, world, EP)) for e in range(EP)])
    return {collectives: ep_train(rank, ep_group, edp_group, world, collectives, steps)
            for collectives in ("p2p", "scatter_gather")}


def ep_train(rank: int, ep_group: Any, edp_group: Any, world: int, collectives: str,
             steps: int) -> dict[str, Any]:
    """Train the EP model with clipping; its norms and the params this rank holds."""
    model = ep_model()
    expert = model["experts"][rank % EP]
    opt = ZeroOptimizer([{"params": model["dense"].parameters()},
                 {"params": expert.parameters(), "process_group": edp_group,
                  "grad_divisor": world, "norm_groups": (ep_group,)}],
                lr=1e-2, weight_decay=0.1, collectives=collectives)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        ep_loss(model, step, rank).backward()
        norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
    return {"norms": norms, "params": {
        n: p.detach().clone() for n, p in model.named_parameters()
        if n.startswith("dense") or n.startswith(f"experts.{rank % EP}.")}}


def group_size_case() -> dict[str, Any]:
    """A process group of 3 ranks in a world of 4 is refused with a clear error."""
    group = dist.new_group([0, 1, 2])
    try:
        ZeroOptimizer(mlp().parameters(), process_group=group)
    except ValueError as e:
        return {"group_error": str(e)}
    return {"group_error": None}
