"""Weight-grad deferral: the FP8 grouped linear queues its weight grad inside a capture, from any thread."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import kernels
from kernels.wgrad_defer import WeightGradStore
from tests.kernels.helpers import GROUP_SIZES, inputs


def _loss(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return kernels.fp8_grouped_linear(x, w, offs, backend="torch").square().sum()


def _setup(dtype: torch.dtype = torch.float32):
    x, w, _, offs = inputs(GROUP_SIZES, 160, 48, seed=3)
    return x.requires_grad_(), nn.Parameter(w.to(dtype)), offs


def _reference_grad(x, w, offs, passes: int) -> torch.Tensor:
    ref = w.detach().clone().requires_grad_()
    for _ in range(passes):
        _loss(x.detach(), ref.to(torch.float32), offs).backward()
    return ref.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["leaf", "through-a-cast"])
def test_fp8_weight_grad_waits_for_the_w_action(dtype: torch.dtype) -> None:
    x, w, offs = _setup(dtype)
    store = WeightGradStore()
    for key in range(2):  # the second W accumulates onto the first
        with store.capture(key):
            _loss(x, w.to(torch.float32), offs).backward()
        assert x.grad is not None and store.pending() == key + 1
    assert w.grad is None and store.held_bytes > 0
    assert store.run(0) == 1 and store.run(1) == 1
    assert torch.equal(w.grad, _reference_grad(x, w, offs, 2))
    assert store.pending() == 0 and store.held_bytes == 0


def test_backward_on_another_thread_is_captured() -> None:
    """The autograd engine runs CUDA backward functions on its own threads: the capture opened here
    must reach them (a thread- or context-local slot would not)."""
    x, w, offs = _setup()
    loss = _loss(x, w, offs)
    store = WeightGradStore()
    with store.capture("k"):
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join()
    assert x.grad is not None and w.grad is None and store.pending() == 1
    store.run("k")
    assert torch.equal(w.grad, _reference_grad(x, w, offs, 1))


def test_post_accumulate_hooks_fire_in_the_w_action() -> None:
    x, w, offs = _setup()
    fired: list[tuple[str, bool]] = []
    phase = ["B"]
    w.register_post_accumulate_grad_hook(lambda p: fired.append((phase[0], p.grad is not None)))
    store = WeightGradStore()
    with store.capture(0):
        _loss(x, w, offs).backward()
    phase[0] = "W"
    store.run(0)
    assert ("W", True) in fired and ("B", True) not in fired  # torch also fires it in B, with nothing added


def test_outside_a_capture_the_grad_is_computed_at_once() -> None:
    x, w, offs = _setup()
    _loss(x, w, offs).backward()
    assert torch.equal(w.grad, _reference_grad(x, w, offs, 1))


def test_captures_do_not_nest() -> None:
    outer, inner = WeightGradStore(), WeightGradStore()
    with outer.capture("a"):
        with pytest.raises(RuntimeError, match="already open; captures do not nest"):
            with inner.capture("b"):
                pass
    with inner.capture("b"):  # the slot is free again once the outer capture closed
        pass


def test_one_run_over_several_keys_merges_work_by_merge_key() -> None:
    store, calls = WeightGradStore(), []
    for key in range(3):
        with store.capture(key):
            store.push(lambda k=key: calls.append(("alone", k)), nbytes=10)
            for name in ("a", "b"):
                store.push(lambda: calls.append("unmerged fn must not run"), nbytes=100,
                           merge=(name, lambda args, n=name: calls.append((n, args)), key))
    assert store.held_bytes == 3 * 210
    assert store.run(0, 1, 2) == 9
    # unmergeable work first, in queue order; then each merge key once over every key's args, in order
    assert calls == [("alone", 0), ("alone", 1), ("alone", 2), ("a", [0, 1, 2]), ("b", [0, 1, 2])]
    assert store.pending() == 0 and store.held_bytes == 0
