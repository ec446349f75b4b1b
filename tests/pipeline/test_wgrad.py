"""The weight-grad store: deferral inside a split backward for Linear and for a grouped matmul."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipeline.wgrad import WeightGradStore, accumulate_grad, defer_weight_grad, install_split_linear


class _GroupedMatmul(torch.autograd.Function):
    """out[rows of g] = x[rows of g] @ w[g].T, wired to the store the way grouped experts would be."""

    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        return torch.cat([xs @ w[g].T for g, xs in enumerate(x.split(counts))])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = torch.cat([dys @ w[g] for g, dys in enumerate(dy.split(ctx.counts))])

        def wgrad():
            return torch.stack([d.T @ xs for d, xs in zip(dy.split(ctx.counts), x.split(ctx.counts))])

        compute = lambda: accumulate_grad(w, wgrad, lambda acc: acc.add_(wgrad()))  # noqa: E731
        return dx, (None if defer_weight_grad(w, compute, (x, dy)) else wgrad()), None


def test_grouped_matmul_weight_grad_waits_for_w_even_through_a_cast() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 5, 4, dtype=torch.float64))
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    counts = [2, 3, 4]
    ref_w = w.detach().clone().requires_grad_()
    for _ in range(2):  # the second pass accumulates in place
        _GroupedMatmul.apply(x.detach(), ref_w.float().double(), counts).square().sum().backward()
    store = WeightGradStore()
    for key in range(2):
        with store.capture(key):
            _GroupedMatmul.apply(x, w.float().double(), counts).square().sum().backward()
        assert x.grad is not None and store.pending() == key + 1
    assert w.grad is None  # nothing reached the weight yet
    assert store.run(0) == 1 and store.run(1) == 1
    assert torch.allclose(w.grad, ref_w.grad, rtol=1e-6)
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
