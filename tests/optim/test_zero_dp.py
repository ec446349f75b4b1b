"""ZeroOptimizer over 2 and 4 gloo processes against single-process AdamW on the whole batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from launch.parallel.spawn import run_processes
from optim import optimizer_state_bytes, warmup_cosine
from tests.optim import cases

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]  # slow: spawns processes (tests/conftest.py)


def rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest per-tensor ||got - want|| / ||want||."""
    return max(float((g.float() - w).norm() / w.norm()) for g, w in zip(got, want, strict=True))


def by_group(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Model-order params of cases.mlp reordered as the optimizer's groups (weights, biases)."""
    return tensors[0::2] + tensors[1::2]


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return cases.reference()


@pytest.fixture(scope="module")
def dp4() -> list[dict[str, Any]]:
    return run_processes(cases.dp_worker, 4, None, timeout_s=300)


@pytest.fixture(scope="module")
def dp2(dp4: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return run_processes(cases.dp_worker, 2, dp4[0]["saved"], timeout_s=300)


@pytest.fixture(params=[2, 4])
def run(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return request.getfixturevalue(f"dp{request.param}")


def test_clipping_is_active_in_the_reference(ref: dict[str, Any]) -> None:
    assert all(n > 2 * cases.MAX_NORM for n in ref["norms"])


def test_params_equal_single_process_adamw(run: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for out in run:
        assert out["buckets"] > 1
        assert rel_diff(out["params"], ref["params"]) <= 1e-6
        assert out["norms"] == pytest.approx(ref["norms"], rel=1e-6)


def test_grads_are_reduced_in_place(run: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    """The reduced grads are each rank's own pieces of its full fp32 buffers (both collectives): no separate
    reduced shard; p2p's receive rows, one per peer, are its only extra (scatter_gather: none)."""
    world = len(run)
    for out in run:
        assert out["reduced_in_place"] and all(out["reduced_in_place"])
        assert out["buffer_bytes"]["grad_shards"] == 0
        rows = world - 1 if cases.COLLECTIVES_BY_WORLD[world] == "p2p" else 0
        assert out["buffer_bytes"]["scratch"] == pytest.approx(4 * rows * ref["numel"] / world, rel=0.05)


def test_unclipped_steps_equal_single_process_adamw(run: list[dict[str, Any]]) -> None:
    want = cases.reference(max_norm=None)["params"]
    for out in run:
        assert rel_diff(out["unclipped_params"], want) <= 1e-6


def test_accumulation_communicates_only_in_step(dp2: list[dict[str, Any]]) -> None:
    for out in dp2:
        assert out["backward_calls"] == [[0] * cases.MICRO] * cases.STEPS
        assert min(out["step_calls"]) > 0


def test_overlap_communicates_only_in_last_backward(dp4: list[dict[str, Any]]) -> None:
    for out in dp4:
        for counts in out["backward_calls"]:
            assert counts[:-1] == [0] * (cases.MICRO - 1) and counts[-1] > 0


def test_state_bytes_are_12_params_over_n(run: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    world = len(run)
    plain = torch.optim.AdamW(cases.mlp().parameters())
    for p in plain.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    plain.step()
    assert optimizer_state_bytes(plain) == pytest.approx(12 * ref["numel"], rel=0.01)
    for out in run:
        sharded = out["state_bytes"]
        assert sharded["master"] + sharded["exp_avg"] + sharded["exp_avg_sq"] \
            == pytest.approx(12 * ref["numel"] / world, rel=0.01)
        assert sharded["total"] <= 1.01 * 12 * ref["numel"] / world


def test_state_dict_holds_full_reference_state(dp4: list[dict[str, Any]],
                                               ref: dict[str, Any]) -> None:
    saved = dp4[0]["saved"]["state"]
    want = ref["at_save"]
    got_params = [saved[i]["master"] for i in range(len(saved))]
    assert rel_diff(got_params, by_group(want["params"])) <= 1e-6
    for key in ("exp_avg", "exp_avg_sq"):
        got = [saved[i][key] for i in range(len(saved))]
        assert rel_diff(got, [s[key] for s in want["state"]]) <= 1e-5


def test_reshard_save_at_4_load_at_2(dp4: list[dict[str, Any]],
                                     dp2: list[dict[str, Any]]) -> None:
    saved = dp4[0]["saved"]
    resaved = dp2[0]["resaved"]
    for i, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(resaved["state"][i][key], value), (i, key)
    assert resaved["param_groups"] == saved["param_groups"]
    for out in dp2:
        assert rel_diff(out["resumed_params"], dp4[0]["params"]) <= 1e-6


def test_bf16_model_with_fp32_masters_and_fp32_grad_sums(dp2: list[dict[str, Any]]) -> None:
    want = by_group(cases.bf16_reference(len(dp2)))
    for out in dp2:
        masters = out["bf16_masters"]
        for p, m in zip(by_group(out["bf16_params"]), masters, strict=True):
            assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
        assert rel_diff(masters, want) <= 1e-5


@pytest.mark.parametrize("collectives", ["p2p", "scatter_gather"])
def test_expert_params_averaged_over_expert_dp_only(run: list[dict[str, Any]],
                                                    collectives: str) -> None:
    runs = [out["ep"][collectives] for out in run]
    want = cases.ep_reference(len(run), len(runs[0]["norms"]))
    for run in runs:
        assert run["norms"] == pytest.approx(want["norms"], rel=1e-6)
        names = sorted(run["params"])
        assert len(names) == 4
        assert rel_diff([run["params"][n] for n in names],
                        [want["params"][n] for n in names]) <= 1e-6


def test_group_size_must_divide_world(dp4: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(dp4):
        expected = "not a member" if rank == 3 else "size 3 does not divide the world size 4"
        assert expected in out["group_error"]


def test_lr_scheduler_drives_inner_optimizers(dp2: list[dict[str, Any]]) -> None:
    base = [1e-2, 2e-2]
    want = [lr * warmup_cosine(s, 2, 6, 0.1) for s in range(6) for lr in base]
    for out in dp2:
        assert [lr for step in out["lr_used"] for lr in step] == pytest.approx(want, rel=1e-12)


def test_second_backward_inside_overlap_is_refused(dp2: list[dict[str, Any]]) -> None:
    for out in dp2:
        assert "wrap only the last backward" in out["misuse_error"]


def test_adamw_is_fused_unless_the_caller_picks(dp2: list[dict[str, Any]]) -> None:
    for out in dp2:
        assert out["implementation"] == {"default": {(True, None)}, "foreach": {(None, True)}}


def test_other_p2p_traffic_does_not_match_zero1_messages(dp2: list[dict[str, Any]]) -> None:
    model = cases.mlp()
    torch.optim.AdamW(model.parameters()).step(
        lambda: model(cases.batch(0)[0]).square().mean().backward())
    for out in dp2:
        assert torch.equal(out["note"], torch.full((3,), 7.0))
        assert rel_diff(out["foreign_params"], cases.params_of(model)) <= 1e-6
