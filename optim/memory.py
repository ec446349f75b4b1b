"""Bytes an optimizer holds per rank: the fp32 params it updates plus its state tensors."""

from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from optim.zero import ZeroOptimizer


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """This rank's optimizer bytes: (master) params it updates + state tensors, for any optimizer.

    ZeroOptimizer counts its fp32 master shards; ZeroRedundancyOptimizer counts its local optimizer
    (the params of its partition); a plain optimizer counts all of its params (of DTensors, the local shards).
    """
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.state_bytes()["total"]
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(local(t).nbytes for t in params + state)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (torch FSDP2's params and state), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def model_state_bytes(optimizer: ZeroOptimizer, params: Iterable[torch.Tensor]) -> dict[str, int]:
    """Bytes this rank holds right now for the model states of params under optimizer: "params" (the storage the
    params view, freed storage counting 0, plus masters of their dtype kept apart: ZeRO-3's shards, offload's),
    "grads" (full grad buffers held, ZeRO-2's shards, host copies, any .grad outside them), "optimizer"
    (held_optimizer_bytes: state and masters of another dtype) and "receive_rows" (the p2p exchange's receive rows,
    gloo's: NCCL's in-place reduce-scatter has none, so they are kept apart from the grads a GPU holds)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    buffers = optimizer.buffer_bytes()
    apart = {g.untyped_storage().data_ptr() for s in optimizer._shards for g in s.grad_buckets}
    loose = sum(p.grad.nbytes for p in params if p.grad is not None and p.grad.untyped_storage().data_ptr() not in apart)
    held = sum(g.untyped_storage().nbytes() for s in optimizer._shards for g in s.grad_buckets)
    return {"params": sum(storages.values()) + buffers["param_shards"],
            "grads": held + buffers["grad_shards"] + buffers["host_grads"] + loose,
            "optimizer": held_optimizer_bytes(optimizer), "receive_rows": buffers["scratch"]}


def held_optimizer_bytes(optimizer: ZeroOptimizer) -> int:
    """Bytes ZeRO-1 holds beyond the model's params: its state tensors plus fp32 masters kept apart from
    the params (an fp32 param is its own master; its bytes are the model's)."""
    state = optimizer.state_bytes()
    return state["total"] - state["master"] + optimizer.buffer_bytes()["masters"]
