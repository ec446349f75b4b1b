"""EPDispatcher: expert-parallel dispatch/combine over one process group (flat or node-aware hierarchical)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor

from dispatch import rehearsal_rule
from dispatch.channel import HopTransport, Steps, run_steps, transport_for
from dispatch.choices import check_choice
from dispatch.device_split import DeviceSplit
from dispatch.fp8 import decode_fp8, encode_fp8, split_fp8
from dispatch.hopgroups import HopGroups, check_hop_group
from dispatch.layout import check_num_experts, check_routing, expert_owner, lookup
from dispatch.permute import Permutation, make_padded_permutation, make_permutation, permute, unpermute
from dispatch.routes import padded_bounds, routes_for
from dispatch.topology import DispatchBackend, make_topology
from dispatch.traffic import Traffic, TrafficMeter
from dispatch.transport import (Codec, CombineRows, DispatchRows, Route, dispatch_steps, gather_steps,
                                padded_dispatch_steps)
from kernels import FP8Rows

Payload = Literal["bf16", "fp8"]  # how dispatched rows travel: in their own dtype, or e4m3 with 1x128 scales
PAYLOADS = get_args(Payload)
# exchange sizes read to the host; fixed bounds with a device-side overflow; those bounds' layout with only the filled
# rows on the wire (dispatch.device_split)
Exchange = Literal["exact", "padded", "device_split"]
EXCHANGES = get_args(Exchange)

FP8_CODEC = Codec(encode_fp8, lambda wire, like: decode_fp8(wire, like.shape[1], like.dtype))
FP8_WIRE_CODEC = Codec(encode_fp8, lambda wire, like: wire)  # rows stay e4m3 + scales on arrival (fp8_rows)


@dataclass
class RecvInfo:
    """What arrived for this rank's experts."""

    tokens_per_local_expert: Tensor  # [E_local] int64 rows per local expert, in row order
    num_recv_tokens: int             # distinct (source rank, token) rows received, before expansion


@dataclass
class EPHandle:
    """What combine needs to undo one dispatch."""

    route: Route
    perm: Permutation
    recv_weights: Tensor  # [rows received, k] fp32 routing weights (differentiable)
    num_tokens: int


def _check_grad_group(grad_group: dist.ProcessGroup, group: dist.ProcessGroup) -> None:
    ranks = dist.get_process_group_ranks(group)
    got = "group itself" if grad_group is group else dist.get_process_group_ranks(grad_group)
    if grad_group is group or got != ranks:
        raise ValueError(f"grad_group must be a second process group over the ranks of group {ranks}, got {got}")


