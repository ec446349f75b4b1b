"""One param group's flat buffers and collectives: grads reduce-scattered in, params all-gathered out."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from optim.flat_layout import FlatLayout


class ShardedParams:
    """Model params of one group re-pointed into a flat buffer, with this rank's fp32 master shard.

    The model params become views of one flat buffer (their dtype), so the all-gather of the
    updated shards writes straight into them. Gradients are reduced from a flat fp32 buffer;
    fp32 params get their .grad bound to views of it, so backward accumulates in place and the
    reduce-scatter needs no copy. gloo in torch 2.13 implements reduce_scatter_single and
    all_gather_single, so the same single bucketed calls run on gloo and NCCL (no fallback).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], group: ProcessGroup | None,
                 bucket_cap: int, grad_divisor: float) -> None:
        self.params = list(params)
        self.group = group
        self.grad_divisor = grad_divisor
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = FlatLayout.build([p.shape for p in self.params], world, rank, bucket_cap)
        dtype = self.params[0].dtype
        with torch.no_grad():
            self.param_flat = self.layout.flatten([p.detach() for p in self.params], dtype)
            for p, view in zip(self.params, self.layout.views(self.param_flat)):
                p.data = view
            master = self.layout.shard_of(self.param_flat).to(torch.float32)
        self.master = torch.nn.Parameter(master)
        self.master.grad = torch.zeros_like(master)
        self.grad_flat = torch.zeros(self.layout.total, dtype=torch.float32,
                                     device=self.param_flat.device)
        self.grad_views = self.layout.views(self.grad_flat)
        self.binds_grads = dtype == torch.float32
        self.zero_grad(set_to_none=False)

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero the flat grads; fp32 params keep .grad bound to them, others follow set_to_none."""
        self.grad_flat.zero_()
        for p, view in zip(self.params, self.grad_views):
            if self.binds_grads:
                p.grad = view
            elif set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _collect_grads(self) -> None:
        """Bring any .grad not already living in the flat buffer into it (or zero for None)."""
        for p, view in zip(self.params, self.grad_views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                if self.binds_grads:
                    p.grad = view

    def reduce_grads(self) -> None:
        """Reduce-scatter the local grads (summed over micro-batches) into master.grad / grad_divisor."""
        self._collect_grads()
        grad = self.master.grad
        works = [dist.reduce_scatter_single(grad[b.shard], self.grad_flat[b.full],
                                            group=self.group, async_op=True)
                 for b in self.layout.buckets]
        for work in works:
            work.wait()
        grad.div_(self.grad_divisor)

    def all_gather(self, out_flat: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's shard (cast to out_flat's dtype) into out_flat, bucket by bucket."""
        shard = shard.detach().to(out_flat.dtype)
        works = [dist.all_gather_single(out_flat[b.full], shard[b.shard], group=self.group,
                                        async_op=True)
                 for b in self.layout.buckets]
        for work in works:
            work.wait()
        return out_flat

    def gather_params(self) -> None:
        """Write the updated master shards of all ranks into the model params."""
        self.all_gather(self.param_flat, self.master)

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """A new fp32 flat buffer holding every rank's piece of a shard-shaped tensor."""
        out = torch.empty(self.layout.total, dtype=torch.float32, device=shard.device)
        return self.all_gather(out, shard)

    def sq_norm(self) -> torch.Tensor:
        """Sum of squares (float64, shape [1]) of this rank's reduced grad shard."""
        return torch.linalg.vector_norm(self.master.grad, dtype=torch.float64).square().reshape(1)
