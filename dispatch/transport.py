"""Multi-hop token movement, as generators that pause while exchanges are in flight, and its autograd:
dispatch's backward is a combine of gradients and vice versa.

Each hop runs on its own transport (dispatch.channel: the EP group for flat dispatch; the rail group,
then the node group, for hierarchical). A dispatch in C chunks (contiguous ranges of the source rows)
pipelines the hops: chunk c+1's first (inter-node) exchange is in flight while chunk c is forwarded
inside the node; combine runs the hops back in reverse, chunk c's inter-node return in flight while
chunk c+1 is summed inside the node. The rows that arrive chunk by chunk are put back in the order
one unchunked dispatch delivers them (Regroup), and every sum adds each row's copies in the same
order, so the results are bitwise equal for any C.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from dispatch import rehearsal_rule
from dispatch.channel import HopTransport, Steps, run_steps
from dispatch.device_split import DeviceSplit, block_counts
from dispatch.pending import Pending
from dispatch.routes import Hop, HopRoute, make_hop, plan_padded_sends, plan_sends
from dispatch.segment import ordered_sum


@dataclass
class Codec:
    """Wire format of dispatched rows: encode before sending, decode on arrival."""

    encode: Callable[[Tensor], Tensor]
    decode: Callable[[Tensor, Tensor], Tensor]  # (wire rows, like-tensor giving width/dtype) -> rows


@dataclass
class Regroup:
    """Rows that arrived chunk by chunk <-> the order of an unchunked dispatch (last-hop peer, then the
    previous hop's peer it came through, then source row)."""

    order: Tensor    # [M] in order = arrived[order]
    inverse: Tensor  # [M] arrived = in_order[inverse]


@dataclass
class Route:
    """Filled by a dispatch: per chunk the hops taken, how its chunks' rows interleave (None: one chunk),
    and the expert ids of the rows that arrived here."""

    chunks: list[list[Hop]] = field(default_factory=list)
    regroup: Regroup | None = None
    ids: Tensor | None = None

    def source_rows(self) -> list[int]:
        """Rows of each chunk at the source, before the first hop."""
        return [hops[0].back.num_targets for hops in self.chunks]

    def arrived_rows(self) -> list[int]:
        """Rows of each chunk that arrived here after the last hop."""
        return [hops[-1].arrived_rows for hops in self.chunks]


def take_rows(rows: Tensor, index: Tensor) -> Tensor:
    """rows.index_select(0, index); rows with none (a rank without tokens) give zero rows, as padding."""
    return rows.index_select(0, index) if rows.shape[0] else rows.new_zeros((index.numel(), *rows.shape[1:]))


def pack_meta(weights: Tensor, indices: Tensor) -> Tensor:
    """Routing metadata rows [T, 2k] int32: fp32 weight bits, then expert ids."""
    return torch.cat([weights.detach().float().contiguous().view(torch.int32), indices.to(torch.int32)], dim=1)


def unpack_meta(meta: Tensor, k: int | None = None) -> tuple[Tensor, Tensor]:
    """(fp32 weights [n, k], int64 expert ids [n, k]) from pack_meta rows (k: top-k, when more columns follow them;
    default: none follow)."""
    k = meta.shape[1] // 2 if k is None else k
    return meta[:, :k].contiguous().view(torch.float32), meta[:, k:2 * k].long()


class _Started:
    """A Steps generator advanced to its first pause: its first exchange is in flight."""

    def __init__(self, steps: Steps) -> None:
        self.steps, self.done, self.value = steps, False, None
        try:
            self.pending = next(steps)
        except StopIteration as stop:
            self.done, self.value = True, stop.value

    def finish(self) -> Steps:
        """The rest of the generator: pauses on the exchange in flight, then on the ones after it."""
        if self.done:
            return self.value
        pending = self.pending
        while True:
            yield pending
            try:
                pending = self.steps.send(None)
            except StopIteration as stop:
                return stop.value


def ahead(chunks: int, first: Callable[[int], Steps], rest: Callable[[int, Any], Steps]) -> Steps:
    """Per chunk c: first(c), then rest(c, its result); first(c + 1)'s exchange is issued before rest(c)
    runs, so it is in flight meanwhile. Returns rest's results."""
    results, held = [], _Started(first(0))
    for c in range(chunks):
        got = yield from held.finish()
        if c + 1 < chunks:
            held = _Started(first(c + 1))
        results.append((yield from rest(c, got)))
    return results


def behind(chunks: int, first: Callable[[int], Steps], rest: Callable[[int, Any], Steps]) -> Steps:
    """Per chunk c: first(c), then rest(c, its result); rest(c)'s first exchange stays in flight while
    first(c + 1) runs. Returns rest's results."""
    results, held = [], None
    for c in range(chunks):
        got = yield from first(c)
        if held is not None:
            results.append((yield from held.finish()))
        held = _Started(rest(c, got))
    results.append((yield from held.finish()))
    return results


def _regroup(counts: list[list[list[int]]], device: torch.device) -> Regroup:
    """Regroup of rows that arrived in blocks counts[chunk][last-hop peer][previous-hop peer] (row-major)
    into the order last-hop peer, previous-hop peer, chunk."""
    blocks = torch.tensor(counts, dtype=torch.int64, device=device)
    total = sum(n for chunk in counts for row in chunk for n in row)

    def index(layout: Tensor, dims: tuple[int, int, int]) -> Tensor:
        """rows laid out in blocks of layout (row-major) -> in blocks of layout.permute(dims)."""
        flat = layout.flatten()
        starts = (flat.cumsum(0) - flat).view(layout.shape).permute(dims).flatten()
        lengths = layout.permute(dims).flatten()
        shift = starts - (lengths.cumsum(0) - lengths)
        return torch.repeat_interleave(shift, lengths, output_size=total) + torch.arange(total, device=device)

    return Regroup(index(blocks, (1, 2, 0)), index(blocks.permute(1, 2, 0), (2, 0, 1)))


def _move(wire: Tensor, meta: Tensor, send_row: Tensor, send_splits: list[int], recv_splits: list[int],
          channel: HopTransport, max_copies: int, sizes: list[int] | None) -> Steps:
    """One hop of a dispatch: rows and their metadata out, yielding while in flight -> (Hop, wire, meta); sizes:
    the pass sizes of the hop's return sum (routes.plan_sends), None where they are to be read."""
    rows = channel.start_exchange(wire.index_select(0, send_row), send_splits, recv_splits, "dispatch")
    metas = channel.start_exchange(meta.index_select(0, send_row), send_splits, recv_splits, "dispatch", "meta")
    yield rows
    hop = make_hop(send_row, send_splits, recv_splits, meta.shape[0], max_copies, sizes)  # at most k ranks, once each
    return hop, rows.wait(), metas.wait()


def dispatch_steps(x: Tensor, weights: Tensor, indices: Tensor, stages: list[HopRoute], channels: list[HopTransport],
                   codec: Codec | None, route: Route, chunks: int = 1, sends: list[list[int]] | None = None) -> Steps:
    """Send each row of x (with its routing metadata) along stages (stage h over channels[h]) in chunks,
    filling route; yields each exchange while it is in flight; returns (rows that arrived here, their
    fp32 weights), in the order of an unchunked dispatch. No autograd.

    The first hop's counts of every chunk travel in one exchange; a later hop's counts, per chunk, are
    broken down by the previous hop's peer the rows came through (when chunks > 1), which is what
    putting the chunks' rows back in order needs. sends: per stage, the rows sent to each rank when the
    routing cannot be read (meta tensors: a rehearsal passes dispatch.rehearsal_rule's plan); real tensors
    plan their sends from the routing."""
    wire = codec.encode(x.detach()) if codec else x.detach()
    meta = pack_meta(weights, indices)
    world, device, k = channels[0].topology.world_size, x.device, indices.shape[1]
    sizes = rehearsal_rule.balanced_split(x.shape[0], chunks)
    pieces = list(zip(wire.split(sizes), meta.split(sizes)))
    split = [rehearsal_rule.chunk_counts(sent, chunks) for sent in sends] if sends is not None else None

    def plan(h: int, c: int, meta_c: Tensor, source: Tensor | None, width: int
             ) -> tuple[Tensor, list[list[int]], list[int] | None]:
        """(send_row, [rank][column] counts, pass sizes of its return sum or None) of chunk c's hop h."""
        if not meta_c.is_meta:
            return plan_sends(unpack_meta(meta_c)[1], stages[h], world, source, width, copies(h))
        if split is None:
            raise ValueError("dispatch_steps on meta tensors needs sends (dispatch.rehearsal_rule.plan_dispatch)")
        # a rehearsal: the rule's counts (all in the first column); which rows go where is not needed
        counts = [[per_chunk[c]] + [0] * (width - 1) for per_chunk in split[h]]
        return meta_c.new_empty(sum(n for n, *_ in counts), dtype=torch.int64), counts, None

    def copies(h: int) -> int:
        """The most copies of one row hop h sends: one per peer, at most k."""
        return min(k, len(stages[h].peers))

    first = [plan(0, c, meta_c, None, 1) for c, (_, meta_c) in enumerate(pieces)]
    counts = channels[0].start_counts([[sent[p][0] for _, sent, _ in first] for p in range(world)], "dispatch", device)
    yield counts
    first_recv = counts.wait()  # [rank][chunk]

    def first_hop(c: int) -> Steps:
        send_row, sent, sizes = first[c]
        return _move(*pieces[c], send_row, [n for n, in sent], [row[c] for row in first_recv], channels[0], copies(0),
                     sizes)

    def later_hops(c: int, moved: tuple[Hop, Tensor, Tensor]) -> Steps:
        hop, wire_c, meta_c = moved
        hops, by_peer = [hop], [[row[c]] for row in first_recv]
        for h in range(1, len(stages)):
            before = stages[h - 1].peers
            width, source = len(before) if chunks > 1 else 1, None
            if width > 1:  # the previous hop's peer each row came through, for the breakdown of the counts
                came = torch.tensor([hop.recv_splits[p] for p in before], device=device)
                source = torch.repeat_interleave(torch.arange(len(before), device=device), came,
                                                 output_size=meta_c.shape[0])
            send_row, sent, sizes = plan(h, c, meta_c, source, width)
            pending = channels[h].start_counts(sent, "dispatch", device)
            yield pending
            by_peer = pending.wait()
            hop, wire_c, meta_c = yield from _move(wire_c, meta_c, send_row, [sum(row) for row in sent],
                                                   [sum(row) for row in by_peer], channels[h], copies(h), sizes)
            hops.append(hop)
        return hops, wire_c, meta_c, [by_peer[p] for p in stages[-1].peers]

    done = yield from ahead(chunks, first_hop, later_hops)
    route.chunks = [hops for hops, *_ in done]
    wire, meta = (torch.cat([parts[i] for parts in done]) for i in (1, 2))
    if chunks > 1:
        route.regroup = _regroup([blocks for *_, blocks in done], device)
        wire, meta = wire.index_select(0, route.regroup.order), meta.index_select(0, route.regroup.order)
    recv_weights, route.ids = unpack_meta(meta)
    return (codec.decode(wire, x) if codec else wire), recv_weights


def padded_dispatch_steps(x: Tensor, weights: Tensor, indices: Tensor, stages: list[HopRoute],
                          channels: list[HopTransport], codec: Codec | None, route: Route, bounds: list[int],
                          chunks: int = 1) -> Steps:
    """dispatch_steps with padded exchanges: on hop h bounds[h] rows of each chunk to every peer, equal blocks both
    ways, so no count is traded and nothing is read to the host; padding rows travel with expert ids -1 (no
    destination on a later hop, no pair on arrival). In chunks > 1 (pipelined as dispatch_steps does) the last hop's
    rows carry the index of the previous hop's peer they came through (one more metadata column: rows arrive in that
    hop's equal blocks), from which the rows that arrived are put in the order of an unchunked dispatch (Regroup, by
    a stable sort on the device; padding last). Yields each exchange while in flight; returns ((rows that arrived
    here, their fp32 weights), overflow: a 0-dim bool, true when a hop of some chunk left rows past its bound unsent:
    the caller reruns the step exactly)."""
    wire = codec.encode(x.detach()) if codec else x.detach()
    meta = pack_meta(weights, indices)
    k, world, last = indices.shape[1], channels[0].topology.world_size, len(stages) - 1
    came = chunks > 1 and last > 0  # the last hop's rows carry their previous hop's peer
    sizes = rehearsal_rule.balanced_split(x.shape[0], chunks)
    overflows = []

    def move(h: int, wire_c: Tensor, meta_c: Tensor) -> Steps:
        """Hop h of one chunk's rows -> (Hop, rows, metadata that arrived)."""
        if came and h == last:  # rows came in from the previous hop in equal blocks of bounds[h - 1], by peer
            peer = torch.arange(meta_c.shape[0], device=meta_c.device) // max(bounds[h - 1], 1)
            meta_c = torch.cat([meta_c, peer.to(meta_c.dtype).unsqueeze(1)], dim=1)
        filled, over, hop = plan_padded_sends(unpack_meta(meta_c, k)[1], stages[h], world, bounds[h],
                                              min(k, len(stages[h].peers)))
        padding = torch.cat([meta_c.new_zeros(1, k), meta_c.new_full((1, meta_c.shape[1] - k), -1)], dim=1)
        sent_meta = torch.where(filled.unsqueeze(1), take_rows(meta_c, hop.send_row), padding)
        if isinstance(channels[h], DeviceSplit):
            hop.sent = block_counts(filled, len(stages[h].peers), bounds[h])
        rows = start_hop(channels[h], take_rows(wire_c, hop.send_row), hop, "dispatch")  # device split: learns
        metas = start_hop(channels[h], sent_meta, hop, "dispatch", "meta", padding[0])  # hop.received, used here
        yield rows
        overflows.append(over)
        return hop, rows.wait(), metas.wait()  # rows first: their wait completes hop.received

    def later_hops(c: int, moved: tuple[Hop, Tensor, Tensor]) -> Steps:
        hop, wire_c, meta_c = moved
        hops = [hop]
        for h in range(1, len(stages)):
            hop, wire_c, meta_c = yield from move(h, wire_c, meta_c)
            hops.append(hop)
        return hops, wire_c, meta_c

    pieces = list(zip(wire.split(sizes), meta.split(sizes)))
    done = yield from ahead(chunks, lambda c: move(0, *pieces[c]), later_hops)
    route.chunks = [hops for hops, *_ in done]
    wire, meta = (torch.cat([parts[i] for parts in done]) for i in (1, 2))
    if came:
        route.regroup = _padded_regroup(meta, k, len(stages[-2].peers), len(stages[-1].peers), bounds[-1], chunks)
        wire, meta = wire.index_select(0, route.regroup.order), meta.index_select(0, route.regroup.order)
    recv_weights, route.ids = unpack_meta(meta, k)
    overflow = overflows[0]
    for over in overflows[1:]:
        overflow = overflow | over
    return ((codec.decode(wire, x) if codec else wire), recv_weights), overflow


def _padded_regroup(meta: Tensor, k: int, before: int, peers: int, bound: int, chunks: int) -> Regroup:
    """Regroup of a padded chunked dispatch's rows, arrived in chunks of blocks of bound rows per last-hop peer, each
    row's metadata ending with the previous hop's peer it came through (of before peers), into the order last-hop
    peer, previous-hop peer, chunk (each block's rows as they came), padding rows (every expert id -1) last: a stable
    sort of keys computed on the device, no read."""
    position = torch.arange(meta.shape[0], device=meta.device)
    block = max(bound, 1)  # (no rows at all when the bound is 0)
    chunk, peer = position // (peers * block), position % (peers * block) // block
    key = (peer * before + meta[:, 2 * k].long()) * chunks + chunk
    key = torch.where((meta[:, k:2 * k] >= 0).any(1), key, peers * before * chunks)
    order = torch.argsort(key, stable=True)
    return Regroup(order, torch.empty_like(order).scatter_(0, order, position))


def start_hop(channel: HopTransport, rows: Tensor, hop: Hop, kind: str, part: str = "payload",
              padding: Tensor | None = None, back: bool = False) -> Pending:
    """Start one exchange of rows along hop (back: its return, each peer sent back the rows it sent here): exact hops by
    their splits; padded hops in equal blocks, on a device-split transport (dispatch.device_split) only each block's
    filled rows, the rows past them arriving as padding (a row; None: zeros). A padded hop's first device-split
    exchange learns hop.received (valid once its Pending is waited for)."""
    if hop.send_splits is not None:
        splits = (hop.recv_splits, hop.send_splits) if back else (hop.send_splits, hop.recv_splits)
        return channel.start_exchange(rows, *splits, kind, part)
    if not isinstance(channel, DeviceSplit):
        return channel.start_exchange(rows, None, None, kind, part)
    sent, received = (hop.received, hop.sent) if back else (hop.sent, hop.received)
    pending, learnt = channel.start_split(rows, sent, received, kind, part, padding)
    if hop.received is None:
        hop.received = learnt
    return pending


def scatter_steps(rows: Tensor, route: Route, channels: list[HopTransport], kind: str) -> Steps:
    """Move rows along the hops a dispatch took, chunk by chunk as it did (no counts to trade); yields each
    exchange while it is in flight; returns the rows that arrived, in route's order."""
    pieces = rows.split(route.source_rows())

    def move(c: int, h: int, part: Tensor) -> Steps:
        hop = route.chunks[c][h]
        pending = start_hop(channels[h], take_rows(part, hop.send_row), hop, kind)
        yield pending
        return pending.wait()

    def rest(c: int, part: Tensor) -> Steps:
        for h in range(1, len(channels)):
            part = yield from move(c, h, part)
        return part

    arrived = torch.cat((yield from ahead(len(route.chunks), lambda c: move(c, 0, pieces[c]), rest)))
    return arrived if route.regroup is None else arrived.index_select(0, route.regroup.order)


def scatter_rows(rows: Tensor, route: Route, channels: list[HopTransport], kind: str) -> Tensor:
    """scatter_steps run to its end."""
    return run_steps(scatter_steps(rows, route, channels, kind))


def gather_steps(rows: Tensor, route: Route, channels: list[HopTransport], kind: str, wire_dtype: torch.dtype) -> Steps:
    """Adjoint of scatter_steps: send rows back hop by hop (last hop first, chunk by chunk) as wire_dtype,
    summing copies in fp32 or wider; yields each exchange while it is in flight, returns the sums.

    Each hop's sums are rounded once to wire_dtype, the dtype they travel (or are returned) in.
    """
    acc = torch.promote_types(rows.dtype, torch.float32)
    rows = rows.to(wire_dtype)
    if route.regroup is not None:
        rows = rows.index_select(0, route.regroup.inverse)
    pieces = rows.split(route.arrived_rows())

    def back(c: int, h: int, part: Tensor) -> Steps:
        hop = route.chunks[c][h]
        pending = start_hop(channels[h], part, hop, kind, back=True)
        yield pending
        return ordered_sum(pending.wait(), hop.back, dtype=acc, out_dtype=wire_dtype)

    def rest(c: int, part: Tensor) -> Steps:
        for h in reversed(range(len(channels) - 1)):
            part = yield from back(c, h, part)
        return part

    last = len(channels) - 1
    return torch.cat((yield from behind(len(route.chunks), lambda c: back(c, last, pieces[c]), rest)))


def gather_rows(rows: Tensor, route: Route, channels: list[HopTransport], kind: str, wire_dtype: torch.dtype) -> Tensor:
    """gather_steps run to its end."""
    return run_steps(gather_steps(rows, route, channels, kind, wire_dtype))


class DispatchRows(torch.autograd.Function):
    """x [T, H], weights [T, k] -> the rows (one per source token) and weights that a dispatch_steps
    run delivered here (passed in as arrived); backward sends their grads back over grad_channels."""

    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor, arrived: tuple[Tensor, Tensor], route: Route,
                grad_channels: list[HopTransport]) -> tuple[Tensor, Tensor]:  # noqa: D102
        ctx.route, ctx.channels = route, grad_channels
        ctx.dtypes = (x.dtype, weights.dtype)
        return arrived

    @staticmethod
    def backward(ctx, grad_rows: Tensor, grad_weights: Tensor):  # noqa: D102
        ctx.channels[0].meter.start("dispatch_backward")
        grads = [None, None]
        for i, grad in enumerate((grad_rows, grad_weights)):
            if ctx.needs_input_grad[i]:
                grads[i] = gather_rows(grad, ctx.route, ctx.channels, "dispatch_backward", grad.dtype).to(ctx.dtypes[i])
        return grads[0], grads[1], None, None, None


class CombineRows(torch.autograd.Function):
    """Partial results of the rows that arrived here -> their [T, H] sums at the source tokens, computed
    by a gather_steps run (passed in as summed); backward scatters the grads over grad_channels."""

    @staticmethod
    def forward(ctx, partial: Tensor, summed: Tensor, route: Route,
                grad_channels: list[HopTransport]) -> Tensor:  # noqa: D102
        ctx.route, ctx.channels, ctx.dtype = route, grad_channels, partial.dtype
        return summed

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: D102
        ctx.channels[0].meter.start("combine_backward")
        return scatter_rows(grad_out, ctx.route, ctx.channels, "combine_backward").to(ctx.dtype), None, None, None
