"""The single-process combine keeps each expert output in its own dtype for backward (no fp32 copy), and its
grads are autograd's of the plain fp32 product; a dropless dispatch sizes its rows without a host sync."""

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

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


def test_a_dropless_dispatch_reads_nothing_back_and_sorts_as_the_counted_one():
    """Fake tensors have no values: an op whose output size depends on them (nonzero) raises; the dropless
    dispatch runs through, so it never waits on the device for a count. On real values both agree."""
    torch.manual_seed(0)
    x, indices, weights = torch.randn(16, 8), torch.randint(0, 4, (16, 2)), torch.rand(16, 2)
    counted, dropless = LocalDispatcher(4), LocalDispatcher(4, dropless=True)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (x, indices, weights)]
        rows, info, _ = dropless.dispatch(*fake)
        assert rows.shape == (32, 8) and info.tokens_per_local_expert.shape == (4,)
        with pytest.raises((DynamicOutputShapeException, DataDependentOutputException)):
            counted.dispatch(*fake)
    (a, info_a, ha), (b, info_b, hb) = counted.dispatch(x, indices, weights), dropless.dispatch(x, indices, weights)
    assert torch.equal(a, b) and torch.equal(info_a.tokens_per_local_expert, info_b.tokens_per_local_expert)
    assert torch.equal(ha.token_of_row, hb.token_of_row) and torch.equal(ha.weight_of_row, hb.weight_of_row)
