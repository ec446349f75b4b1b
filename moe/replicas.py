"""Redundant experts for training (parallel.redundant_experts): spare expert slots on every EP rank hold copies of
hot experts, so that a skewed routing no longer makes one rank the straggler of every all-to-all.

Physical slots: each EP rank holds experts_per_rank owned experts (the contiguous block it always held) followed by
`spares` replica slots: physical slot p = rank * (experts_per_rank + spares) + i. Owners never move: the optimizer
state, the checkpoint and resharding see the owned experts only, as without replicas. A placement (which logical
expert each replica slot copies, -1 for none) is the same on every rank: place() computes it on the host from loads
every rank holds (the step's all-reduced loads, already copied to the host with the step's statistics), and its
device tables map routed slots to physical slots without a host sync (physical_indices). The dispatch then sees
ep x (experts_per_rank + spares) physical experts; the router, its bias and its balance losses stay on logical
experts. A replicated expert's rows are split over its copies by each row's position among the source rank's rows
of that expert (offset by the source rank), so each copy gets an even share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from dispatch.layout import count_ids


@dataclass(frozen=True)
class SlotLayout:
    """The physical slots of an EP group: owned experts then spares on each rank."""

    num_experts: int  # logical experts E
    ep: int           # EP ranks
    spares: int       # replica slots per rank (parallel.redundant_experts)

    @property
    def owned(self) -> int:
        """Logical experts each rank owns."""
        return self.num_experts // self.ep

    @property
    def per_rank(self) -> int:
        """Physical slots per rank."""
        return self.owned + self.spares

    @property
    def num_slots(self) -> int:
        """Physical slots of the EP group."""
        return self.ep * self.per_rank

    def owner(self, expert: int) -> int:
        """The EP rank owning a logical expert."""
        return expert // self.owned

    def owner_slot(self, expert: int) -> int:
        """The physical slot of a logical expert's owned copy."""
        return self.owner(expert) * self.per_rank + expert % self.owned

    def spare_slot(self, rank: int, index: int) -> int:
        """The physical slot of spare `index` of `rank`."""
        return rank * self.per_rank + self.owned + index


def check_slots(num_experts: int, ep: int, spares: int) -> SlotLayout:
    """The SlotLayout, or ValueError naming parallel.redundant_experts when it is out of range."""
    if num_experts % ep:
        raise ValueError(f"num_experts = {num_experts} must be divisible by the EP size {ep}")
    owned = num_experts // ep
    if not isinstance(spares, int) or not 0 <= spares <= owned:
        raise ValueError(f"parallel.redundant_experts = {spares!r} must be an integer in [0, {owned}] (at most the "
                         f"experts per EP rank, {num_experts} / {ep})")
    return SlotLayout(num_experts, ep, spares)


def default_placement(layout: SlotLayout) -> list[int]:
    """Every spare slot empty (-1): the layout before any loads were seen. Indexed [rank * spares + index]."""
    return [-1] * (layout.ep * layout.spares)


