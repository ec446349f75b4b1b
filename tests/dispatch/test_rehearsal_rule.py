"""The rehearsal routing rule (dispatch.rehearsal_rule): the MoE path runs forward and backward on meta tensors,
over a fake process group of 2048 ranks, creating nothing off meta, and counts what the rule's closed
form says; the rule agrees with dispatch.predict on a real routing built to be balanced."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from dispatch import EPDispatcher, make_topology
from dispatch import rehearsal_rule
from dispatch.fp8 import fp8_row_bytes
from dispatch.layout import get_dispatch_layout
from dispatch.predict import COUNT_BYTES, META_BYTES_PER_SLOT, predict_traffic, received_rows
from dispatch.traffic import Traffic
from moe.config import ModelConfig
from moe.layer import MoELayer

META = torch.device("meta")


class DeviceRecorder(TorchDispatchMode):
    """Counts the device of every tensor every op returns; remembers the ops that returned one off meta."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: Counter[str] = Counter()
        self.off_meta: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.devices[leaf.device.type] += 1
                if leaf.device.type != "meta":
                    self.off_meta.append(f"{func} -> {leaf.device}")
        return out

    def ops(self) -> int:
        """Tensors recorded so far."""
        return sum(self.devices.values())


@pytest.fixture
def fake_world():
    """init_process_group("fake") at a chosen rank and world size; destroyed after the test. Skips when this
    process already has a default group (the fake one would replace it)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int, world_size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_recorder_sees_a_tensor_created_off_meta():
    x = torch.empty(4, 2, device=META)
    with DeviceRecorder() as rec:
        x.new_zeros(3)
        torch.zeros(3)  # the default device: the CPU
    assert rec.devices["meta"] == 1 and len(rec.off_meta) == 1


# --- (1) one process holding all experts --------------------------------------------------------------

def _small_v3(precision: str, capacity_factor: float | None) -> ModelConfig:
    """DeepSeek-V3's router and expert settings, shrunk."""
    return ModelConfig(hidden_size=256, num_heads=4, num_kv_heads=4, num_experts=16, top_k=4, num_groups=4,
                       topk_groups=2, expert_ffn_size=128, num_shared_experts=1, score_func="sigmoid",
                       route_scale=2.5, seq_aux_loss_coeff=1e-4, bias_update_rate=1e-3,
                       capacity_factor=capacity_factor, expert_precision=precision)


