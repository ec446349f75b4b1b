"""Topology, layout, permutation and the fp8 codec against plain loop references (single process)."""

from __future__ import annotations

import pytest
import torch

from dispatch import get_dispatch_layout, make_permutation, make_topology, permute, unpermute
from dispatch.fp8 import decode_fp8, encode_fp8, fp8_row_bytes
from dispatch.synthetic import synthetic_routing


def test_topology_maps_ranks_to_nodes_and_rejects_bad_splits():
    topo = make_topology(8, 4)
    assert [(topo.node_of(r), topo.local_rank(r)) for r in range(8)] == [(r // 4, r % 4) for r in range(8)]
    assert topo.num_nodes == 2 and topo.rank_at(1, 2) == 6
    assert make_topology(6).num_nodes == 1
    with pytest.raises(ValueError, match="gpus_per_node = 3 must divide the EP world size 8"):
        make_topology(8, 3)
    with pytest.raises(ValueError, match="gpus_per_node"):
        make_topology(8, 0)


@pytest.mark.parametrize("routing", ["uniform", "skewed", "node-limited"])
def test_layout_equals_a_naive_reference(routing):
    topo, experts = make_topology(8, 2), 32
    indices = synthetic_routing(50, experts, 6, routing, num_groups=4, topk_groups=2,
                                generator=torch.Generator().manual_seed(3))[0]
    indices[::3, 1] = -1
    layout = get_dispatch_layout(indices, experts, topo)
    in_rank = [[False] * 8 for _ in range(50)]
    per_expert = [0] * experts
    for t, row in enumerate(indices.tolist()):
        for e in row:
            if e >= 0:
                in_rank[t][e // 4] = True
                per_expert[e] += 1
    assert layout.is_token_in_rank.tolist() == in_rank
    assert layout.tokens_per_rank.tolist() == [sum(row[r] for row in in_rank) for r in range(8)]
    assert layout.tokens_per_node.tolist() == [sum(any(row[2 * n:2 * n + 2]) for row in in_rank) for n in range(4)]
    assert layout.tokens_per_expert.tolist() == per_expert


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([[0, 32]]), r"indices must lie in \[-1, 31\]"),
    (torch.tensor([[-2, 1]]), r"indices must lie in \[-1, 31\]"),
    (torch.tensor([0, 1]), r"indices must be \[num_tokens, top_k\]"),
    (torch.tensor([[0.0, 1.0]]), "indices must be an integer tensor"),
])
def test_layout_rejects_bad_indices(bad, message):
    with pytest.raises(ValueError, match=message):
        get_dispatch_layout(bad, 32, make_topology(4, 2))


def test_layout_rejects_experts_not_divisible_by_ranks():
    with pytest.raises(ValueError, match="num_experts = 30 must be divisible by the EP size 4"):
        get_dispatch_layout(torch.tensor([[0, 1]]), 30, make_topology(4, 2))


def test_permutation_is_stable_grouped_and_its_inverse_weighs_and_sums():
    groups = torch.tensor([[2, -1, 0], [0, 2, 1], [-1, -1, -1], [1, 0, 2]])
    perm = make_permutation(groups, 3)
    assert perm.counts.tolist() == [3, 2, 3]
    assert list(zip(perm.row.tolist(), perm.slot.tolist())) == [
        (0, 2), (1, 0), (3, 1), (1, 2), (3, 0), (0, 0), (1, 1), (3, 2)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, dtype=torch.float64, generator=gen).requires_grad_()
    weights = torch.rand(4, 3, dtype=torch.float64, generator=gen).requires_grad_()
    out = unpermute(permute(x, perm) * 2, perm, weights)
    kept = (groups >= 0).double()
    torch.testing.assert_close(out, 2 * x * (weights * kept).sum(1, keepdim=True), rtol=1e-14, atol=0)  # summation order differs: a few ulps
    assert torch.autograd.gradcheck(lambda a, w: unpermute(permute(a, perm), perm, w), (x, weights))


def test_fp8_codec_packs_scales_and_bounds_the_error():
    x = torch.randn(6, 300) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[2] = 0.0
    wire = encode_fp8(x)
    assert wire.dtype == torch.uint8 and wire.shape == (6, fp8_row_bytes(300)) == (6, 300 + 4 * 3)
    back = decode_fp8(wire, 300, torch.float32)
    blocks = torch.nn.functional.pad(x, (0, 84)).view(6, 3, 128).abs().amax(-1)
    step = (blocks / 448).repeat_interleave(128, dim=1)[:, :300]  # scale of each channel's block
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10 * scale below
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + step * 2 ** -9 + 1e-30).all()
    assert torch.equal(back[2], x[2])
    exact = torch.tensor([[448.0, -1.5, 0.25, 3.0] * 32])  # values e4m3 holds exactly at scale 1
    assert torch.equal(decode_fp8(encode_fp8(exact), 128, torch.float32), exact)
