"""Operator counts of one MoE layer's dispatch + combine (forward and backward, one gloo rank): the same for
any number of experts, tokens, runs or row blocks, since the fixed-order sums loop over a bound the
routing's shape gives (top-k, a hop's peers), never over the data."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dispatch import EPDispatcher, make_permutation, unpermute
from dispatch.synthetic import synthetic_routing
from dispatch.segment import ordered_sum, segment_plan

TOP_K, HIDDEN = 8, 128


class OpCounter(TorchDispatchMode):
    """Counts the aten operators issued while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        """Operators counted so far."""
        return sum(self.ops.values())


@pytest.fixture
def one_rank():
    """A 1-rank gloo group for the test's duration. Skips when this process already has a default group."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _layer_ops(backend: str, tokens: int, experts: int, payload: str = "bf16") -> tuple[Counter[str], Counter[str]]:
    """(forward, backward) operators of one dispatch + combine; a fifth of the slots dropped."""
    gen = torch.Generator().manual_seed(tokens + experts)
    indices, weights = synthetic_routing(tokens, experts, TOP_K, generator=gen)
    indices[torch.rand(indices.shape, generator=gen) < 0.2] = -1
    x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16().requires_grad_()
    weights.requires_grad_()
    dispatcher = EPDispatcher(experts, backend=backend, payload=payload)
    with OpCounter() as forward:
        recv, _, handle = dispatcher.dispatch(x, indices, weights)
        out = dispatcher.combine(recv * 2, handle)
    with OpCounter() as backward:
        out.float().sum().backward()
    assert x.grad is not None and weights.grad is not None
    return forward.ops, backward.ops


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
@pytest.mark.parametrize("backend", ["flat", "hierarchical"])
def test_dispatch_and_combine_issue_as_many_operators_for_any_experts_and_tokens(one_rank, backend, payload):
    counts = {(tokens, experts): _layer_ops(backend, tokens, experts, payload)
              for tokens in (512, 4096) for experts in (8, 256)}
    forward, backward = counts[512, 8]
    assert sum(forward.values()) > 0 and sum(backward.values()) > 0
    for key, (fwd, bwd) in counts.items():
        assert fwd == forward and bwd == backward, key


def test_one_unpermute_issues_a_fixed_number_of_operators():
    counts = []
    for tokens, experts in [(512, 8), (512, 256), (4096, 256)]:
        indices, weights = synthetic_routing(tokens, experts, TOP_K, generator=torch.Generator().manual_seed(tokens))
        perm = make_permutation(indices, experts)
        y = torch.randn(perm.row.numel(), HIDDEN).bfloat16()
        with OpCounter() as ops:
            unpermute(y, perm, weights, torch.bfloat16)
        counts.append(ops.ops)
    assert counts[0] == counts[1] == counts[2]
    assert counts[0]["aten.index_add_"] == TOP_K  # one pass per slot


def test_ordered_sum_operators_depend_on_max_slots_only():
    def ops(values: int, targets: int) -> int:
        target = torch.randint(0, targets, (values,), generator=torch.Generator().manual_seed(values))
        plan = segment_plan(target, targets, max_slots=values)  # a bound every row keeps
        with OpCounter() as counter:
            ordered_sum(torch.randn(values, 4), plan, torch.rand(values), out_dtype=torch.bfloat16)
        return counter.total()
    assert ops(30, 7) == ops(30, 300) == ops(30, 1)
