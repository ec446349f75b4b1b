"""One param group's flat buffers and collectives: grads reduce-scattered in, params all-gathered out."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from dispatch.pending import Pending, wait_all
from optim.ema import EMA_KEY
from optim.flat_layout import Bucket, FlatLayout

# torch 2.13 renamed the flat collectives (the old names warn there); torch 2.11-2.12 have only the old ones.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

CHUNK = 2**20
P2P_TAG = 0x2E01  # ZeroOptimizer's own tag: other p2p traffic on the group cannot match its messages
MASTER_KEY = "master"


@dataclass(frozen=True)
class Piece:
    """A run of one param's flattened elements that this rank's shard holds, with views of its state there.

    state maps "master", every elementwise entry of the inner optimizer's state (AdamW: exp_avg,
    exp_avg_sq) and, when kept, "ema" (the host EMA of the master, optim.ema) to a 1-D view of `length`
    elements of the live tensors (no copy); scalars are the live
    per-chunk entries (AdamW's step), shared by the other pieces of the same chunk.
    """

    param: torch.Tensor
    start: int
    length: int
    state: dict[str, torch.Tensor]
    scalars: dict[str, torch.Tensor]


class ShardedParams:
    """Model params of one group re-pointed into a flat buffer, with this rank's fp32 master shard
    (fp64 for fp64 params: masters, grad sums and reductions are never narrower than fp32 or the params).

    The model params become views of one flat buffer (their dtype), so the all-gather of the
    updated shards writes straight into them. fp32 params are their own masters: a bucket's
    master is this rank's slice of the flat params, so the update writes the model in place
    (and model.load_state_dict() reaches the masters); other dtypes get fp32 copies.
    Gradients are summed over micro-batches and reduced in a flat fp32 buffer: fp32 params get
    their .grad bound to views of it (a grad hook moves the first grad after zero_grad in), so
    backward accumulates in place and the reduce needs no copy; for other dtypes the hook adds
    each backward's grad to the fp32 sum and drops it. Each bucket has its own inner
    optimizer, so a bucket's gather overlaps the next bucket's update; it sees its shard as
    chunks of CHUNK elements (leaf params aliasing the master), which torch's CPU for-loop AdamW
    runs faster than one large tensor (timings: docs/parallelism.md, ZeRO).

    Collectives per bucket: "scatter_gather" is one reduce_scatter_single in and one
    all_gather_single out (NCCL, and what "auto" picks off gloo). "p2p" (what "auto" picks on
    gloo) is a direct exchange: every rank isends each peer that peer's piece of the bucket and
    irecvs its own piece from every peer into a receive row (N-1 rows of a shard), then adds them
    onto its own piece in peer order; the gather is the same exchange of the updated pieces into
    the flat params. Either way the reduction is in place: the reduced grads are this rank's own
    pieces of the full fp32 buffers (self.reduced), which the inner optimizers read. Both move (N-1)/N of the bucket each way per rank, as
    ring collectives do; on gloo the exchange is the faster of the two (timings:
    docs/parallelism.md, ZeRO).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], group: ProcessGroup | None,
                 bucket_cap: int, grad_divisor: float, collectives: str, shard_grads: bool = False,
                 shard_params: bool = False, host: torch.device | None = None,
                 state_dtype: torch.dtype | None = None) -> None:
        self.params = list(params)
        self.group = group
        self.grad_divisor = grad_divisor
        self.shard_grads = shard_grads
        self.shard_params = shard_params
        self.host = host
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if collectives == "auto":
            collectives = "p2p" if dist.get_backend(group) == "gloo" else "scatter_gather"
        self.collectives = collectives
        self.peers = [r for r in range(world) if r != rank]
        self.layout = FlatLayout.build([p.shape for p in self.params], world, rank, bucket_cap)
        dtype = self.params[0].dtype
        self.master_dtype = torch.promote_types(dtype, torch.float32)
        self.state_dtype = state_dtype or self.master_dtype
        with torch.no_grad():
            self.param_flat = self.layout.flatten([p.detach() for p in self.params], dtype)
            for p, view in zip(self.params, self.layout.views(self.param_flat)):
                p.data = view
            owned = [self.param_flat[b.owned] for b in self.layout.buckets]
            if host is not None:  # ZeRO-Offload: masters (and so the optimizer state) in host memory
                self.masters = [_host_buffer(o.numel(), self.master_dtype, host, o.device) for o in owned]
                for master, o in zip(self.masters, owned):
                    master.copy_(o)
            else:
                self.masters = (owned if dtype == self.master_dtype and not shard_params
                                else [o.to(self.master_dtype, copy=True) for o in owned])
        device = self.param_flat.device
        self.grad_buckets = [torch.zeros(b.numel, dtype=self.master_dtype, device=device) for b in self.layout.buckets]
        self.grad_views = self.layout.bucket_views(self.grad_buckets)
        self.binds_grads = dtype == self.master_dtype and not shard_grads
        # every reduction is in place: a bucket's sums over the group land in this rank's own piece of its full
        # buffer. ZeRO-1 keeps them there (no separate reduced shard); ZeRO-2 adds them to its grad shard, which sums
        # the reductions of every backward while the full buffers are freed in between
        self.grad = (torch.zeros(self.layout.shard_numel, dtype=self.master_dtype, device=device) if shard_grads
                     else None)
        self.reduced = [self.grad[b.shard] if shard_grads else flat[b.local_piece(b.rank)]
                        for flat, b in zip(self.grad_buckets, self.layout.buckets)]
        # the inner optimizers' grads: the reduced pieces themselves, or (offload) their host copy
        self.host_grad = (None if host is None
                          else _host_buffer(self.layout.shard_numel, self.master_dtype, host, device))
        self.bucket_chunks = [self._chunks(m, reduced if host is None else self.host_grad[b.shard])
                              for m, reduced, b in zip(self.masters, self.reduced, self.layout.buckets)]
        self.optims: list[torch.optim.Optimizer] = []
        # p2p receive rows, one per peer (the exchange cannot receive into the own piece, which holds this rank's
        # sums until they are added up); scatter_gather reduces in place and needs none
        rows = len(self.peers) if collectives == "p2p" else 0
        self._scratch = torch.empty(rows, self.layout.shard_numel, dtype=self.master_dtype, device=device)
        self.launched: set[int] = set()  # buckets whose reduction started and is not finished
        self._works: dict[int, Pending] = {}  # bucket -> its reduction in flight
        self._gathering: list[Pending] = []  # ZeRO-3: the gathers in flight into the full params
        self.zero_grad(set_to_none=False)
        self.bucket_params = [[i for i, b in enumerate(self.layout.bucket_of) if b == bucket]
                              for bucket in range(len(self.layout.buckets))]
        self._stored: dict[tuple[torch.Tensor, str], torch.Tensor] = {}  # narrow state entries during a step
        self.ema_values: list[torch.Tensor] | None = None  # per bucket: the host EMA of its master (optim.ema), if kept
        self.listener: Callable[[int], None] | None = None  # told each param index whose grad came in
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
        if shard_params:
            self.release()

    def gather(self) -> None:
        """ZeRO-3: give the params their storage back and start all-gathering the masters into them (held here, in
        flight, until gathered() or release())."""
        self.gathered()
        storage = self.param_flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.param_flat.numel() * self.param_flat.element_size())
        self._gathering = [self._gather_bucket(self.param_flat, master, b)
                           for master, b in zip(self.masters, self.layout.buckets)]

    def gathered(self) -> None:
        """ZeRO-3: wait for the gathers gather() started: the full params are in place."""
        wait_all(self._gathering)
        self._gathering = []

    def release(self) -> None:
        """ZeRO-3: free the full params' storage (the params keep their shapes; gather() brings the values back),
        once no gather writes into it."""
        self.gathered()
        self.param_flat.untyped_storage().resize_(0)

    @staticmethod
    def _chunks(master: torch.Tensor, grad: torch.Tensor) -> list[torch.nn.Parameter]:
        """Leaf params of at most CHUNK elements aliasing a bucket's master, grads aliasing grad."""
        chunks = []
        for start in range(0, master.numel(), CHUNK):
            chunk = torch.nn.Parameter(master[start:start + CHUNK])
            chunk.grad = grad[start:start + CHUNK]
            chunks.append(chunk)
        return chunks

    def build_optimizers(self, optimizer_class: type[torch.optim.Optimizer],
                         hyper: dict[str, Any], defaults: dict[str, Any]) -> None:
        """One inner optimizer per bucket, so each bucket's gather starts as soon as it is updated."""
        self.optims = [optimizer_class([{**hyper, "params": chunks}], **defaults)
                       for chunks in self.bucket_chunks]
        if self.state_dtype != self.master_dtype:  # state stored narrower: widened around each step (fp32 update)
            for optim, chunks in zip(self.optims, self.bucket_chunks):
                optim.register_step_pre_hook(functools.partial(self._widen, chunks))
                optim.register_step_post_hook(functools.partial(self._narrow, chunks))

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop fp32 grads (set_to_none) or bind them to the zeroed bucket buffers; zero the sums. With
        shard_grads (ZeRO-2) the full buffers are freed instead (each comes back, zeroed, with its first grad)
        and the grad shard, which sums the reductions of every backward, is zeroed. A reduction in flight is
        waited for first (it reads and writes the buffers zeroed or freed here) and its result dropped."""
        wait_all(self._works.values())
        self._works.clear()
        self.launched.clear()
        if self.shard_grads:
            self.grad.zero_()
            for b in range(len(self.grad_buckets)):
                self._free(b)
        elif not (set_to_none and self.binds_grads):
            for buffer in self.grad_buckets:
                buffer.zero_()
        for p, view in zip(self.params, self.grad_views):
            p.grad = view if self.binds_grads and not set_to_none else None

    def _free(self, b: int) -> None:
        """Release bucket b's full grad buffer (its views stay valid for _hold); no reduction of it is in flight."""
        if b in self._works:
            raise RuntimeError(f"bucket {b}'s grad buffer freed while its reduction is in flight")
        self.grad_buckets[b].untyped_storage().resize_(0)

    def _hold(self, b: int) -> None:
        """Give bucket b's full grad buffer its storage back, zeroed, if it was freed."""
        buffer = self.grad_buckets[b]
        if buffer.untyped_storage().nbytes() == 0:
            buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
            buffer.zero_()

    def _collect(self, i: int) -> None:
        """Move param i's .grad into the flat fp32 buffer: fp32 by copy and rebinding (zero for
        None), other dtypes added to the running fp32 sum and dropped."""
        p, view = self.params[i], self.grad_views[i]
        if not self.binds_grads:
            if p.grad is not None:
                self._hold(self.layout.bucket_of[i])
                view.add_(p.grad)
                p.grad = None
        elif p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def local_grad(self, i: int) -> torch.Tensor:
        """Param i's local (not yet reduced) grad sum: its view of the flat fp32 buffer, whatever its dtype."""
        self._hold(self.layout.bucket_of[i])
        self._collect(i)
        return self.grad_views[i]

    def _on_grad(self, i: int, _param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: move the grad into the flat buffer (see _collect), tell the listener."""
        if self.layout.bucket_of[i] in self.launched:
            raise RuntimeError("a grad arrived for a bucket already being reduced: wrap only the "
                               "last backward before step() in reduce_during_backward()")
        self._collect(i)
        if self.listener is not None:
            self.listener(i)

    def launch(self, bucket: int) -> None:
        """Start reducing a bucket's grad sums (its params' grads collected first: none is zero)."""
        self._hold(bucket)
        for i in self.bucket_params[bucket]:
            self._collect(i)
        self._works[bucket] = self._start_reduce(bucket)
        self.launched.add(bucket)

    def _start_reduce(self, bucket: int) -> Pending:
        """Start reducing a bucket's grad sums in place: rank r's piece of the sums ends up in rank r's own piece of
        its full buffer (scatter_gather: the reduce-scatter's output is that view of its input; p2p: the peers'
        pieces arrive in the receive rows, added in _finish)."""
        b, flat = self.layout.buckets[bucket], self.grad_buckets[bucket]
        if self.collectives == "scatter_gather":
            own = flat[b.local_piece(b.rank)]
            return Pending(_reduce_scatter_flat(own, flat, group=self.group, async_op=True), keep=(own, flat))
        return self._exchange([flat[b.local_piece(r)] for r in self.peers], [row[b.shard] for row in self._scratch])

    def _exchange(self, outgoing: list[torch.Tensor], incoming: list[torch.Tensor]) -> Pending:
        """Send outgoing[k] to the k-th peer and receive incoming[k] from it (p2p collectives)."""
        works = []
        for r, out, into in zip(self.peers, outgoing, incoming):
            works += [dist.isend(out, group=self.group, group_dst=r, tag=P2P_TAG),
                      dist.irecv(into, group=self.group, group_src=r, tag=P2P_TAG)]
        return Pending(works, keep=(*outgoing, *incoming))

    def _finish(self, i: int) -> None:
        """Wait for bucket i's reduction (if pending), add up its pieces in place (p2p: the peers' rows onto the own
        piece, in peer order), divide by grad_divisor (ZeRO-2: add the result to the grad shard and free the bucket's
        full buffer)."""
        if i not in self._works:
            return
        self._works.pop(i).wait()
        b = self.layout.buckets[i]
        own = self.grad_buckets[i][b.local_piece(b.rank)]
        for row in self._scratch:
            own.add_(row[b.shard])
        own.div_(self.grad_divisor)
        if self.shard_grads:
            self.grad[b.shard].add_(own)
            self._free(i)

    def finish_completed(self) -> None:
        """Finish the reductions whose collectives are done (ZeRO-2: their full buffers are freed now)."""
        for i in [i for i, pending in self._works.items() if pending.is_completed()]:
            self._finish(i)

    def finish_reduce(self) -> None:
        """Wait for every started reduction; this rank's pieces of the grad sums / grad_divisor are in self.reduced."""
        for i in reversed(range(len(self.layout.buckets))):
            self._finish(i)
        self.launched.clear()

    def _gather_bucket(self, out_flat: torch.Tensor, piece: torch.Tensor, b: Bucket) -> Pending:
        """Start gathering every rank's piece of bucket b into out_flat.

        piece is this rank's part, in place already when it is a view of out_flat[b.owned].
        """
        piece = piece.detach().to(out_flat.device, out_flat.dtype, non_blocking=True)  # offload: pinned host -> GPU
        if self.collectives == "scatter_gather":
            full = out_flat[b.full]
            return Pending(_all_gather_flat(full, piece, group=self.group, async_op=True), keep=(full, piece))
        if piece.data_ptr() != out_flat[b.owned].data_ptr():
            out_flat[b.owned].copy_(piece)
        return self._exchange([piece] * len(self.peers), [out_flat[b.piece(r)] for r in self.peers])

    def step(self, hyper: dict[str, Any]) -> None:
        """Per bucket in reduction order: finish its reduction, update it, start its gather. Offloaded: every
        bucket's grad shard is first copied to the host (all started at once, non-blocking into pinned memory on
        CUDA), a bucket updated on the host as soon as its copy is in, its params copied back as the gather's
        input (one copy each way per bucket and step)."""
        gathers = []
        arrived = {}
        if self.host is not None:
            for i in reversed(range(len(self.layout.buckets))):
                self._finish(i)
                shard = self.layout.buckets[i].shard
                self.host_grad[shard].copy_(self.reduced[i], non_blocking=True)
                arrived[i] = _copied(self.reduced[i].device)
        for i in reversed(range(len(self.layout.buckets))):
            self._finish(i)
            if i in arrived and arrived[i] is not None:
                arrived[i].synchronize()  # host sync by design: the host's update reads the grad shard just copied
            optim = self.optims[i]
            optim.param_groups[0].update(hyper)
            optim.step()
            if not self.shard_params:  # ZeRO-3 gathers a param where it is used next
                gathers.append(self._gather_bucket(self.param_flat, self.masters[i], self.layout.buckets[i]))
        wait_all(gathers)
        self.launched.clear()

    def _widen(self, chunks: Sequence[torch.nn.Parameter], optim: torch.optim.Optimizer, *_: Any) -> None:
        """Step pre-hook of an inner optimizer whose elementwise state (AdamW's moments) is stored in a narrower
        state_dtype: hand it each entry widened to the master dtype (exactly), keeping the stored tensor."""
        for chunk in chunks:
            entry = optim.state.get(chunk, {})
            for key, value in entry.items():
                if _elementwise(value, chunk):
                    self._stored[chunk, key] = value
                    entry[key] = value.to(self.master_dtype)

    def _narrow(self, chunks: Sequence[torch.nn.Parameter], optim: torch.optim.Optimizer, *_: Any) -> None:
        """Step post-hook (see _widen): store each entry back in state_dtype, rounded once per step (the widened
        copies, one bucket's shard per entry, lived only during the step). A per-optimizer hook runs before the
        global ones, so memory trackers hooked there (the rehearsal's) see the stored state."""
        for chunk in chunks:
            entry = optim.state[chunk]
            for key, value in entry.items():
                if _elementwise(value, chunk):
                    stored = self._stored.pop((chunk, key), None)
                    entry[key] = value.to(self.state_dtype) if stored is None else stored.copy_(value)

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """A new flat buffer (the shard's dtype) holding every rank's piece of a shard-shaped tensor."""
        out = torch.empty(self.layout.total, dtype=shard.dtype, device=shard.device)
        wait_all([self._gather_bucket(out, shard[b.shard], b) for b in self.layout.buckets])
        return out

    def set_params(self, full: torch.Tensor) -> None:
        """Set the model params (unless ZeRO-3 freed them) and this rank's masters from a full flat buffer."""
        if not self.shard_params:
            self.param_flat.copy_(full)
        for master, b in zip(self.masters, self.layout.buckets):
            master.copy_(full[b.owned])

    def sq_norm(self) -> torch.Tensor:
        """Sum of squares (float64, shape [1]) of this rank's reduced grads (ZeRO-2: its grad shard; ZeRO-1: its
        pieces, one per bucket)."""
        pieces = [self.grad] if self.shard_grads else self.reduced
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in pieces])
        return norms.square().sum().reshape(1)

    def scale_grads(self, coef: torch.Tensor) -> None:
        """Multiply this rank's reduced grads by coef (on the device: no host sync)."""
        for grad in [self.grad] if self.shard_grads else self.reduced:
            grad.mul_(coef)

    def chunk_states(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """(chunk, its inner-optimizer state) for every chunk, in shard order."""
        return [(c, optim.state.get(c, {}))
                for optim, chunks in zip(self.optims, self.bucket_chunks) for c in chunks]

    def get_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The inner optimizers' state of this shard: shard-shaped entries (chunks joined), scalars."""
        states = self.chunk_states()
        first_chunk, first = states[0]
        keys = [k for k, v in first.items() if torch.is_tensor(v) and v.shape == first_chunk.shape]
        elementwise = {k: torch.cat([state[k] for _, state in states]) for k in keys}
        return elementwise, {k: v for k, v in first.items() if k not in keys}

    def pieces(self) -> list[Piece]:
        """This rank's runs of every param's elements, cut at the inner optimizers' chunk boundaries (see Piece)."""
        out = []
        for index, start, at, length in self.layout.owned_runs():
            bucket = self.layout.bucket_of[index]
            master, optim, chunks = self.masters[bucket], self.optims[bucket], self.bucket_chunks[bucket]
            at -= self.layout.buckets[bucket].shard_start
            while length:
                chunk, offset = divmod(at, CHUNK)
                n = min(length, CHUNK - offset)
                entry = optim.state.get(chunks[chunk], {})
                state = {MASTER_KEY: master[at:at + n]}
                if self.ema_values is not None:
                    state[EMA_KEY] = self.ema_values[bucket][at:at + n]
                state.update({k: v[offset:offset + n] for k, v in entry.items() if _elementwise(v, chunks[chunk])})
                scalars = {k: v for k, v in entry.items() if not _elementwise(v, chunks[chunk])}
                out.append(Piece(self.params[index], start, n, state, scalars))
                start, at, length = start + n, at + n, length - n
        return out

    def reset_state(self, elementwise: Sequence[str], scalars: Mapping[str, torch.Tensor]) -> None:
        """Give every chunk fresh state: zeros for the elementwise entries, copies of scalars (none: no state)."""
        for optim, chunks in zip(self.optims, self.bucket_chunks):
            for chunk in chunks:
                optim.state.pop(chunk, None)
                if elementwise or scalars:
                    entry = {k: v.to(chunk.device, copy=True) for k, v in scalars.items()}
                    optim.state[chunk] = entry | {k: torch.zeros_like(chunk, dtype=self.state_dtype)
                                                  for k in elementwise}

    def gather_params(self) -> None:
        """All-gather every rank's master pieces into the model params (after the masters were written; ZeRO-3
        frees them instead, to be gathered where used)."""
        if self.shard_params:
            self.release()
            return
        wait_all([self._gather_bucket(self.param_flat, master, b)
                  for master, b in zip(self.masters, self.layout.buckets)])

    def set_state(self, elementwise: Mapping[str, torch.Tensor], scalars: Mapping[str, Any]) -> None:
        """Give the inner optimizers this shard's state (inverse of get_state; elementwise entries in state_dtype)."""
        start = 0
        for optim, chunks in zip(self.optims, self.bucket_chunks):
            for chunk in chunks:
                entry = {k: v[start:start + chunk.numel()].to(self.state_dtype, copy=True)
                         for k, v in elementwise.items()}
                entry.update(copy.deepcopy(dict(scalars)))
                optim.state[chunk] = entry
                start += chunk.numel()


def _host_buffer(numel: int, dtype: torch.dtype, host: torch.device, device: torch.device) -> torch.Tensor:
    """A zeroed host buffer for copies to and from device: pinned where the device is a GPU."""
    return torch.zeros(numel, dtype=dtype, device=host, pin_memory=device.type == "cuda")


def _copied(device: torch.device) -> torch.cuda.Event | None:
    """An event marking the copies issued so far on device's current stream (None off CUDA: copies are done)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _elementwise(value: Any, chunk: torch.Tensor) -> bool:
    """Whether an inner-optimizer state entry holds one value per element of its chunk."""
    return torch.is_tensor(value) and value.shape == chunk.shape