def copies_of(layout: SlotLayout, placement: list[int]) -> list[list[int]]:
    """For each logical expert, its physical slots: the owned one first, then its replicas in slot order."""
    copies = [[layout.owner_slot(e)] for e in range(layout.num_experts)]
    for spare, expert in enumerate(placement):
        if expert >= 0:
            copies[expert].append(layout.spare_slot(spare // layout.spares, spare % layout.spares))
    return copies


def rank_loads(layout: SlotLayout, placement: list[int], loads: np.ndarray) -> np.ndarray:
    """[ep] rows each rank receives when every expert's load is split evenly over its copies."""
    share = np.asarray(loads, dtype=np.float64) / np.array([len(c) for c in copies_of(layout, placement)])
    out = np.zeros(layout.ep)
    for expert, slots in enumerate(copies_of(layout, placement)):
        for slot in slots:
            out[slot // layout.per_rank] += share[expert]
    return out


def place(layout: SlotLayout, loads: np.ndarray, node_size: int = 0) -> list[int]:
    """A placement of the spare slots for loads [E] (rows per logical expert over a window), deterministic (the same
    on every rank given the same loads): while a spare slot is free, take the busiest rank and, among the experts
    it holds a copy of, the one with the largest per-copy share that a copy on the least loaded rank with a free
    slot (and no copy of it yet) would relieve; stop when no such copy lowers the busiest of the ranks it touches.
    Owners stay where they are. node_size > 0 (EP ranks per node, node-limited routing over several nodes): a
    replica only on its owner's node, so a token reaches no node its group-limited routing did not choose."""
    loads = np.asarray(loads, dtype=np.float64)
    placement = default_placement(layout)
    free = {r: list(range(layout.spares)) for r in range(layout.ep)}
    holders = [{layout.owner(e)} for e in range(layout.num_experts)]
    while any(free.values()):
        count = np.array([len(h) for h in holders], dtype=np.float64)
        load = np.zeros(layout.ep)
        for e, ranks in enumerate(holders):
            for r in ranks:
                load[r] += loads[e] / count[e]
        busiest = int(np.argmax(load))
        best = None
        for e in sorted((e for e in range(layout.num_experts) if busiest in holders[e]),
                        key=lambda e: (-loads[e] / count[e], e)):
            open_ranks = [r for r in range(layout.ep) if free[r] and r not in holders[e]
                          and (not node_size or r // node_size == layout.owner(e) // node_size)]
            if not open_ranks:
                continue
            target = min(open_ranks, key=lambda r: (load[r], r))
            relief = loads[e] / count[e] - loads[e] / (count[e] + 1)
            if max(load[busiest] - relief, load[target] + loads[e] / (count[e] + 1)) < load[busiest]:
                best = (e, target)
                break
        if best is None:
            break
        e, target = best
        placement[target * layout.spares + free[target].pop(0)] = e
        holders[e].add(target)
    return placement


def slot_tables(layout: SlotLayout, placement: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """Device tables of a placement: copies [E] int64 (copies per logical expert) and slots [E, ep] int64 (their
    physical slots, padded with the owned slot)."""
    copies = copies_of(layout, placement)
    table = [c + [c[0]] * (layout.ep - len(c)) for c in copies]
    return (torch.tensor([len(c) for c in copies], dtype=torch.int64, device=device),
            torch.tensor(table, dtype=torch.int64, device=device))


def physical_indices(indices: Tensor, copies: Tensor, slots: Tensor, source_rank: int) -> Tensor:
    """Routed logical experts indices [T, k] (-1: dropped) -> physical slots [T, k] (-1 kept): the n-th routed slot of
    expert e on this source rank (token-major order) goes to copy (n + source_rank) mod copies[e]. On the device,
    no host sync."""
    flat = indices.reshape(-1)
    expert = flat.clamp(min=0)
    order = torch.argsort(flat, stable=True)
    counts = count_ids(flat, copies.numel())
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[expert[order]]
    copy = (position + source_rank) % copies[expert]
    return torch.where(flat >= 0, slots[expert, copy], -1).view_as(indices)


class ExpertReplicas:
    """One MoE layer's spare slots on this EP rank: the placement (a list, the same on every rank; its tensor form is
    the layer's `replica_placement` buffer, which checkpoints keep), its device tables, the replicas' weights (leaf
    tensors that take grads but are no parameters: the optimizer and the checkpoint see the owners only), and the
    two exchanges over the EP group: refresh (owners' weights to their replicas, after each optimizer step and each
    placement) and fold_grads (replicas' grads summed into their owners', before the grad reduction)."""

    def __init__(self, layout: SlotLayout, rank: int, group: dist.ProcessGroup | None, node_size: int = 0) -> None:
        self.layout, self.rank, self.group = layout, rank, group
        self.node_size = node_size  # EP ranks per node whose replicas must stay on their owner's node; 0: anywhere
        self.placement = default_placement(layout)
        self.tables: tuple[Tensor, Tensor] | None = None
        self.weights: list[Tensor] = []  # the replicas of w_gate_up [spares, 2F, H] and w_down [spares, H, F]

    def attach(self, owned: list[Tensor]) -> None:
        """Make the replicas' weights beside the owned weights (same dtype and device; zero until refresh)."""
        self.weights = [w.new_zeros(self.layout.spares, *w.shape[1:]).requires_grad_(w.requires_grad) for w in owned]
        self.tables = slot_tables(self.layout, self.placement, owned[0].device)

    def set_placement(self, placement: list[int]) -> None:
        """Use placement from now on (the device tables follow)."""
        self.placement = list(placement)
        self.tables = slot_tables(self.layout, self.placement, self.weights[0].device)

    def place(self, loads: np.ndarray) -> list[int]:
        """The placement for window loads [E] (place), replicas kept on their owner's node when node_size says so."""
        return place(self.layout, loads, self.node_size)

    def route(self, indices: Tensor) -> Tensor:
        """Routed logical experts [T, k] -> physical slots (physical_indices), on the device."""
        return physical_indices(indices, *self.tables, self.rank)

    def _pairs(self) -> list[tuple[int, int, int]]:
        """(replica holder, spare index, expert) of every used spare slot whose owner or holder is this rank, in
        (holder, spare index) order: the order both exchanges pack rows in."""
        out = []
        for spare, expert in enumerate(self.placement):
            holder = spare // self.layout.spares
            if expert >= 0 and self.rank in (holder, self.layout.owner(expert)):
                out.append((holder, spare % self.layout.spares, expert))
        return out

    def _splits(self, pairs: list[tuple[int, int, int]], sending_owned: bool) -> tuple[list[int], list[int]]:
        """Rows this rank sends to and receives from each EP rank: owners send (refresh) or receive (fold)."""
        to_holders = [sum(1 for h, _, e in pairs if h == r and self.layout.owner(e) == self.rank)
                      for r in range(self.layout.ep)]
        from_owners = [sum(1 for h, _, e in pairs if h == self.rank and self.layout.owner(e) == r)
                       for r in range(self.layout.ep)]
        return (to_holders, from_owners) if sending_owned else (from_owners, to_holders)

    @torch.no_grad()
    def refresh(self, owned: list[Tensor]) -> None:
        """Copy every owner's weights (owned: this rank's w_gate_up, w_down) into their replicas on every rank."""
        if owned[0].is_meta:  # a rehearsal: no values to copy
            return
        pairs = self._pairs()
        send, recv = self._splits(pairs, sending_owned=True)
        flat = torch.cat([w.flatten(1) for w in owned], dim=1)
        rows = [flat[e % self.layout.owned] for h, _, e in sorted(pairs) if self.layout.owner(e) == self.rank]
        out = flat.new_empty(sum(recv), flat.shape[1])
        _exchange(out, rows, flat, recv, send, self.group)
        mine = [i for h, i, e in sorted(pairs, key=lambda p: (self.layout.owner(p[2]), p[1])) if h == self.rank]
        for weight, part in zip(self.weights, out.split([w[0].numel() for w in owned], dim=1)):
            weight.zero_()
            if mine:
                weight[mine] = part.view(len(mine), *weight.shape[1:])

    @torch.no_grad()
    def fold_grads(self, owned_grads: list[Tensor]) -> None:
        """Add every replica's grad (accumulated since the last fold) into its owner's grad (owned_grads: this rank's
        grads of w_gate_up and w_down, as the optimizer holds them); the replicas' grads are cleared."""
        grads = [w.grad if w.grad is not None else torch.zeros_like(w) for w in self.weights]
        for w in self.weights:
            w.grad = None
        if owned_grads[0].is_meta:
            return
        pairs = self._pairs()
        send, recv = self._splits(pairs, sending_owned=False)
        flat = torch.cat([g.flatten(1) for g in grads], dim=1).to(owned_grads[0].dtype)
        rows = [flat[i] for h, i, e in sorted(pairs, key=lambda p: (self.layout.owner(p[2]), p[1]))
                if h == self.rank]
        out = flat.new_empty(sum(recv), flat.shape[1])
        _exchange(out, rows, flat, recv, send, self.group)
        local = torch.tensor([e % self.layout.owned for h, _, e in sorted(pairs) if self.layout.owner(e) == self.rank],
                             dtype=torch.int64, device=out.device)
        for grad, part in zip(owned_grads, out.split([g[0].numel() for g in owned_grads], dim=1)):
            grad.index_add_(0, local, part.reshape(len(local), *grad.shape[1:]))


def _exchange(out: Tensor, rows: list[Tensor], like: Tensor, out_splits: list[int], in_splits: list[int],
              group: dist.ProcessGroup | None) -> None:
    """all_to_all_single of rows (packed by destination rank) into out (packed by source rank), sizes host-known."""
    send = torch.stack(rows) if rows else like.new_empty(0, like.shape[1])
    dist.all_to_all_single(out, send, out_splits, in_splits, group=group)
