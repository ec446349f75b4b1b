"""grouped_linear and its gradients against a per-group loop, empty groups included."""

from __future__ import annotations

import pytest
import torch

from moe.grouped_mm import group_offsets, grouped_linear
from tests.syncs import SyncDetector


def loop_reference(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Row block g of x times w[g].T, one group at a time, in float64."""
    blocks, start = [], 0
    for g, count in enumerate(counts):
        blocks.append(x[start:start + count].double() @ w[g].double().T)
        start += count
    return torch.cat(blocks)


@pytest.fixture
def grouped_mm_calls(monkeypatch):
    """Counts calls of torch._grouped_mm (the native path) while passing them through."""
    calls = []
    native = torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(args[0].dtype)
        return native(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    return calls


@pytest.mark.parametrize("dtype,counts,native_calls,tol", [
    (torch.float32, [0, 16, 0, 32, 16, 0], 3, 1e-4),  # forward, dgrad and wgrad all native
    (torch.float32, [0, 5, 0, 7, 3, 0], 3, 1e-4),     # rows not a multiple of 16: wgrad pads them, native too
    (torch.float64, [0, 5, 0, 7, 3, 0], 0, 1e-12),    # float64: loop path throughout
])
def test_grouped_linear_and_grads_equal_per_group_loop(grouped_mm_calls, dtype, counts, native_calls, tol):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 32, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(len(counts), 48, 32, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(sum(counts), 48, generator=gen).to(dtype)
    out = grouped_linear(x, w, group_offsets(torch.tensor(counts)))
    out.backward(dy)
    assert out.dtype == dtype and len(grouped_mm_calls) == native_calls

    x_ref, w_ref = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = loop_reference(x_ref, w_ref, counts)
    ref.backward(dy.double())
    for got, want in ((out, ref), (x.grad, x_ref.grad), (w.grad, w_ref.grad)):
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    for g, count in enumerate(counts):
        if count == 0:
            assert torch.all(w.grad[g] == 0)  # an empty group gets an exact zero gradient
    assert w.grad.abs().sum() > 0


def test_grouped_linear_gradcheck_float64():
    gen = torch.Generator().manual_seed(1)
    counts = [2, 0, 3]
    x = torch.randn(5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(3, 6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    offs = group_offsets(torch.tensor(counts))
    assert torch.autograd.gradcheck(lambda a, b: grouped_linear(a, b, offs), (x, w))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_linear_reads_nothing_to_the_host_and_ignores_padding_rows(dtype):
    """Every dtype's grouped path takes its offsets on the device (issue 48): forward and backward read nothing (the
    sync detector, strict), and rows past the last group (a padded exchange's) give zero rows and no weight grad.
    float32 at widths torch._grouped_mm does not take (not multiples of 16) runs the same reference."""
    gen = torch.Generator().manual_seed(2)
    counts, pad = [3, 0, 4], 5
    x = torch.randn(sum(counts) + pad, 12, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(3, 10, 12, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(sum(counts) + pad, 10, generator=gen).to(dtype)
    offs = group_offsets(torch.tensor(counts))
    with SyncDetector(strict=True):
        out = grouped_linear(x, w, offs)
        out.backward(dy)
    x_ref, w_ref = x.detach()[:-pad].double().requires_grad_(), w.detach().double().requires_grad_()
    ref = loop_reference(x_ref, w_ref, counts)
    ref.backward(dy[:-pad].double())
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out[:-pad].double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(x.grad[:-pad].double(), x_ref.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, atol=tol, rtol=tol)
    assert torch.all(out[-pad:] == 0) and torch.all(x.grad[-pad:] == 0)


def test_native_grouped_linear_zeroes_the_padding_rows():
    """torch._grouped_mm (float32 at widths of multiples of 16) leaves the rows past the last group unwritten: with a
    freed NaN-filled block of the output's size in the allocator (its memory is what the output gets, most of the
    time), the padding rows of the output and of the input grad still come out zero (a padded exchange's padding
    rows NaN there made a dp4 x ep2 step's grads NaN)."""
    gen = torch.Generator().manual_seed(3)
    counts, pad = [10, 0, 14], 16
    x = torch.randn(sum(counts) + pad, 16, generator=gen).requires_grad_()
    w = torch.randn(3, 16, 16, generator=gen).requires_grad_()
    offs = group_offsets(torch.tensor(counts))
    for _ in range(5):
        torch.full((x.shape[0], 16), float("nan"))  # made and freed at once: its block goes back to the allocator
        out = grouped_linear(x, w, offs)
        x.grad = None
        out.backward(torch.ones_like(out))
        assert torch.all(out[-pad:] == 0) and torch.all(x.grad[-pad:] == 0)
        assert torch.isfinite(w.grad).all()
