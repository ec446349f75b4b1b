"""Host syncs of one MoE layer's forward + backward (router, expert-parallel dispatch, experts, combine) on one
gloo rank: a fixed number, the same for any number of experts and tokens. Only the sizes a dispatch needs
on the host are read there (each such read is commented where it happens)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dispatch import EPDispatcher
from moe.config import ModelConfig
from moe.layer import MoELayer
from tests.dispatch.test_segment_ops import one_rank  # noqa: F401 (a fixture)

# operators whose result the host must wait for: a scalar read, or an output sized by the data
SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique2",
            "aten.unique_consecutive", "aten.unique_dim", "aten.repeat_interleave", "aten.bincount"}
MASK_OPS = {"aten.index", "aten.index_put", "aten.index_put_"}  # with a boolean mask: a nonzero inside
HIDDEN = 16


class SyncCounter(TorchDispatchMode):
    """Counts host syncs while active: SYNC_OPS, copies to the CPU from another device, and Tensor.tolist /
    Tensor.numpy (on the CPU these read memory without an operator, on a GPU they copy to the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self._saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        name = str(func.overloadpacket)
        moved = name in ("aten._to_copy", "aten.copy_") and any(
            isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta") for a in args)
        masked = name in MASK_OPS and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                          for i in args[1] if i is not None)
        if name in SYNC_OPS or moved or masked:
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, self._counted(name, method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _counted(self, name: str, method):
        def counted(tensor, *args, **kwargs):
            if not tensor.is_meta:
                self.syncs[f"Tensor.{name}"] += 1
            return method(tensor, *args, **kwargs)
        return counted


def layer_syncs(experts: int, tokens: int, backend: str, capacity_factor: float | None) -> Counter[str]:
    """Host syncs of one MoE layer's forward and backward, by kind."""
    torch.manual_seed(experts + tokens)
    cfg = ModelConfig(hidden_size=HIDDEN, num_experts=experts, top_k=4, expert_ffn_size=16, num_groups=4,
                      topk_groups=2, capacity_factor=capacity_factor, score_func="sigmoid", aux_loss_coeff=0.01)
    layer = MoELayer(cfg)
    layer.to_expert_parallel(EPDispatcher(experts, backend=backend, gpus_per_node=1))
    x = torch.randn(2, tokens // 2, HIDDEN, requires_grad=True)
    with SyncCounter() as counter:
        out, stats = layer(x, seq_len=tokens // 2)
        (out.square().sum() + stats.aux_loss).backward()
    assert x.grad is not None and layer.experts.w_down.grad is not None
    return counter.syncs


def budget(hops: int) -> Counter[str]:
    """The syncs a layer needs: per hop, its send splits read with the passes of its combine sums
    (dispatch.routes.plan_sends, dispatch.segment.pass_sizes) and the counts its peers send (dispatch.channel);
    the pairs kept for this rank's experts read with the passes of their sums (dispatch.permute.make_permutation);
    the routing check (dispatch.layout.check_routing reads one flag on the CPU, a device-side assert elsewhere).
    Each read of a plan's passes apart from its counts was a sync more: 3 * hops + 3 in all before."""
    return Counter({"Tensor.tolist": 2 * hops + 1, "aten._local_scalar_dense": 1})


@pytest.mark.parametrize("backend, hops", [("flat", 1), ("hierarchical", 2)])
@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_host_syncs_are_the_sizes_dispatch_needs_for_any_experts_and_tokens(one_rank, backend, hops, capacity_factor):
    for experts in (8, 64):
        for tokens in (64, 512):
            assert layer_syncs(experts, tokens, backend, capacity_factor) == budget(hops), (experts, tokens)
