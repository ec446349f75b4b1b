"""Context-parallel attention (moe.cp) on 2 and 4 gloo processes against one process's causal attention of the
whole sequence: zig-zag shards of the outputs and of dq, dk, dv equal the reference's in float64 (GQA, a value
head size unlike the query's, MLA-style softmax scale). The 2-process spawn runs under glibc's heap checks
(tests.spawns.malloc_checked)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from launch.parallel.spawn import run_processes
from moe.cp import CP_METHODS, cp_attention, zigzag_chunks, zigzag_positions, zigzag_shard
from tests.spawns import from_shared_spawn, malloc_checked

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

B, HQ, HKV, S, DQK, DV = 2, 4, 2, 24, 8, 6
SCALE = 0.3


def inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shapes = [(B, HQ, S, DQK), (B, HKV, S, DQK), (B, HKV, S, DV), (B, HQ, S, DV)]
    return tuple(torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes)


def reference() -> tuple[torch.Tensor, ...]:
    """Causal attention of the whole sequence in one process (torch's SDPA), its output and input grads."""
    q, k, v, dout = inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    repeat = HQ // HKV
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                         is_causal=True, scale=SCALE)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def shard_worker(rank: int, world: int, methods: list[str]) -> dict[str, list[torch.Tensor]]:
    """Per CP method: this rank's output shard, its q, k, v grads and the bytes it sent."""
    group = dist.group.WORLD
    out = {}
    for method in methods:
        q, k, v, dout = (zigzag_shard(t, world, rank, dim=2) for t in inputs())
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        traffic: dict[str, int] = {}
        attention = cp_attention(method, q, k, v, group, scale=SCALE, traffic=traffic)
        attention.backward(dout)
        out[method] = [attention.detach(), q.grad, k.grad, v.grad, traffic["sent_bytes"]]
    return out


@pytest.fixture(scope="module")
def sharded():
    """world -> each rank's shard_worker results for every CP method, the methods of a world size in one spawn."""
    out = {}

    def run(world: int) -> list[dict[str, list[torch.Tensor]]]:
        # world 2 runs under glibc's heap checks (issue 51): a transfer buffer freed in flight aborts a rank, or reads
        # back perturbed bytes that break the equality with one process
        with malloc_checked() if world == 2 else contextlib.nullcontext():
            return from_shared_spawn(out, world, [world],
                                     lambda: [run_processes(shard_worker, world, list(CP_METHODS), timeout_s=120)])
    return run


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", CP_METHODS)
def test_cp_attention_equals_one_process(method, world, sharded):
    want = [zigzag_shard(t, world, r, dim=2) for r in range(world) for t in reference()]
    results = [list(ranks[method]) for ranks in sharded(world)]
    kv_bytes = B * HKV * (S // world) * (DQK + DV) * 8  # one rank's K and V shards, float64
    # ring: K/V forward and backward over cp - 1 hops, dK/dV over cp hops; all-gather: (cp - 1) x K/V each way
    sent = (3 * world - 2) * kv_bytes if method == "ring" else 2 * (world - 1) * kv_bytes
    assert [result.pop() for result in results] == [sent] * world
    got = [t for result in results for t in result]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == torch.float64 and g.shape == w.shape
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), (i % 4, (g - w).abs().max())


def test_zigzag_layout():
    assert [zigzag_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert zigzag_positions(8, 2, 1, torch.device("cpu")).tolist() == [2, 3, 4, 5]
    x = torch.arange(16).view(1, 16)
    assert torch.cat([zigzag_shard(x, 4, r) for r in range(4)], 1).sort().values.equal(x)  # a partition
    with pytest.raises(ValueError, match="divisible by 2 x cp = 6"):
        zigzag_shard(torch.zeros(1, 8), 3, 0)


def test_bad_shards_and_method_are_refused():
    q, k, v = torch.zeros(1, 4, 6, 8), torch.zeros(1, 3, 6, 8), torch.zeros(1, 3, 6, 8)
    with pytest.raises(ValueError, match="multiple of the 3 K/V heads"):
        cp_attention("ring", q, k, v, None)
    with pytest.raises(ValueError, match="two equal chunks"):
        cp_attention("ring", q[:, :, :5], k[:, :1, :5], v[:, :1, :5], None)
    with pytest.raises(ValueError, match="not one of ring, allgather"):
        cp_attention("ulysses", q, k, v, None)
