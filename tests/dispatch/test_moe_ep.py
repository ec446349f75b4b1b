"""An expert-parallel MoE layer (4 gloo ranks, 2 simulated nodes) equals the single-process layer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from dispatch import EPDispatcher
from launch.parallel.spawn import run_processes
from moe.config import ModelConfig
from moe.layer import MoELayer
from tests.dispatch.cases import calc_diff

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

WORLD = 4
TOKENS = (6, 0, 19, 11)  # rank 1 has no tokens of its own
VARIANTS = [("flat", None), ("hierarchical", None), ("hierarchical", 1.0)]  # (backend, capacity_factor)


def _config(backend: str, capacity_factor: float | None) -> ModelConfig:
    return ModelConfig(hidden_size=32, num_experts=8, top_k=3, expert_ffn_size=16, num_shared_experts=1,
                       capacity_factor=capacity_factor)


def _layers(cfg: ModelConfig, backend: str, dtype: torch.dtype) -> tuple[MoELayer, MoELayer]:
    torch.manual_seed(0)
    full = MoELayer(cfg).to(dtype)
    ep = copy.deepcopy(full)
    ep.to_expert_parallel(EPDispatcher(cfg.num_experts, group=dist.group.WORLD, gpus_per_node=2, backend=backend))
    return full, ep


def _tokens(rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return (torch.randn(TOKENS[rank], 32, generator=gen).to(dtype),
            torch.randn(TOKENS[rank], 32, generator=gen).to(dtype))


def _compare(rank: int, world_size: int) -> dict:
    results = {}
    for backend, capacity in VARIANTS:
        cfg = _config(backend, capacity)
        full, ep = _layers(cfg, backend, torch.float32)
        x, _ = _tokens(rank, torch.float32)
        out, stats = ep(x)
        results[backend, capacity, "out"] = (out.detach(), full(x)[0].detach())
        results[backend, capacity, "dropped"] = int(stats.dropped)

        full, ep = _layers(cfg, backend, torch.float64)
        x, grad_out = _tokens(rank, torch.float64)
        x_ep = x.clone().requires_grad_()
        (ep(x_ep)[0] * grad_out).sum().backward()
        x_full = x.clone().requires_grad_()
        (full(x_full)[0] * grad_out).sum().backward()
        own = {name: p.grad.clone() for name, p in full.named_parameters() if not name.startswith("experts.")}
        for other in range(WORLD):  # expert weights see every rank's tokens
            if other != rank:
                (full(_tokens(other, torch.float64)[0])[0] * _tokens(other, torch.float64)[1]).sum().backward()
        block = slice(rank * 2, rank * 2 + 2)
        grads = {"x": (x_ep.grad, x_full.grad)}
        for name, p in ep.named_parameters():
            grads[name] = (p.grad, full.get_parameter(name).grad[block] if name.startswith("experts.") else own[name])
        results[backend, capacity, "grads"] = grads
    return results


@pytest.fixture(scope="module")
def results():
    return run_processes(_compare, WORLD, timeout_s=240)


@pytest.mark.parametrize("backend, capacity", VARIANTS)
def test_ep_layer_output_equals_single_process_layer(results, backend, capacity):
    for rank, res in enumerate(results):
        got, want = res[backend, capacity, "out"]
        assert got.shape == want.shape == (TOKENS[rank], 32)
        if got.numel():
            assert (got - want).abs().max().item() <= 1e-5
    assert (sum(res[backend, capacity, "dropped"] for res in results) > 0) == (capacity is not None)


@pytest.mark.parametrize("backend, capacity", VARIANTS)
def test_ep_layer_gradients_match_in_float64(results, backend, capacity):
    for rank, res in enumerate(results):
        grads = res[backend, capacity, "grads"]
        assert {"x", "router.weight", "experts.w_gate_up", "experts.w_down"} <= set(grads)
        for name, (got, want) in grads.items():
            assert got.shape == want.shape, name
            if want.abs().sum() > 0:
                assert calc_diff(got, want) <= 1e-10, (rank, name)
            else:
                assert torch.equal(got, want), (rank, name)
        assert grads["experts.w_down"][1].abs().sum() > 0  # every rank's experts got tokens from others
