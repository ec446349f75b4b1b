"""TopKRouter against the naive per-token reference in tests/moe/naive.py."""

from __future__ import annotations

import pytest
import torch

import moe.router
from moe.router import TopKRouter
from tests.moe import naive
from tests.moe.helpers import make_router, naive_route, tokens


def assert_matches(router: TopKRouter, x: torch.Tensor, **call) -> tuple:
    """Router output equals the naive reference (indices exactly, weights to 1e-6); returns both."""
    got = router(x, **call)
    ref = naive_route(router, x)
    assert got.indices.dtype == torch.int64 and got.weights.dtype == torch.float32
    assert got.indices.tolist() == ref.indices
    torch.testing.assert_close(got.weights, torch.tensor(ref.weights, dtype=torch.float32), atol=1e-6, rtol=0)
    return got, ref


@pytest.mark.parametrize("score_func,norm_topk,route_scale", [
    ("softmax", True, 1.0), ("softmax", False, 1.0), ("sigmoid", True, 2.5), ("sigmoid", False, 1.0)])
def test_indices_and_weights_match_naive(score_func, norm_topk, route_scale):
    router = make_router(score_func=score_func, norm_topk=norm_topk, route_scale=route_scale)
    got, ref = assert_matches(router, tokens(64))
    assert got.dropped.item() == 0
    assert got.tokens_per_expert.tolist() == [sum(row.count(e) for row in ref.indices) for e in range(8)]


def test_expert_bias_steers_selection_but_not_weights():
    router = make_router(score_func="sigmoid", norm_topk=False)
    with torch.no_grad():
        router.expert_bias[5] = 10.0
    got, ref = assert_matches(router, tokens(32))
    assert all(5 in row for row in got.indices.tolist())
    assert torch.all(got.weights < 1.0)  # a sigmoid score, not score + bias


def test_scores_are_fp32_for_bf16_input():
    router = make_router()
    x = tokens(32).bfloat16()
    got = router(x)
    ref = naive_route(router, x.float())
    assert got.weights.dtype == torch.float32
    assert got.indices.tolist() == ref.indices
    torch.testing.assert_close(got.weights, torch.tensor(ref.weights, dtype=torch.float32), atol=1e-6, rtol=0)


def test_bf16_router_keeps_no_fp32_copy_of_its_input_and_has_the_cast_path_grads():
    """The gate runs in fp32 on a bf16 input without keeping the fp32 copies autograd's casts keep (an fp32 input
    copy is twice the input: DeepSeek-V3's 28 KB per token and MoE layer); its grads are the cast path's, bitwise."""
    x = tokens(32).bfloat16().requires_grad_()
    router = make_router().bfloat16()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logits = moe.router.promoted_linear(x, router.weight, torch.float32)
    assert {(tuple(t.shape), t.dtype) for t in saved} == {(tuple(x.shape), torch.bfloat16),
                                                          (tuple(router.weight.shape), torch.bfloat16)}
    grad = torch.randn_like(logits)
    got = torch.autograd.grad(logits, (x, router.weight), grad)
    w = router.weight.detach().requires_grad_()
    x2 = x.detach().requires_grad_()
    want = torch.autograd.grad(torch.nn.functional.linear(x2.float(), w.float()), (x2, w), grad)
    for g, r in zip(got, want):
        assert g.dtype == torch.bfloat16 and torch.equal(g, r)


