"""The single-process combine keeps each expert output in its own dtype for backward (no fp32 copy), and its
grads are autograd's of the plain fp32 product; dispatches size their rows without a host sync, a dropping one
padding its dropped slots."""

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from moe.local_dispatch import LocalDispatcher


def test_combine_saves_expert_outputs_in_their_dtype_and_gives_autograds_grads():
    torch.manual_seed(0)
    x = torch.randn(8, 16).bfloat16()
    indices, weights = torch.randint(0, 4, (8, 2)), torch.rand(8, 2, requires_grad=True)
    local = LocalDispatcher(4, dropless=True)
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


def test_dispatches_read_nothing_back_and_a_dropping_one_pads_its_dropped_slots():
    """Fake tensors have no values: an op whose output size depends on them (nonzero) would raise; both dispatches run
    through, so neither waits on the device for a count (issue 48: the dropping one no longer reads its kept slots).
    On real values the dropping one's rows are the kept slots grouped by expert, then one padding row per dropped slot,
    which its combine leaves out."""
    torch.manual_seed(0)
    x, indices, weights = torch.randn(16, 8), torch.randint(0, 4, (16, 2)), torch.rand(16, 2)
    indices[::3, 1] = -1
    weights = weights.masked_fill(indices < 0, 0.0)
    dropping, dropless = LocalDispatcher(4), LocalDispatcher(4, dropless=True)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (x, indices, weights)]
        for local in (dropping, dropless):
            rows, info, _ = local.dispatch(*fake)
            assert rows.shape == (32, 8) and info.tokens_per_local_expert.shape == (4,)
    rows, info, handle = dropping.dispatch(x, indices, weights)
    flat = indices.reshape(-1)
    kept = torch.arange(32)[flat >= 0]
    order = kept[torch.argsort(flat[kept], stable=True)]
    assert torch.equal(info.tokens_per_local_expert, torch.bincount(flat[kept], minlength=4))
    assert torch.equal(rows[:len(order)], x[order // 2])
    assert torch.equal(dropping.row_weights(handle)[:len(order)], weights.reshape(-1)[order])
    y = torch.randn(32, 8)
    want = torch.zeros(16, 8).index_add(0, order // 2, y[:len(order)] * weights.reshape(-1)[order].unsqueeze(1))
    assert torch.equal(dropping.combine(y, handle), want)
