"""The weight-grad store: deferral inside a split backward for Linear and for the grouped expert linear."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline.wgrad import WeightGradStore, install_split_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32-cast-grouped-mm", "fp64-leaf-group-loop"])
def test_grouped_expert_weight_grad_waits_for_w_for_a_leaf_and_through_a_cast(dtype: torch.dtype) -> None:
    from moe.grouped_mm import group_offsets, grouped_linear
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 32, 16, dtype=torch.float64))  # fp32: a cast in the forward; fp64: the leaf
    x = torch.randn(9, 16, dtype=dtype, requires_grad=True)
    offs = group_offsets(torch.tensor([2, 3, 4]))
    ref_w = w.detach().clone().requires_grad_()
    for _ in range(2):  # the second pass accumulates in place
        grouped_linear(x.detach(), ref_w.to(dtype), offs).square().sum().backward()
    store = WeightGradStore()
    for key in range(2):
        with store.capture(key):
            grouped_linear(x, w.to(dtype), offs).square().sum().backward()
        assert x.grad is not None and store.pending() == key + 1
    assert w.grad is None  # nothing reached the weight yet
    assert store.run(0) == 1 and store.run(1) == 1
    assert torch.equal(w.grad, ref_w.grad)
    assert store.pending() == 0 and store.held_bytes == 0


def test_split_linear_defers_only_inside_capture() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(net)
    assert len(install_split_linear([net])) == 2
    x = torch.randn(5, 6, dtype=torch.float64)
    store = WeightGradStore()
    with store.capture("k"):
        net(x).sum().backward()
    assert all(p.grad is None for p in net.parameters()) and store.pending() == 2  # one closure per Linear (weight and bias)
    net(x).sum().backward()  # outside a capture: computed at once
    store.run("k")
    for _ in range(2):
        ref(x).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-12)


def test_a_w_over_several_chunks_accumulates_each_linear_once() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(net)
    install_split_linear([net])
    calls = {id(p): 0 for p in net.parameters()}
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda q: calls.__setitem__(id(q), calls[id(q)] + 1))
    xs = torch.randn(3, 5, 6, dtype=torch.float64)
    store = WeightGradStore()
    for chunk, x in enumerate(xs):
        with store.capture(chunk):
            net(x).sum().backward()
        ref(x).sum().backward()
    calls.update(dict.fromkeys(calls, 0))  # the hooks also fire, with nothing to add, in the captured backwards
    assert store.run(0, 1, 2) == 6 and set(calls.values()) == {1}  # one GEMM per weight over 15 rows
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-12)


def test_outstanding_work_reads_zero_only_at_each_params_last_grad() -> None:
    """A hook reading store.outstanding(param) == 0 sees param's last deferred grad: the Linear weights and
    biases (a bias rides with its weight's work) in the last W, whether that W runs one chunk or merges two."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    install_split_linear([net])
    store = WeightGradStore()
    seen: list[tuple[str, int]] = []
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda q, name=name: seen.append((name, store.outstanding(q))))
    for chunk, x in enumerate(torch.randn(3, 5, 6, dtype=torch.float64)):
        with store.capture(chunk):
            net(x).sum().backward()
    assert all(store.outstanding(p) == 3 for p in net.parameters())
    seen.clear()  # the captured backwards fire the hooks too, with nothing added and work outstanding
    store.run(0)
    assert sorted(seen) == sorted((name, 2) for name, _ in net.named_parameters())
    seen.clear()
    store.run(1, 2)  # merged: one accumulation per param for both chunks
    assert sorted(seen) == sorted((name, 0) for name, _ in net.named_parameters())


def test_an_unsplit_backward_fires_each_params_grad_hook_once() -> None:
    """Outside a capture a split Linear with grad hooks hands its weight grads to autograd: one accumulation
    (and one hook call) per param per backward, as a plain Linear's, so a hook can tell the last grad."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(net)
    install_split_linear([net])
    calls = {name: 0 for name, _ in net.named_parameters()}
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda q, name=name: calls.__setitem__(name, calls[name] + 1))
    x = torch.randn(5, 6, dtype=torch.float64)
    for passes in (1, 2):
        net(x).sum().backward()
        ref(x).sum().backward()
        assert set(calls.values()) == {passes}
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-12)
