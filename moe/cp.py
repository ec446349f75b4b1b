"""Context parallelism: causal attention over a sequence split across the ranks of a CP group.

Zig-zag layout: the sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r (one early,
one late), so every rank has the same causal work. Two ways to attend over the whole sequence:

- `ring_attention`: K/V blocks travel around the ring, cp - 1 hops; each hop's transfer is in flight while
  the block in hand is attended (online softmax: partial outputs merged by their log-sum-exp). With the
  zig-zag layout a block from an earlier rank is seen by all local queries and only its first chunk
  counts; a block from a later rank is seen by the local late chunk only; so each hop is half a block's
  work. The backward runs the ring again with the K/V blocks, their dK/dV accumulators travelling with
  them and reaching their owner after a last hop.
- `allgather_attention`: every rank all-gathers K and V (backward: reduce-scatter of their grads) and
  attends its own queries to the whole sequence block by block, as the ring does (the blocks kept for
  backward, never their scores): one collective, cp x the K/V memory; for short rings.

q [B, Hq, S_local, Dqk], k [B, Hkv, S_local, Dqk], v [B, Hkv, S_local, Dv] hold this rank's zig-zag shard
(S_local = 2 x S / (2 cp)); Hq a multiple of Hkv (GQA: K/V travel unrepeated). Blocks are attended in plain
torch, in at least float32 (a fused kernel returning the log-sum-exp plugs in at _attend / _block_grads).
Process groups are passed
explicitly; grad_group (default: group) carries the backward's transfers, so a concurrent forward on group
(DualPipe's F&B pairs) never interleaves with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from dispatch.pending import Pending, wait_all
from moe.tp.comm import Group, GroupRegion, gather_for_region

CpMethod = Literal["ring", "allgather"]
CP_METHODS = get_args(CpMethod)


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of the sequence's 2 x cp chunks that rank holds: an early and a late one."""
    return rank, 2 * cp - 1 - rank


