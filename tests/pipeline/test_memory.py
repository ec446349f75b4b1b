"""pipeline.memory.SavedTensorMeter, the project's one activation meter."""

from __future__ import annotations

import torch

from pipeline.memory import SavedTensorMeter


def test_the_meter_counts_shared_storage_once_and_leaves_parameters_out():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    meter = SavedTensorMeter(params=[weight])
    x = torch.randn(4, 8, requires_grad=True)
    with meter.hooks():
        y = (x @ weight).relu()   # saves x and the relu output (the weight is a parameter)
        z = y * y                 # saves y twice: one storage
    assert meter.peak == x.nbytes + y.nbytes
    del y, z


def test_the_meter_frees_a_branch_backward_never_runs():
    # exp saves its own output; a loss term left out of the loss (a zero coefficient) never runs its backward,
    # so only the graph's end frees what it saved: held with its grad_fn it would cycle and stay counted
    meter = SavedTensorMeter()
    x = torch.randn(64, requires_grad=True)
    with meter.hooks():
        unused = x.exp().sum()
        loss = (x * x).sum()   # saves x
    loss.backward()
    del unused, loss
    assert meter.peak == 2 * x.nbytes and meter.live == 0


def test_a_region_counts_what_its_modules_save_and_nothing_else():
    norm, proj = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    meter = SavedTensorMeter(params=[*norm.parameters(), *proj.parameters()])
    with meter.hooks(), meter.region([norm]):
        h = proj(x)              # saves x: outside the region
        y = norm(h)              # saves h and its statistics: inside
    assert meter.region_bytes > h.nbytes - 1 and meter.peak == x.nbytes + meter.region_bytes
    del y