def test_group_limited_routing_stays_in_kept_groups():
    groups, topk_groups, group_size = 4, 2, 4
    router = make_router(16, 4, score_func="sigmoid", num_groups=groups, topk_groups=topk_groups)
    x = tokens(64)
    got, ref = assert_matches(router, x)
    for experts, kept in zip(got.indices.tolist(), ref.kept_groups):
        spanned = {e // group_size for e in experts}
        assert spanned <= kept
        assert len(spanned) <= topk_groups
    ungrouped = naive.route(x.double().tolist(), router.weight.double().tolist(),
                            router.expert_bias.double().tolist(), top_k=4, score_func="sigmoid")
    assert any(len({e // group_size for e in row}) > topk_groups for row in ungrouped.indices), \
        "the data must be able to show a routing that ignores the group limit"


@pytest.mark.parametrize("drop_policy", ["probs", "position"])
def test_capacity_keeps_the_right_slots(drop_policy):
    router = make_router(capacity_factor=0.55, drop_policy=drop_policy, skew=2.0)
    x = tokens(64)
    got, ref = assert_matches(router, x)
    capacity = 9  # ceil(0.55 * 64 * 2 / 8) = ceil(8.8)
    assert router.capacity(64) == capacity
    assert got.tokens_per_expert.max().item() <= capacity
    assert got.tokens_per_expert.tolist() == [sum(row.count(e) for row in ref.indices) for e in range(8)]
    assert got.dropped.item() == sum(row.count(-1) for row in ref.indices) > 0


def test_capacity_ties_and_policies_on_exact_scores():
    """Integer logits make exact score ties: probs keeps the best score (earliest on ties), position the earliest."""
    router = TopKRouter(4, 1, 4, capacity_factor=0.5)  # capacity ceil(0.5 * 8 * 1 / 4) = 1
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    low, high = [1.0, 0.0, -1.0, -2.0], [2.0, 0.0, -1.0, -2.0]
    x = torch.tensor([low] * 4 + [high] * 4)
    assert router(x).indices[:, 0].tolist() == [-1, -1, -1, -1, 0, -1, -1, -1]
    router.drop_policy = "position"
    assert router(x).indices[:, 0].tolist() == [0, -1, -1, -1, -1, -1, -1, -1]


def test_dropless_drops_nothing_under_heavy_skew():
    router = make_router(skew=4.0)
    got, ref = assert_matches(router, tokens(64))
    assert router.capacity(64) is None
    assert got.dropped.item() == 0 and bool((got.indices >= 0).all()) and bool((got.weights > 0).all())
    assert got.tokens_per_expert.sum().item() == 64 * 2
    assert got.tokens_per_expert[0].item() > 64 * 2 // 8  # over what a capacity_factor of 1 would keep


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_losses_equal_their_formulas(score_func):
    coeffs = dict(aux_loss_coeff=0.01, seq_aux_loss_coeff=0.001, z_loss_coeff=0.0001)
    router = make_router(score_func=score_func, capacity_factor=0.5, skew=2.0, **coeffs)
    got, ref = assert_matches(router, tokens(64), seq_len=16)
    assert got.dropped.item() > 0  # f_e must count the chosen slots, dropped ones included
    expected = {"load_balance": naive.load_balance_loss(ref, 8, 2),
                "seq_balance": naive.seq_balance_loss(ref, 8, 2, 16),
                "z": naive.z_loss(ref)}
    for name, value in expected.items():
        assert got.losses[name].item() == pytest.approx(value, rel=1e-5), name
    weighted = (coeffs["aux_loss_coeff"] * expected["load_balance"]
                + coeffs["seq_aux_loss_coeff"] * expected["seq_balance"] + coeffs["z_loss_coeff"] * expected["z"])
    assert got.aux_loss.item() == pytest.approx(weighted, rel=1e-5)


def test_aux_loss_is_zero_without_coefficients_and_has_router_grad_with_them():
    x = tokens(32)
    assert make_router()(x).aux_loss.item() == 0.0
    router = make_router(aux_loss_coeff=0.1)
    router(x).aux_loss.backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_seq_loss_needs_seq_len_dividing_tokens():
    router = make_router(seq_aux_loss_coeff=0.001)
    with pytest.raises(ValueError, match="seq_len"):
        router(tokens(30), seq_len=16)


def test_forced_balance_gives_every_expert_the_same_rows_and_each_token_distinct_experts():
    # model.force_balance (as Megatron-Core's --moe-router-force-load-balancing): what balance would recover
    router = TopKRouter(8, 3, 16, force_balance=True)
    x = torch.randn(40, 16, requires_grad=True)
    route = router(x)
    assert torch.equal(route.tokens_per_expert, torch.full((8,), 40 * 3 // 8))
    assert all(len(set(row)) == 3 for row in route.indices.tolist())
    route.weights.sum().backward()  # the weights are still the router's scores of those experts: the gate trains
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
