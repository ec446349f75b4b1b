"""Multi-hop token movement, as generators that pause while exchanges are in flight, and its autograd:
dispatch's backward is a combine of gradients and vice versa."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from dispatch.channel import Channel, Steps, run_steps
from dispatch.routes import Hop, Stage, make_hop, plan_sends
from dispatch.segment import ordered_sum


@dataclass
class Codec:
    """Wire format of dispatched rows: encode before sending, decode on arrival."""

    encode: Callable[[Tensor], Tensor]
    decode: Callable[[Tensor, Tensor], Tensor]  # (wire rows, like-tensor giving width/dtype) -> rows


@dataclass
class Route:
    """Filled by a dispatch: the hops taken and the expert ids of the rows that arrived here."""

    hops: list[Hop] = field(default_factory=list)
    ids: Tensor | None = None


def pack_meta(weights: Tensor, indices: Tensor) -> Tensor:
    """Routing metadata rows [T, 2k] int32: fp32 weight bits, then expert ids."""
    return torch.cat([weights.detach().float().contiguous().view(torch.int32), indices.to(torch.int32)], dim=1)


def unpack_meta(meta: Tensor) -> tuple[Tensor, Tensor]:
    """(fp32 weights [n, k], int64 expert ids [n, k]) from pack_meta rows."""
    k = meta.shape[1] // 2
    return meta[:, :k].contiguous().view(torch.float32), meta[:, k:].long()


def scatter_rows(rows: Tensor, hops: list[Hop], channel: Channel, kind: str, part: str = "payload") -> Tensor:
    """Move rows along the hops a dispatch took."""
    for hop in hops:
        rows = channel.exchange(rows.index_select(0, hop.send_row), hop.send_splits, hop.recv_splits, kind, part)
    return rows


def gather_steps(rows: Tensor, hops: list[Hop], channel: Channel, kind: str, wire_dtype: torch.dtype) -> Steps:
    """Adjoint of scatter_rows: send rows back hop by hop as wire_dtype, summing copies in fp32 or wider;
    yields each hop's exchange while it is in flight, returns the sums.

    Each hop's sums are rounded once to wire_dtype, the dtype they travel (or are returned) in.
    """
    acc = torch.promote_types(rows.dtype, torch.float32)
    for hop in reversed(hops):
        pending = channel.start_exchange(rows.to(wire_dtype), hop.recv_splits, hop.send_splits, kind)
        yield pending
        rows = ordered_sum(pending.wait(), hop.back, dtype=acc, out_dtype=wire_dtype)
    return rows


def gather_rows(rows: Tensor, hops: list[Hop], channel: Channel, kind: str, wire_dtype: torch.dtype) -> Tensor:
    """gather_steps run to its end."""
    return run_steps(gather_steps(rows, hops, channel, kind, wire_dtype))


def dispatch_steps(x: Tensor, weights: Tensor, indices: Tensor, stages: list[Stage], channel: Channel,
                   codec: Codec | None, route: Route, sends: list[list[int]] | None = None) -> Steps:
    """Send each row of x (with its routing metadata) along stages, filling route; yields each
    exchange while it is in flight; returns (rows that arrived here, their fp32 weights). No autograd.

    sends: per stage, the rows sent to each rank when the routing cannot be read (meta tensors: a
    rehearsal passes dispatch.rehearsal's plan); real tensors plan their sends from the routing."""
    x = x.detach()
    wire = codec.encode(x) if codec else x
    meta = pack_meta(weights, indices)
    world = channel.topology.world_size
    for step, stage in enumerate(stages):
        ids = unpack_meta(meta)[1]
        if ids.is_meta:  # a rehearsal: the rule's splits; which rows go where is not needed
            if sends is None:
                raise ValueError("dispatch_steps on meta tensors needs sends (dispatch.rehearsal.plan_dispatch)")
            send_splits = sends[step]
            send_row = ids.new_empty(sum(send_splits))
        else:
            send_row, send_splits = plan_sends(ids, stage, world)
        counts = channel.start_counts(send_splits, stage.peers, "dispatch", x.device)
        yield counts
        recv_splits = counts.wait()
        hop = make_hop(send_row, send_splits, recv_splits, ids.shape[0],  # once per rank, at most k ranks
                       min(ids.shape[1], len(stage.peers)))
        rows = channel.start_exchange(wire.index_select(0, send_row), send_splits, recv_splits, "dispatch")
        metas = channel.start_exchange(meta.index_select(0, send_row), send_splits, recv_splits, "dispatch", "meta")
        yield rows
        wire, meta = rows.wait(), metas.wait()
        route.hops.append(hop)
    recv_weights, route.ids = unpack_meta(meta)
    return (codec.decode(wire, x) if codec else wire), recv_weights


class DispatchRows(torch.autograd.Function):
    """x [T, H], weights [T, k] -> the rows (one per source token) and weights that a dispatch_steps
    run delivered here (passed in as arrived); backward sends their grads back over grad_channel."""

    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor, arrived: tuple[Tensor, Tensor], hops: list[Hop],
                grad_channel: Channel) -> tuple[Tensor, Tensor]:  # noqa: D102
        ctx.hops, ctx.channel = hops, grad_channel
        ctx.dtypes = (x.dtype, weights.dtype)
        return arrived

    @staticmethod
    def backward(ctx, grad_rows: Tensor, grad_weights: Tensor):  # noqa: D102
        ctx.channel.meter.start("dispatch_backward")
        grads = [None, None]
        for i, grad in enumerate((grad_rows, grad_weights)):
            if ctx.needs_input_grad[i]:
                grads[i] = gather_rows(grad, ctx.hops, ctx.channel, "dispatch_backward", grad.dtype).to(ctx.dtypes[i])
        return grads[0], grads[1], None, None, None


class CombineRows(torch.autograd.Function):
    """Partial results of the rows that arrived here -> their [T, H] sums at the source tokens, computed
    by a gather_steps run (passed in as summed); backward scatters the grads over grad_channel."""

    @staticmethod
    def forward(ctx, partial: Tensor, summed: Tensor, hops: list[Hop], grad_channel: Channel) -> Tensor:  # noqa: D102
        ctx.hops, ctx.channel, ctx.dtype = hops, grad_channel, partial.dtype
        return summed

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: D102
        ctx.channel.meter.start("combine_backward")
        return scatter_rows(grad_out, ctx.hops, ctx.channel, "combine_backward").to(ctx.dtype), None, None, None
