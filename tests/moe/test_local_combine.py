"""The single-process combine keeps each expert output in its own dtype for backward (no fp32 copy), and its
grads are autograd's of the plain fp32 product."""

import torch

from moe.local_dispatch import LocalDispatcher


def test_combine_saves_expert_outputs_in_their_dtype_and_gives_autograds_grads():
    torch.manual_seed(0)
    x = torch.randn(8, 16).bfloat16()
    indices, weights = torch.randint(0, 4, (8, 2)), torch.rand(8, 2, requires_grad=True)
    local = LocalDispatcher(4)
    rows, _, handle = local.dispatch(x, indices, weights)
    y = (rows * 2).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = local.combine(y, handle)
    assert not [t for t in saved if t.dtype == torch.float32 and t.shape == y.shape]  # no fp32 copy of y
    grad = torch.randn(out.shape).bfloat16()
    handle.weight_of_row.retain_grad()
    out.backward(grad)
    y_ref, w_ref = y.detach().clone().requires_grad_(), handle.weight_of_row.detach().clone().requires_grad_()
    ref = torch.zeros(8, 16).index_add(0, handle.token_of_row, y_ref.float() * w_ref.unsqueeze(1)).bfloat16()
    ref.backward(grad)
    assert torch.equal(out, ref) and torch.equal(y.grad, y_ref.grad)
    assert torch.equal(handle.weight_of_row.grad, w_ref.grad)