@pytest.mark.parametrize("precision", ["native", "fp8"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_single_process_layer_runs_on_meta(precision, capacity_factor):
    cfg = _small_v3(precision, capacity_factor)
    with torch.device(META):
        layer = MoELayer(cfg).to(torch.bfloat16)
    seqs, seq_len = 2, 64
    tokens = seqs * seq_len
    rows = []
    layer.experts.register_forward_hook(lambda mod, args, out: rows.append((args[0].shape[0], out.shape)))
    x = torch.empty(seqs, seq_len, cfg.hidden_size, dtype=torch.bfloat16, device=META, requires_grad=True)
    with DeviceRecorder() as rec:
        out, stats = layer(x, seq_len=seq_len)
        forward_ops = rec.ops()
        (out.float().sum() + stats.aux_loss).backward()
    assert rec.off_meta == []
    assert forward_ops > 0 and rec.ops() > forward_ops  # backward ran under the recorder too
    assert out.shape == x.shape and out.dtype == torch.bfloat16 and x.grad.shape == x.shape
    for p in layer.parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.is_meta
    assert stats.tokens_per_expert.shape == (cfg.num_experts,) and stats.tokens_per_expert.dtype == torch.int64
    assert stats.dropped.shape == () and stats.aux_loss.shape == ()
    # every expert gets T*k/E slots; a capacity keeps min(capacity, that) of them
    balanced = tokens * cfg.top_k // cfg.num_experts
    kept = balanced if capacity_factor is None else min(balanced, math.ceil(capacity_factor * balanced))
    assert rows == [(cfg.num_experts * kept, (cfg.num_experts * kept, cfg.hidden_size))]


# --- (2) expert parallel over a fake group ----------------------------------------------------------

def _expected_hops(tokens: int, k: int, experts: int, ep: int, nodes: int, rank: int, backend: str,
                   capacity: int | None) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(sends, receives, peers) per hop, by the rule's closed form, written out independently of it."""
    gpn, per_rank = ep // nodes, experts // ep
    slots = [tokens * k // experts + (e < tokens * k % experts) for e in range(experts)]
    if capacity is not None:
        slots = [min(capacity, n) for n in slots]
    rows = [min(tokens, sum(slots[r * per_rank:(r + 1) * per_rank])) for r in range(ep)]
    if backend == "flat":
        return [rows], [[rows[rank]] * ep], [list(range(ep))]
    node, local = divmod(rank, gpn)
    per_node = [min(tokens, sum(rows[n * gpn:(n + 1) * gpn])) for n in range(nodes)]
    rail = [n * gpn + local for n in range(nodes)]
    mine = list(range(node * gpn, (node + 1) * gpn))
    across = [per_node[r // gpn] if r in rail else 0 for r in range(ep)]
    inside = [nodes * rows[r] if r in mine else 0 for r in range(ep)]
    return ([across, inside], [[across[rank] if r in rail else 0 for r in range(ep)],
                               [inside[rank] if r in mine else 0 for r in range(ep)]], [rail, mine])


EP_CASES = {  # name: (world size, fake global rank, EP group's global ranks (None: the world), gpus per node)
    "ep64_of_2048_node5": (2048, 1000, list(range(960, 1024)), 8),
    "ep64_of_2048_node0": (2048, 963, list(range(960, 1024)), 8),
    "ep8_world": (8, 5, None, 4),
    "ep2_of_16": (16, 7, [6, 7], 1),
}


@pytest.mark.parametrize("backend", ["flat", "hierarchical"])
@pytest.mark.parametrize("payload", ["bf16", "fp8"])
@pytest.mark.parametrize("case", sorted(EP_CASES))
@pytest.mark.parametrize("tokens,capacity", [(128, None), (100, None), (128, 3)])
def test_ep_dispatch_and_combine_run_on_meta_and_count_the_rule(fake_world, backend, payload, case, tokens,
                                                                capacity):
    world, global_rank, ranks, gpn = EP_CASES[case]
    fake_world(global_rank, world)
    group = dist.new_group(ranks) if ranks is not None else None
    grad_group = dist.new_group(ranks if ranks is not None else list(range(world)))
    k, experts, hidden = 8, 256, 256
    d = EPDispatcher(experts, group=group, gpus_per_node=gpn, backend=backend, payload=payload, grad_group=grad_group)
    ep, rank = d.world_size, d.rank
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=META, requires_grad=True)
    weights = torch.empty(tokens, k, device=META, requires_grad=True)
    indices = rehearsal_rule.mark_capacity(torch.empty(tokens, k, dtype=torch.int64, device=META), capacity)
    with DeviceRecorder() as rec:
        recv, info, handle = d.dispatch(x, indices, weights)
        out = d.combine(recv * 2, handle)
        out.float().sum().backward()
    assert rec.off_meta == [] and rec.ops() > 0
    assert out.shape == x.shape and x.grad.shape == x.shape and weights.grad.shape == weights.shape

    sends, recvs, peers = _expected_hops(tokens, k, experts, ep, ep // gpn, rank, backend, capacity)
    per_rank = experts // ep
    slots = [tokens * k // experts + (e < tokens * k % experts) for e in range(experts)]
    if capacity is not None:
        slots = [min(capacity, n) for n in slots]
    assert info.num_recv_tokens == sum(recvs[-1])
    assert recv.shape == (ep * sum(slots[rank * per_rank:(rank + 1) * per_rank]), hidden)
    assert info.tokens_per_local_expert.shape == (per_rank,)

    row = fp8_row_bytes(hidden) if payload == "fp8" else hidden * 2
    expected: Counter[int] = Counter()
    for send, got, hop_peers in zip(sends, recvs, peers):
        for p in range(ep):
            if p == rank:
                continue
            expected[p] += COUNT_BYTES * (p in hop_peers)                # the row counts
            expected[p] += send[p] * (row + META_BYTES_PER_SLOT * k)     # dispatch: payload + routing metadata
            expected[p] += got[p] * hidden * 2                           # combine: one bf16 row per row received
            expected[p] += send[p] * hidden * 2                          # combine's backward: grads out
            expected[p] += got[p] * (hidden * 2 + 4 * k)                 # dispatch's backward: grads + weight grads
    assert d.meter.sent_to == {p: n for p, n in expected.items() if n}
    if (world, backend, tokens, capacity) == (2048, "hierarchical", 128, None):  # V3's shape: every node once
        assert sends[0] == [tokens if r % gpn == rank % gpn else 0 for r in range(ep)]


# --- (3) the rule against dispatch.predict on a real balanced routing ---------------------------------

def _balanced_routing(tokens: int, k: int, experts: int, ep: int, nodes: int) -> torch.Tensor:
    """[T, k] CPU routing whose slot i = t*k + j goes to node i % N, local rank (i // N) % G, local expert
    (i // R) % L: each expert gets T*k/E slots (when E divides T*k), a token's slots hit min(k, R) ranks
    on min(k, N) nodes."""
    gpn, per_rank = ep // nodes, experts // ep
    i = torch.arange(tokens * k).view(tokens, k)
    rank = (i % nodes) * gpn + (i // nodes) % gpn
    return rank * per_rank + (i // ep) % per_rank


@pytest.mark.parametrize("ep,gpn,tokens,k,experts", [(16, 4, 32, 4, 32), (16, 8, 32, 4, 32), (8, 2, 24, 8, 16),
                                                     (64, 8, 32, 8, 256)])
def test_rule_matches_predict_traffic_on_a_balanced_routing(ep, gpn, tokens, k, experts):
    topo = make_topology(ep, gpn)
    indices = _balanced_routing(tokens, k, experts, ep, topo.num_nodes)
    assert get_dispatch_layout(indices, experts, topo).tokens_per_expert.tolist() == \
        rehearsal_rule.expert_slots(tokens, k, experts)
    hidden = 128
    for backend in ("flat", "hierarchical"):
        predicted = predict_traffic([indices] * ep, experts, topo, hidden, backend, "fp8")
        for rank in (0, ep - 1, ep // 2 + 1):
            plan = rehearsal_rule.plan_dispatch(tokens, k, experts, topo, rank, backend)
            dispatch, combine = Traffic(), Traffic()
            for step, (send, got) in enumerate(zip(plan.sends, plan.recvs)):
                for p in range(ep):
                    if p == rank:
                        continue
                    inter = not topo.same_node(rank, p)
                    if _in_hop(topo, backend, step, rank, p):
                        dispatch.add(inter, "meta", COUNT_BYTES)
                    dispatch.add(inter, "payload", send[p] * fp8_row_bytes(hidden))
                    dispatch.add(inter, "meta", send[p] * META_BYTES_PER_SLOT * k)
                    combine.add(inter, "payload", got[p] * hidden * 2)
            assert dispatch == predicted[rank]["dispatch"], (backend, rank)
            assert combine == predicted[rank]["combine"], (backend, rank)
            assert plan.received_rows == received_rows([indices] * ep, experts, ep)[rank]


def _in_hop(topo, backend: str, step: int, rank: int, peer: int) -> bool:
    """Whether peer trades counts with rank in hop `step` (flat: everyone; hierarchical: the same local
    index across nodes, then the same node)."""
    if backend == "flat":
        return True
    return topo.local_rank(peer) == topo.local_rank(rank) if step == 0 else topo.same_node(rank, peer)


def test_rule_remainder_goes_to_the_lowest_experts_and_capacity_caps_each():
    assert rehearsal_rule.expert_slots(10, 3, 8) == [4, 4, 4, 4, 4, 4, 3, 3]
    assert rehearsal_rule.expert_slots(10, 3, 8, capacity=3) == [3] * 8
    assert rehearsal_rule.rank_rows(10, 3, 8, 4) == [8, 8, 8, 6]
    assert rehearsal_rule.rank_rows(4, 8, 8, 2) == [4, 4]  # k > ep: every token reaches every rank once
    topo = make_topology(8, 2)
    plan = rehearsal_rule.plan_dispatch(64, 2, 16, topo, 3, "hierarchical")
    assert plan.sends[0] == [0, 32, 0, 32, 0, 32, 0, 32] and plan.sends[1] == [0, 0, 64, 64, 0, 0, 0, 0]
    assert plan.received_rows == 8 * 16 and plan.expert_rows == [64, 64]