def zigzag_shard(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """Rank's zig-zag shard of x along dim (its two chunks, concatenated)."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[dim]} must be divisible by 2 x cp = {2 * cp} (zig-zag chunks)")
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[c] for c in zigzag_chunks(cp, rank)], dim)


def zigzag_positions(seq_len: int, cp: int, rank: int, device: torch.device) -> Tensor:
    """Global positions of rank's zig-zag shard of a seq_len sequence."""
    return zigzag_shard(torch.arange(seq_len, device=device), cp, rank, dim=0)


def _scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """q [B, Hq, Sq, D] x k [B, Hkv, Sk, D] -> [B, Hkv, Hq/Hkv, Sq, Sk] (GQA without repeating k)."""
    b, hq, sq, d = q.shape
    return torch.einsum("bgrqd,bgkd->bgrqk", q.view(b, k.shape[1], hq // k.shape[1], sq, d), k) * scale


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Output [B, Hq, Sq, Dv] and log-sum-exp [B, Hq, Sq] of q over one K/V block (causal: Sq == Sk, aligned)."""
    s = _scores(q, k, scale)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bgrqk,bgkd->bgrqd", torch.exp(s - lse.unsqueeze(-1)), v)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _merge(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online softmax: (out, lse) and a further block's (part, part_lse) of the same query rows, merged."""
    new = torch.logaddexp(lse, part_lse)
    return out * torch.exp(lse - new).unsqueeze(-1) + part * torch.exp(part_lse - new).unsqueeze(-1), new


def _block_grads(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, scale: float,
                 causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one block's share of the attention, from the final output and log-sum-exp of its rows."""
    b, hq, sq, _ = q.shape
    g = k.shape[1]
    s = _scores(q, k, scale)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    p = torch.exp(s - lse.view(b, g, hq // g, sq).unsqueeze(-1))
    do = dout.view(b, g, hq // g, sq, -1)
    dv = torch.einsum("bgrqk,bgrqd->bgkd", p, do)
    dp = torch.einsum("bgrqd,bgkd->bgrqk", do, v)
    delta = (do * out.view_as(do)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bgrqk,bgkd->bgrqd", ds, k).flatten(1, 2)
    dk = torch.einsum("bgrqk,bgrqd->bgkd", ds, q.view(b, g, hq // g, sq, -1))
    return dq, dk, dv


class _Ring:
    """Transfers around a CP ring: tensors go to the next rank, like tensors come from the previous one. Every
    rank posts its sends and receives in the same order, so no tags are needed (NCCL matches by order)."""

    def __init__(self, group: Group, traffic: dict[str, int] | None) -> None:
        self.group, self.traffic = group, traffic
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def send(self, tensors: list[Tensor]) -> Pending:
        """Post the sends of tensors to the next rank; the Pending holds what is sent until they are done."""
        if self.traffic is not None:
            self.traffic["sent_bytes"] = self.traffic.get("sent_bytes", 0) + sum(t.nbytes for t in tensors)
        sent = [t.contiguous() for t in tensors]
        return Pending([dist.isend(t, self.next, self.group) for t in sent], keep=sent)

    def recv(self, like: list[Tensor]) -> tuple[list[Tensor], Pending]:
        """Post receives of tensors like these from the previous rank; returns (buffers, their Pending)."""
        buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
        return buffers, Pending([dist.irecv(b, self.prev, self.group) for b in buffers], keep=buffers)

    def source(self, hop: int) -> int:
        """The CP rank whose K/V block this rank holds after hop transfers."""
        return (self.rank - hop) % self.size


def _block_forward(q: Tensor, k: Tensor, v: Tensor, out: Tensor | None, lse: Tensor | None, source: int, rank: int,
                   scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of rank's queries merged with CP rank source's K/V block (its own: the first, out None)."""
    half = q.shape[2] // 2
    if source == rank:
        return _diagonal(q, k, v, scale)
    if source < rank:  # an earlier rank's block: every query sees its early chunk
        return _merge(out, lse, *_attend(q, k[:, :, :half], v[:, :, :half], scale, causal=False))
    # a later rank's block: only the late chunk's queries see it, all of it
    late, late_lse = _merge(out[:, :, half:], lse[:, :, half:], *_attend(q[:, :, half:], k, v, scale, causal=False))
    return torch.cat((out[:, :, :half], late), 2), torch.cat((lse[:, :, :half], late_lse), 2)


def _block_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dq: Tensor | None,
                    source: int, rank: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq with this block's share added, dk and dv of CP rank source's K/V block) from rank's queries (its own
    block: the first, dq None)."""
    half = q.shape[2] // 2
    if source == rank:
        return _diagonal_grads(q, k, v, out, lse, dout, scale)
    if source < rank:
        gq, gk, gv = _block_grads(q, k[:, :, :half], v[:, :, :half], out, lse, dout, scale, causal=False)
        return dq + gq, *(F.pad(g, (0, 0, 0, g.shape[2])) for g in (gk, gv))
    gq, gk, gv = _block_grads(q[:, :, half:], k, v, out[:, :, half:], lse[:, :, half:], dout[:, :, half:], scale,
                              causal=False)
    return torch.cat((dq[:, :, :half], dq[:, :, half:] + gq), 2), gk, gv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, group: Group,  # noqa: D102
                grad_group: Group, traffic: dict[str, int] | None) -> Tensor:
        ring = _Ring(group, traffic)
        k, v = k.contiguous(), v.contiguous()  # sent as they are, hop after hop
        held, out, lse = [k, v], None, None
        for hop in range(ring.size):
            last = hop == ring.size - 1
            if not last:  # the next block crosses while the held one is attended
                sends = ring.send(held)
                incoming, recvs = ring.recv(held)
            out, lse = _block_forward(q, *held, out, lse, ring.source(hop), ring.rank, scale)
            if not last:
                wait_all((sends, recvs))
                held = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.grad_group, ctx.traffic = scale, grad_group, traffic
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: D102
        """The ring again: K/V blocks travel ahead (overlapped with the block in hand); each block's dK/dV
        accumulator follows one hop behind, and a last hop brings it to the block's owner."""
        q, k, v, out, lse = ctx.saved_tensors
        scale, ring = ctx.scale, _Ring(ctx.grad_group, ctx.traffic)
        dout = dout.contiguous()
        held, dq, pending = [k, v], None, []
        for hop in range(ring.size):
            last = hop == ring.size - 1
            if hop:
                acc, acc_recvs = ring.recv(held)  # the previous rank's accumulator of the block in hand
            if not last:
                pending.append(ring.send(held))
                incoming, recvs = ring.recv(held)
            dq, dk, dv = _block_backward(q, *held, out, lse, dout, dq, ring.source(hop), ring.rank, scale)
            if hop:
                acc_recvs.wait()
                dk, dv = dk + acc[0], dv + acc[1]
            if ring.size > 1:
                pending.append(ring.send([dk, dv]))
            if not last:
                recvs.wait()
                held = incoming
        if ring.size > 1:  # the accumulator of this rank's own block, back from its last visit
            (dk, dv), recvs = ring.recv([k, v])
            wait_all((recvs, *pending))
        return dq, dk, dv, None, None, None, None


def _diagonal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The rank's own block: each chunk attends causally to itself, the late chunk fully to the early one."""
    half = q.shape[2] // 2
    early, early_lse = _attend(q[:, :, :half], k[:, :, :half], v[:, :, :half], scale, causal=True)
    late, late_lse = _attend(q[:, :, half:], k[:, :, half:], v[:, :, half:], scale, causal=True)
    cross, cross_lse = _attend(q[:, :, half:], k[:, :, :half], v[:, :, :half], scale, causal=False)
    late, late_lse = _merge(late, late_lse, cross, cross_lse)
    return torch.cat((early, late), 2), torch.cat((early_lse, late_lse), 2)


def _diagonal_grads(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of the rank's own block (the three parts of _diagonal)."""
    half = q.shape[2] // 2
    e, l_ = slice(None, half), slice(half, None)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols, causal in ((e, e, True), (l_, l_, True), (l_, e, False)):
        gq, gk, gv = _block_grads(q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows], lse[:, :, rows],
                                  dout[:, :, rows], scale, causal)
        dq[:, :, rows] += gq
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv
    return dq, dk, dv


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.shape[2] % 2 or q.shape[2] != k.shape[2] or k.shape[2] != v.shape[2]:
        raise ValueError(f"q, k, v hold {q.shape[2]}, {k.shape[2]}, {v.shape[2]} positions: a zig-zag shard is two "
                         f"equal chunks, the same for q, k and v")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads must be a multiple of the {k.shape[1]} K/V heads")


def _prepare(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> tuple[Tensor, Tensor, Tensor, float]:
    """Checked inputs in at least float32 (softmax statistics), and the softmax scale (default 1/sqrt(D))."""
    _check(q, k, v)
    dtype = torch.promote_types(q.dtype, torch.float32)
    return q.to(dtype), k.to(dtype), v.to(dtype), q.shape[-1] ** -0.5 if scale is None else scale


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: Group, scale: float | None = None,
                   grad_group: Group | None = None, traffic: dict[str, int] | None = None) -> Tensor:
    """Causal attention of this rank's zig-zag shard over the whole sequence, K/V passed around the ring.
    traffic: a dict whose "sent_bytes" gets the bytes this rank sends, forward and backward."""
    dtype = q.dtype
    q, k, v, scale = _prepare(q, k, v, scale)
    return _RingAttention.apply(q, k, v, scale, group, grad_group or group, traffic).to(dtype)


class _GatheredAttention(torch.autograd.Function):
    """This rank's queries over every CP rank's K/V block, all at hand (all-gathered in rank order): the ring's
    block steps without transfers, the own block first; the blocks are saved, never their scores."""

    @staticmethod
    def forward(ctx, q: Tensor, k_all: Tensor, v_all: Tensor, scale: float, rank: int) -> Tensor:  # noqa: D102
        out = lse = None
        for source, block in _gathered_blocks(q, k_all, v_all, rank):
            out, lse = _block_forward(q, *block, out, lse, source, rank, scale)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.scale, ctx.rank = scale, rank
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # noqa: D102
        q, k_all, v_all, out, lse = ctx.saved_tensors
        dq, grads = None, {}
        for source, block in _gathered_blocks(q, k_all, v_all, ctx.rank):
            dq, *grads[source] = _block_backward(q, *block, out, lse, dout.contiguous(), dq, source, ctx.rank,
                                                 ctx.scale)
        dk, dv = (torch.cat([grads[source][i] for source in sorted(grads)], 2) for i in (0, 1))
        return dq, dk, dv, None, None


def _gathered_blocks(q: Tensor, k_all: Tensor, v_all: Tensor, rank: int) -> list[tuple[int, tuple[Tensor, Tensor]]]:
    """(CP rank, its (K, V) block) of all-gathered K/V, rank's own block first."""
    blocks = list(zip(k_all.split(q.shape[2], 2), v_all.split(q.shape[2], 2)))
    return [(s, blocks[s]) for s in [rank, *(s for s in range(len(blocks)) if s != rank)]]


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group: Group, scale: float | None = None,
                        grad_group: Group | None = None, traffic: dict[str, int] | None = None) -> Tensor:
    """Causal attention of this rank's zig-zag shard over the whole sequence, K/V all-gathered (backward: their
    grads reduce-scattered). traffic: a dict whose "sent_bytes" gets the bytes this rank sends (ring model of the
    all-gather and of the reduce-scatter: (cp - 1) x its K/V shard each)."""
    dtype = q.dtype
    q, k, v, scale = _prepare(q, k, v, scale)
    cp = dist.get_world_size(group)
    if traffic is not None:
        traffic["sent_bytes"] = traffic.get("sent_bytes", 0) + 2 * (cp - 1) * (k.nbytes + v.nbytes)
    k_all, v_all = (gather_for_region(t.contiguous(), 2, group, grad_group) for t in (k, v))  # rank order
    return _GatheredAttention.apply(q, k_all, v_all, scale, dist.get_rank(group)).to(dtype)


@dataclass(frozen=True)
class CPRegion(GroupRegion):
    """How a model's sequences are split over a CP group: the group, the attention method (one of CP_METHODS) and
    the group the backward's transfers use (None: group; a twin lets a backward run beside a forward)."""

    group: Group
    method: str = "ring"
    grad_group: Group | None = None

    def __post_init__(self) -> None:
        if self.method not in CP_METHODS:
            raise ValueError(f"context-parallel method {self.method!r} is not one of {', '.join(CP_METHODS)}")

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's zig-zag shard of a whole-sequence x."""
        return zigzag_shard(x, self.size, self.rank, dim)

    def positions(self, seq_len: int, device: torch.device) -> Tensor:
        """Global positions of this rank's shard of a seq_len sequence."""
        return zigzag_positions(seq_len, self.size, self.rank, device)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
        """Causal attention of this rank's shard over the whole sequence (moe.cp.cp_attention)."""
        return cp_attention(self.method, q, k, v, self.group, scale, self.grad_group)


def cp_attention(method: str, q: Tensor, k: Tensor, v: Tensor, group: Group, scale: float | None = None,
                 grad_group: Group | None = None, traffic: dict[str, int] | None = None) -> Tensor:
    """Causal attention over a CP group by method (one of CP_METHODS)."""
    if method not in CP_METHODS:
        raise ValueError(f"context-parallel method {method!r} is not one of {', '.join(CP_METHODS)}")
    return (ring_attention if method == "ring" else allgather_attention)(q, k, v, group, scale, grad_group, traffic)