class EPDispatcher:
    """Sends each token once per destination rank (hierarchical: once per destination node) and back.

    payload "bf16" sends x unquantised in its own dtype (bf16 in training; fp32/fp64 pass through
    exactly); "fp8" sends e4m3 with one fp32 scale per 128 channels, dequantised on arrival, or with
    fp8_rows handed over as they came (kernels.FP8Rows: the e4m3 rows and scales go into FP8 experts'
    first GEMM without a dequantise/requantise; their gradient comes back in x's dtype).
    Combine always travels in y's dtype and accumulates in fp32 or wider. Waits are bounded by the
    group's timeout.

    Forward exchanges run on group; the exchanges of their gradients (dispatch's and combine's
    backward) run on grad_group when given, a second group over the same ranks, made by every one
    of them: `EPDispatcher(E, group=ep, grad_group=dist.new_group(ranks_of_ep), ...)`. With it, a
    backward through this dispatcher may run on another thread while a forward dispatches (the
    pipeline runtime's F&B pairs do this; see concurrent_backward): each group then sees its
    exchanges in the same order on every rank. Without it (None) both directions share group.

    Flat dispatch exchanges on group. Hierarchical dispatch sends its inter-node hop on a rail group
    (the EP ranks with this rank's local index, one per node) and its intra-node hop on a node group
    (this node's EP ranks), each holding only that hop's peers, counts included: hops (HopGroups, as
    launch.parallel.mesh makes them once for every layer, or dispatch.hopgroups.make_hop_groups; with grad twins
    when grad_group is given). Without hops both hops run on group (grad_group), with zero rows for
    the ranks outside the hop (every hop still trades counts with its peers only). chunks > 1
    (hierarchical only) pipelines the hops in that many chunks of the tokens (dispatch.transport);
    results are bitwise equal for any chunks.

    exchange "exact" reads each exchange's sizes to the host (counts traded, then list splits). "padded" (flat, or
    hierarchical with hops, in any chunks) sends a fixed number of rows to every peer of each hop and gives its
    experts a fixed number of rows (padded_bounds: from the tokens per call, top-k, the EP size and headroom), so a
    dispatch, its combine and both backwards read nothing to the host and issue the same operators on the same
    shapes for any routing. The bounds follow from tokens, the most tokens an EP rank dispatches per call (None:
    each call's own count, which every EP rank must then share, as a training step's micro-batches do). Rows past a
    bound are not sent: the dispatch raises `overflow` (a device flag, kept until take_overflow) and its results are
    not the layer's; the caller reruns the step on the exact path and may widen the bounds (grow). Capacity-factor
    routing is unchanged: its dropped slots are -1 before the dispatch. "device_split" is "padded" (bounds, layout,
    overflow and rerun alike) with only each block's filled rows on the wire, their counts on the device
    (dispatch.device_split: NVSHMEM's all_to_all_vdev on CUDA, elsewhere a reference with the same result).
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None, gpus_per_node: int | None = None,
                 backend: str = "flat", payload: str = "bf16", grad_group: dist.ProcessGroup | None = None,
                 hops: HopGroups | None = None, chunks: int = 1, fp8_rows: bool = False, exchange: str = "exact",
                 headroom: float = 2.0, tokens: int | None = None) -> None:
        check_choice("backend", backend, DispatchBackend)
        check_choice("payload", payload, Payload)
        check_choice("exchange", exchange, Exchange)
        if exchange != "exact" and backend == "hierarchical" and hops is None:
            raise ValueError(f"exchange = {exchange!r} sends equal blocks on groups of exactly each hop's peers: the "
                             "hierarchical dispatch needs hops (HopGroups), got hops = None")
        if not headroom > 0:
            raise ValueError(f"headroom = {headroom!r} must be a number > 0 (the padded bounds' factor over a balanced "
                             f"routing's rows)")
        if not isinstance(chunks, int) or chunks < 1 or (chunks > 1 and backend != "hierarchical"):
            raise ValueError(f"chunks = {chunks!r} must be an integer >= 1, and 1 unless backend = 'hierarchical' "
                             f"(got backend = {backend!r}): chunks pipeline the two hierarchical hops")
        if fp8_rows and payload != "fp8":
            raise ValueError(f"fp8_rows = True needs payload = 'fp8' (rows arrive in e4m3), got payload = {payload!r}")
        if not dist.is_initialized():
            raise RuntimeError("EPDispatcher needs torch.distributed to be initialised (gloo or nccl)")
        self.group = group if group is not None else dist.group.WORLD
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if grad_group is not None:
            _check_grad_group(grad_group, self.group)
        self.grad_group = grad_group
        self.num_experts, self.backend, self.payload, self.chunks = num_experts, backend, payload, chunks
        self.experts_per_rank = check_num_experts(num_experts, self.world_size)
        self.topology = make_topology(self.world_size, gpus_per_node)
        self.meter = TrafficMeter()
        self.channels, self.grad_channels = self._transports(hops, exchange == "device_split")
        self.fp8_rows = fp8_rows
        self.codec = (FP8_WIRE_CODEC if fp8_rows else FP8_CODEC) if payload == "fp8" else None
        self._device: torch.device | None = None
        self.exchange, self.headroom, self.tokens = exchange, float(headroom), tokens
        # [] int64 on the device: 1 when a dispatch since take_overflow left rows out
        self._overflow: Tensor | None = None

    def padded_bounds(self, tokens: int, top_k: int) -> tuple[list[int], int]:
        """dispatch.routes.padded_bounds of this rank's hops, headroom and chunks."""
        stages = routes_for(self.backend, self.topology, self.num_experts, self.rank, torch.device("meta"))
        return padded_bounds(stages, self.experts_per_rank, tokens, top_k, self.headroom, self.chunks)

    def grow(self) -> None:
        """Double the padded bounds' headroom (after an overflow), for the dispatches after this call."""
        self.headroom *= 2

    def take_overflow(self, device: torch.device) -> Tensor:
        """[] int64 on device: 1 when a padded dispatch overflowed since the last call, else 0; restarts the flag. No
        host read: the caller sends it with the step's statistics."""
        if self._overflow is None:
            return torch.zeros((), dtype=torch.int64, device=device)
        flag = self._overflow.clone()
        self._overflow.zero_()
        return flag

    def _flag(self, *overflows: Tensor) -> None:
        """Raise the overflow flag where one of overflows is set (in place: the same operators every call)."""
        for overflow in overflows:
            self._overflow.bitwise_or_(overflow.long())

    def _transports(self, hops: HopGroups | None, split: bool) -> tuple[list[HopTransport], list[HopTransport]]:
        """Per hop, the transports of forward and of gradient exchanges (the same ones without a grad_group); split:
        device-split ones (dispatch.device_split), which also run the exact exchange of a rerun."""
        stages = routes_for(self.backend, self.topology, self.num_experts, self.rank, torch.device("meta"))
        members = list(range(self.world_size))  # the EP group's ranks, for hops run on it
        if self.backend == "flat" or hops is None:
            groups, wide = [(self.group, self.grad_group)] * len(stages), members
        else:
            groups, wide = [(hops.rail, hops.rail_grad), (hops.node, hops.node_grad)], None
            for stage, (forward, grad) in zip(stages, groups):
                check_hop_group(forward, stage.name, self.group, stage.peers)
                if self.grad_group is not None:
                    check_hop_group(grad, f"{stage.name}_grad", self.group, stage.peers)
        made = [[transport_for(g, self.topology, self.meter, stage.peers, self.rank, stage.name, wide)
                 for g in pair if g is not None] for stage, pair in zip(stages, groups)]
        if split:
            made = [[DeviceSplit(t) for t in pair] for pair in made]
        return [pair[0] for pair in made], [pair[-1] for pair in made]

    @property
    def concurrent_backward(self) -> bool:
        """Whether a backward through this dispatcher may run on another thread while a forward
        dispatches: true when grad exchanges have their own grad_group."""
        return self.grad_channels[0] is not self.channels[0]

    @property
    def last_bytes(self) -> dict[str, Traffic]:
        """Traffic of the latest call of each kind ("dispatch", "combine", and their "_backward")."""
        return self.meter.last

    @property
    def total_bytes(self) -> dict[str, Traffic]:
        """Traffic summed over all calls, by kind."""
        return self.meter.total

    def _tables(self, device: torch.device):
        if self._device != device:
            owner = expert_owner(self.num_experts, self.world_size, device)
            local = torch.arange(self.num_experts, device=device) - self.rank * self.experts_per_rank
            self._local_expert = torch.where(owner == self.rank, local, -1)
            self._stages = routes_for(self.backend, self.topology, self.num_experts, self.rank, device)
            self._overflow = torch.zeros((), dtype=torch.int64, device=device)
            self._device = device
        return self._stages, self._local_expert

    def dispatch_steps(self, x: Tensor, indices: Tensor, weights: Tensor) -> Steps:
        """dispatch as a generator that yields each exchange while it is in flight (see
        dispatch.channel.Steps); returns what dispatch returns."""
        check_routing(indices, self.num_experts, weights, x)
        stages, local_expert = self._tables(x.device)
        self.meter.start("dispatch")
        route = Route()
        plan = None
        if x.is_meta:  # a rehearsal: the counts the routing would give come from the rule (dispatch.rehearsal_rule)
            plan = rehearsal_rule.plan_dispatch(x.shape[0], indices.shape[1], self.num_experts, self.topology,
                                                self.rank, self.backend, rehearsal_rule.capacity_of(indices))
        if self.exchange != "exact":
            if self.tokens is not None and x.shape[0] > self.tokens:
                raise ValueError(f"{x.shape[0]} tokens to dispatch, more than the padded bounds' tokens = "
                                 f"{self.tokens}")
            bounds, expert_rows = self.padded_bounds(self.tokens or x.shape[0], indices.shape[1])
            arrived, overflow = yield from padded_dispatch_steps(x, weights, indices, stages, self.channels,
                                                                 self.codec, route, bounds, self.chunks)
        else:
            arrived = yield from dispatch_steps(x, weights, indices, stages, self.channels, self.codec, route,
                                                self.chunks, plan.sends if plan else None)
        wire = arrived[0]
        if self.fp8_rows:  # autograd sees a zero-stride stand-in of the dequantised rows (never read)
            arrived = (x.new_zeros(()).expand(wire.shape[0], x.shape[1]), arrived[1])
        rows, recv_weights = DispatchRows.apply(x, weights, arrived, route, self.grad_channels)
        if self.exchange != "exact":
            perm, too_many = make_padded_permutation(lookup(route.ids, local_expert), self.experts_per_rank,
                                                     expert_rows)
            self._flag(overflow, too_many)
        else:
            perm = make_permutation(lookup(route.ids, local_expert), self.experts_per_rank,
                                    plan.expert_rows if plan else None)
        info = RecvInfo(perm.counts, rows.shape[0])
        out = permute(rows, perm)
        if self.fp8_rows:
            out = FP8Rows(*split_fp8(wire, x.shape[1], perm.row), out)
        return out, info, EPHandle(route, perm, recv_weights, x.shape[0])

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> tuple[Tensor | FP8Rows, RecvInfo, EPHandle]:
        """Rows of x for this rank's experts, one per (received token, local expert), grouped by expert
        (FP8Rows with fp8_rows)."""
        return run_steps(self.dispatch_steps(x, indices, weights))

    def row_weights(self, handle: EPHandle) -> Tensor:
        """[rows] the combine weight of each row dispatch handed out (differentiable: its grad reaches the
        routing weights on their source ranks), for experts that apply it themselves (combine's weighted=False)."""
        return handle.recv_weights[handle.perm.row, handle.perm.slot]

    def combine_steps(self, y: Tensor, handle: EPHandle, weighted: bool = True) -> Steps:
        """combine as a generator that yields each exchange while it is in flight; returns what
        combine returns."""
        if y.dim() != 2 or y.shape[0] != handle.perm.row.numel():
            raise ValueError(f"y must be [{handle.perm.row.numel()}, hidden] (one row per dispatched row), "
                             f"got shape {list(y.shape)}")
        self.meter.start("combine")
        weights = handle.recv_weights if weighted else None
        partial, dtype = unpermute(y, handle.perm, weights, y.dtype), y.dtype  # one partial sum per row, as sent
        del y  # the rows are freed here unless unpermute keeps them for the weights' grad (weighted)
        summed = yield from gather_steps(partial.detach(), handle.route, self.channels, "combine", dtype)
        return CombineRows.apply(partial, summed, handle.route, self.grad_channels)

    def combine(self, y: Tensor, handle: EPHandle, weighted: bool = True) -> Tensor:
        """out[t] = sum_k weights[t, k] * y(row of t for expert k); dropped slots add nothing. weighted=False: the
        plain sum over k (the experts applied the weights, row_weights), which keeps nothing of y for backward."""
        return run_steps(self.combine_steps(y, handle, weighted))
