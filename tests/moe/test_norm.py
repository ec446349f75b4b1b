"""The project's RMSNorm: nn.RMSNorm's values (bitwise forward, grads to rounding) while its backward keeps only
the input and one rstd per row."""

import pytest
import torch
from torch import nn

from moe.norm import RMSNorm


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-14), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_values_and_grads_are_nn_rmsnorms(dtype, tol):
    torch.manual_seed(0)
    ref, ours = nn.RMSNorm(32, eps=1e-6).to(dtype), RMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ours.weight.copy_(ref.weight)
    x = torch.randn(2, 7, 32, dtype=dtype) * 3
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), ours(xb)
    grad = torch.randn_like(ya)
    ya.backward(grad)
    yb.backward(grad)
    assert torch.equal(ya, yb)
    assert torch.allclose(xa.grad.double(), xb.grad.double(), rtol=tol, atol=tol)
    assert torch.allclose(ref.weight.grad.double(), ours.weight.grad.double(), rtol=tol, atol=tol)


def test_backward_keeps_the_input_and_one_fp32_rstd_per_row():
    norm = RMSNorm(64, eps=1e-6).bfloat16()
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    kept = sorted((tuple(t.shape), t.dtype) for t in saved if t is not norm.weight)
    assert kept == sorted([((8, 64), torch.bfloat16), ((8, 1), torch.float32)])
