"""`moe-bench tp`: our tensor parallelism without SP and with SP against torch DTensor TP + SequenceParallel.

All three run the same stack of dense transformer blocks (RMSNorm, GQA attention with RoPE,
SwiGLU), built from the same single-process weights, in the same gloo processes (one thread
each), in rounds of one step each (launch.bench.harness) so load changes on a shared machine hit all alike. The peer is
torch.distributed.tensor.parallel over a 1-D DeviceMesh (ColwiseParallel fused q/k/v and gate/up,
RowwiseParallel out/down with Shard(1) outputs, SequenceParallel norms, PrepareModuleInput
gathers). Both sides fuse alike: one q/k/v Linear and one gate/up Linear per block (the peer's rows ordered rank by
rank so torch's contiguous column split gives each rank its own heads' q, k, v and its gate and up). A step is
the forward and backward of the stack for one batch (no optimizer). Per contender and rank:
- step_ms: median over rounds of the slowest rank's step, with its spread; x peer taken round by round;
- act_bytes: peak bytes saved for backward by one forward, parameters left out (pipeline.memory.SavedTensorMeter,
  the project's one meter; DTensors counted by their local shard), and norm_bytes, the part saved inside the norms
  (the sequence-parallel region: residual adds save nothing);
- comm_bytes: bytes this rank sends per step in torch functional collectives, counted on the
  collectives issued (ring model: all-gather (g-1) x input, reduce-scatter and all-to-all
  (g-1)/g x input, all-reduce 2(g-1)/g x input). Partial grads of replicated params (norms)
  are summed by the optimizer's grad sync, outside the step, for all three alike.
The outputs of the three are checked against the single-process stack (exit 1 if they differ).
"""

from __future__ import annotations

import argparse
import copy
import time
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.utils._python_dispatch import TorchDispatchMode

from launch.bench.harness import fields, ratio_fields, require_positive, round_options, rounds, slowest
from launch.bench.progress import BenchProgress, run_ranks
from launch.bench.report import LOWER, header, header_line, table, write_json
from moe.config import ModelConfig
from moe.model import Block, apply_rope, rope_tables
from moe.tp import gather_sequence, parallelize_block
from pipeline.memory import SavedTensorMeter

OURS, OURS_SP, PEER = "ours TP", "ours TP+SP", "torch DTensor TP+SP"
CONTENDERS = (OURS, OURS_SP, PEER)


