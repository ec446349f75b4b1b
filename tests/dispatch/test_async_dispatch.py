"""EPDispatcher's asynchronous steps and grad group (2 gloo ranks on 2 simulated nodes, float64):
MoELayer.forward_steps pauses at every exchange and equals forward bitwise, grads included, also
when a backward runs on another thread while the next forward dispatches."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from dispatch import EPDispatcher
from dispatch.channel import Pending
from launch.parallel.spawn import run_processes
from moe.config import ModelConfig
from moe.layer import MoELayer

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

WORLD, HIDDEN, EXPERTS = 2, 16, 4
TOKENS = (5, 9)
PAUSES = {"flat": 3, "hierarchical": 6}  # per hop: counts, then rows + metadata; combine: rows


def _layer(dispatcher: EPDispatcher) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(ModelConfig(hidden_size=HIDDEN, num_experts=EXPERTS, top_k=2, expert_ffn_size=HIDDEN,
                                 num_shared_experts=1)).double()
    layer.to_expert_parallel(dispatcher)
    return layer


def _data(rank: int, call: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * rank + call)
    return (torch.randn(TOKENS[rank], HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(TOKENS[rank], HIDDEN, generator=g, dtype=torch.float64))


def _run(layer: MoELayer, rank: int, concurrent: bool) -> dict:
    """Two calls; the first one's backward runs on a thread beside the second forward when concurrent."""
    x0, g0 = _data(rank, 0)
    x1, g1 = _data(rank, 1)
    x0.requires_grad_()
    x1.requires_grad_()
    pauses = []
    steps = layer.forward_steps(x0)
    while True:
        try:
            pauses.append(next(steps))
        except StopIteration as stop:
            out0 = stop.value[0]
            break
    backward = threading.Thread(target=lambda: (out0 * g0).sum().backward())
    if concurrent:
        backward.start()
    out1 = layer(x1)[0]
    if not concurrent:
        backward.start()
    backward.join()
    (out1 * g1).sum().backward()
    return {"outs": (out0.detach(), out1.detach()), "x_grads": (x0.grad, x1.grad),
            "grads": {n: p.grad for n, p in layer.named_parameters()}, "pauses": pauses,
            "bytes": {k: v.as_dict() for k, v in layer.dispatcher.total_bytes.items()}}


def _errors(group: dist.ProcessGroup, other: dist.ProcessGroup) -> dict:
    out = {}
    for name, grad_group in (("itself", group), ("other_ranks", other)):
        try:
            EPDispatcher(EXPERTS, group=group, grad_group=grad_group)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def _compare(rank: int, world_size: int) -> dict:
    grad_group = dist.new_group(list(range(WORLD)))
    singleton = dist.new_group([0])
    results = {"errors": _errors(dist.group.WORLD, singleton)}
    for backend in PAUSES:
        make = lambda gg: EPDispatcher(EXPERTS, group=dist.group.WORLD, gpus_per_node=1, backend=backend, grad_group=gg)
        sync = _run(_layer(make(None)), rank, concurrent=False)
        both = _run(_layer(make(grad_group)), rank, concurrent=True)
        results[backend] = {"sync": sync, "both": both,
                            "pending": all(isinstance(p, Pending) for p in sync["pauses"] + both["pauses"])}
        for run in (sync, both):
            run["pauses"] = len(run["pauses"])
    return results


@pytest.fixture(scope="module")
def results():
    return run_processes(_compare, WORLD, timeout_s=180)


def test_grad_group_must_be_a_second_group_over_the_same_ranks(results):
    for res in results:
        assert "grad_group" in res["errors"]["itself"] and "group itself" in res["errors"]["itself"]
        assert "grad_group" in res["errors"]["other_ranks"] and "[0]" in res["errors"]["other_ranks"]


@pytest.mark.parametrize("backend", list(PAUSES))
def test_forward_steps_pause_at_every_exchange(results, backend):
    for res in results:
        assert res[backend]["pending"]
        assert res[backend]["sync"]["pauses"] == res[backend]["both"]["pauses"] == PAUSES[backend]


@pytest.mark.parametrize("backend", list(PAUSES))
def test_concurrent_backward_on_grad_group_is_bitwise_equal(results, backend):
    for res in results:
        sync, both = res[backend]["sync"], res[backend]["both"]
        for a, b in zip(sync["outs"] + sync["x_grads"], both["outs"] + both["x_grads"]):
            assert torch.equal(a, b)
        assert sync["grads"].keys() == both["grads"].keys()
        for name, g in sync["grads"].items():
            assert torch.equal(g, both["grads"][name]), name
        assert sync["bytes"] == both["bytes"]
        assert sync["bytes"]["dispatch_backward"]["inter_payload"] > 0