class CommMeter(TorchDispatchMode):
    """Bytes this rank sends in torch functional collectives while active (ring model per collective)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if func.namespace == "_c10d_functional":
            self._count(func.__name__.split(".")[0], args)
        return func(*args, **(kwargs or {}))

    def _count(self, name: str, args: tuple) -> None:
        if name not in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
            return
        size = _resolve_process_group(args[-1]).size()
        nbytes = args[0].numel() * args[0].element_size()
        share = {"all_reduce": 2 * (size - 1) / size, "all_gather_into_tensor": size - 1}.get(name, (size - 1) / size)
        self.bytes += round(nbytes * share)
        self.calls[name] = self.calls.get(name, 0) + 1


class PeerAttention(nn.Module):
    """Our attention's math, its q/k/v fused in one Linear as ours: rows ordered rank by rank ([q_r | k_r | v_r]),
    so ColwiseParallel's contiguous row split gives each TP rank the q, k and v of its own heads."""

    def __init__(self, attn: nn.Module, tp: int) -> None:
        super().__init__()
        self.head_dim, q, kv = attn.head_dim, attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        self.widths = [q // tp, kv // tp, kv // tp]  # this rank's q, k, v columns of the fused output
        self.wqkv = _linear_from(_rank_major(attn.qkv.weight, [q, kv, kv], tp))
        self.wo = _linear_from(attn.out.weight)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, S, H] (local tensor) -> this rank's partial output."""
        batch, seq, _ = x.shape
        q, k, v = (t.reshape(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for t in self.wqkv(x).split(self.widths, dim=-1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(attn.transpose(1, 2).reshape(batch, seq, -1))


class PeerFFN(nn.Module):
    """Our SwiGLU, gate and up fused in one Linear as ours, rows ordered rank by rank ([gate_r | up_r])."""

    def __init__(self, mlp: nn.Module, tp: int) -> None:
        super().__init__()
        ffn = mlp.gate_up.weight.shape[0] // 2
        self.w_gate_up = _linear_from(_rank_major(mlp.gate_up.weight, [ffn, ffn], tp))
        self.w_down = _linear_from(mlp.down.weight)

    def forward(self, x: Tensor) -> Tensor:
        """x [..., H] -> [..., H]."""
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


def _rank_major(weight: Tensor, parts: list[int], tp: int) -> Tensor:
    """A fused weight's rows [part 0 | part 1 | ...] reordered to [rank 0's slice of each part | rank 1's | ...]."""
    slices = [p.chunk(tp) for p in weight.split(parts)]
    return torch.cat([s[r] for r in range(tp) for s in slices])


class PeerBlock(nn.Module):
    """A copy of one of our dense blocks laid out for torch's TP plan."""

    def __init__(self, block: Block, tp: int) -> None:
        super().__init__()
        self.attn_norm, self.ffn_norm = copy.deepcopy(block.attn_norm), copy.deepcopy(block.ffn_norm)
        self.attn, self.ffn = PeerAttention(block.attn, tp), PeerFFN(block.ffn, tp)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, None]:
        """Same contract as Block: (x, None)."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x)), None


def _linear_from(weight: Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.detach().clone())
    return linear


PEER_PLAN = {
    "attn_norm": SequenceParallel(),
    "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
    "attn.wqkv": ColwiseParallel(),
    "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
    "ffn_norm": SequenceParallel(),
    "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "ffn.w_gate_up": ColwiseParallel(),
    "ffn.w_down": RowwiseParallel(output_layouts=Shard(1)),
}


def bench_config(opts: dict[str, Any]) -> ModelConfig:
    """The dense block shape the options describe."""
    return ModelConfig(vocab_size=256, hidden_size=opts["hidden"], num_layers=opts["layers"], num_heads=opts["heads"],
                       num_kv_heads=opts["kv_heads"], max_seq_len=opts["seq"], dense_ffn_size=opts["ffn"],
                       first_k_dense=opts["layers"])


def build_stacks(cfg: ModelConfig, group: dist.ProcessGroup) -> dict[str, nn.ModuleList]:
    """The single-process stack ('full') and each contender's TP copy of it."""
    torch.manual_seed(0)
    full = nn.ModuleList(Block(cfg, moe=False) for _ in range(cfg.num_layers))
    stacks = {"full": full, OURS: copy.deepcopy(full), OURS_SP: copy.deepcopy(full),
              PEER: nn.ModuleList(PeerBlock(b, dist.get_world_size(group)) for b in full)}
    for name, sp in ((OURS, False), (OURS_SP, True)):
        for block in stacks[name]:
            parallelize_block(block, group, sp)
    mesh = init_device_mesh("cpu", (dist.get_world_size(group),))
    for block in stacks[PEER]:
        parallelize_module(block, mesh, PEER_PLAN)
    return stacks


def sequence_parallel(name: str) -> bool:
    """Whether the contender's residual stream is sequence-sharded."""
    return name != OURS


def run_stack(stack: nn.ModuleList, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The stack's output for x."""
    for block in stack:
        x, _ = block(x, cos, sin)
    return x


def step_fn(stack: nn.ModuleList, x: Tensor, dy: Tensor, cos: Tensor, sin: Tensor) -> Callable[[], Tensor]:
    """One forward + backward of the stack; returns the output."""
    def step() -> Tensor:
        inp = x.detach().requires_grad_()
        out = run_stack(stack, inp, cos, sin)
        out.backward(dy)
        return out.detach()
    return step


def _norms(stack: nn.ModuleList) -> list[nn.Module]:
    return [m for block in stack for m in (block.attn_norm, block.ffn_norm)]


def worker(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Measure every contender on this rank; return its figures and the output check."""
    torch.manual_seed(1)
    group = dist.group.WORLD
    cfg = bench_config(opts)
    stacks = build_stacks(cfg, group)
    cos, sin = rope_tables(opts["seq"], cfg.attention_head_dim, cfg.rope_theta)
    x = torch.randn(opts["batch"], opts["seq"], cfg.hidden_size)
    dy = torch.randn_like(x)
    shard = list(range(rank * opts["seq"] // world, (rank + 1) * opts["seq"] // world))
    steps = {name: step_fn(stacks[name], x[:, shard] if sequence_parallel(name) else x,
                           dy[:, shard] if sequence_parallel(name) else dy, cos, sin) for name in CONTENDERS}
    want = run_stack(stacks["full"], x, cos, sin).detach()
    out: dict[str, Any] = {"max_diff": {}}
    for name, step in steps.items():
        got = step()
        got = gather_sequence(got, group) if sequence_parallel(name) else got
        out["max_diff"][name] = (got - want).abs().max().item()
        meter = SavedTensorMeter(params=stacks[name].parameters())
        with meter.hooks(), meter.region(_norms(stacks[name])):
            y = run_stack(stacks[name], x[:, shard] if sequence_parallel(name) else x, cos, sin)
        del y
        comm = CommMeter()
        with comm:
            step()
        out[name] = {"act_bytes": meter.peak, "norm_bytes": meter.region_bytes, "comm_bytes": comm.bytes,
                     "collectives": comm.calls}

    def timed_step(name: str) -> float:
        dist.barrier(group)
        t0 = time.perf_counter()
        steps[name]()
        return time.perf_counter() - t0

    timed = rounds({name: partial(timed_step, name) for name in CONTENDERS}, opts["warmup"], opts["steps"],
                   opts["call_budget"], opts, "step", rotate=True)
    for name in CONTENDERS:
        out[name]["times"] = timed[name]["time"]
    return out


def rows_from(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per contender: the slowest rank's median step time, the largest rank's bytes."""
    rows, steps = [], []
    for name in CONTENDERS:
        per_rank = [r[name] for r in results]
        steps.append(slowest([p["times"] for p in per_rank]))
        rows.append({"contender": name, **fields("step_ms", steps[-1]),
                     "act_mib": max(p["act_bytes"] for p in per_rank) / 2**20,
                     "norm_mib": max(p["norm_bytes"] for p in per_rank) / 2**20,
                     "comm_mib": max(p["comm_bytes"] for p in per_rank) / 2**20,
                     "collectives": per_rank[0]["collectives"],
                     "max_diff": max(r["max_diff"][name] for r in results)})
    base = rows[-1]
    for row, step in zip(rows, steps):
        row.update(ratio_fields("vs_peer_time", step / steps[-1]))  # round by round
        row["vs_peer_act"] = row["act_mib"] / base["act_mib"]
    return rows


COLUMNS = [("contender", "contender", ""), ("step ms", "step_ms", ".1f"), ("spread", "step_ms_spread", ".0%"),
           ("x peer", "vs_peer_time", ".2f"), ("spread", "vs_peer_time_spread", ".0%"),
           ("act MiB", "act_mib", ".2f"), ("x peer", "vs_peer_act", ".2f"), ("norm MiB", "norm_mib", ".3f"),
           ("comm MiB", "comm_mib", ".2f"), ("max |diff|", "max_diff", ".1e")]


def main(argv: list[str] | None = None) -> int:
    """Parse options, run the benchmark, print the table, optionally write JSON."""
    p = argparse.ArgumentParser(prog="moe-bench tp", description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="TP ranks (gloo processes): 2 or 4")
    p.add_argument("--layers", type=int, default=4, help="dense transformer blocks in the stack")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads (torch's plan needs them divisible by --tp)")
    p.add_argument("--ffn", type=int, default=768, help="SwiGLU width")
    p.add_argument("--seq", type=int, default=512, help="sequence length")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |output - single process| allowed (fp32)")
    round_options(p, steps=10, warmup=2, budget_s=120.0, unit="step")
    args = p.parse_args(argv)
    require_positive(p, args, ("tp", "layers", "hidden", "heads", "kv_heads", "ffn", "seq", "batch", "steps"))
    for name in ("heads", "kv_heads", "ffn", "seq"):
        if getattr(args, name) % args.tp:
            p.error(f"--{name.replace('_', '-')} = {getattr(args, name)} must be divisible by --tp = {args.tp}")
    opts = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "batch", "steps",
                                          "warmup", "call_budget")}
    progress = BenchProgress("tp", enabled=not args.quiet)
    progress(f"{args.tp} gloo ranks, {args.layers} blocks, hidden {args.hidden}, seq {args.seq}, batch {args.batch}")
    results = run_ranks(worker, args.tp, opts, "try fewer --layers, a shorter --seq or fewer --steps")
    rows = rows_from(results)
    runs = (f"each contender runs {args.layers} dense blocks (RMSNorm, GQA attention {args.heads}/{args.kv_heads} "
            f"heads with RoPE and q/k/v in one Linear, SwiGLU {args.ffn} with gate/up in one Linear), hidden "
            f"{args.hidden}, {args.batch} x {args.seq} tokens, fp32, forward + backward, no optimizer; ours: this "
            f"project's column/row-parallel Linears (+SP: norms on sequence shards, all-gather in, reduce-scatter "
            f"out); peer: torch DTensor ColwiseParallel/RowwiseParallel + SequenceParallel over {args.tp} ranks")
    head = header("tp", list(argv or []), notes=[runs, __doc__])
    print(header_line(head))
    print(table(rows, COLUMNS, left=1))
    print(f"note: {runs}")
    if args.json:
        write_json(args.json, head, rows, key=["contender"],
                   metrics={"step_ms": LOWER, "act_mib": LOWER, "comm_mib": LOWER})
    bad = [r["contender"] for r in rows if r["max_diff"] > args.tolerance]
    if bad:
        print(f"moe-bench tp: outputs differ from the single-process stack: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
