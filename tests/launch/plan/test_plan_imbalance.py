"""moe-plan under routing imbalance: each MoE layer priced at its busiest EP rank (--loads RUN_DIR, --imbalance
zipf:S), forced balance unchanged by default; redundant experts' memory and bytes in the plan."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from launch.config.run import load_config
from launch.plan.cli import main
from launch.plan.imbalance import (
    busiest_over_mean,
    measured_imbalance,
    zipf_imbalance,
    zipf_loads,
)
from launch.plan.planner import Machine, Options, make_plan
from launch.plan.presets import gpu_preset

TINY = str(Path(__file__).resolve().parents[3] / "configs" / "tiny.toml")
ROUTED = 3  # tiny.toml's routed MoE layers


def plan(overrides: list[str] = (), imbalance: tuple[float, ...] = ()):
    config = load_config(TINY, list(overrides))
    return make_plan(config, Machine(gpu_preset("h800"), 1), Options(config.train.recompute, imbalance=imbalance))


def test_forced_balance_is_the_default_and_factors_of_one_change_nothing():
    balanced, ones = plan(), plan(imbalance=(1.0,) * ROUTED)
    assert balanced.stage_costs == ones.stage_costs and balanced.step_seconds == ones.step_seconds


def test_a_skew_prices_expert_gemms_and_exchanges_at_the_busiest_rank():
    """Twice the rows on the busiest rank: the exchanges' link time doubles exactly (no fixed exchange cost on
    h800's preset), the expert GEMMs take longer, so does the step; the stage without MoE layers' compute does not."""
    balanced, skewed = plan(), plan(imbalance=(2.0,) * ROUTED)
    for flat, hot in zip(balanced.stage_costs, skewed.stage_costs):
        assert hot.ep_f == pytest.approx(2 * flat.ep_f, rel=1e-12) and hot.ep_b == pytest.approx(2 * flat.ep_b,
                                                                                                rel=1e-12)
        assert hot.f > flat.f if flat.ep_f else hot.f == flat.f
    assert skewed.step_seconds > balanced.step_seconds
    one_layer = plan(imbalance=(1.0, 1.0, 2.0))  # only the last MoE layer (the last stage's) is skewed
    assert one_layer.stage_costs[:-1] == balanced.stage_costs[:-1]
    assert one_layer.stage_costs[-1] == skewed.stage_costs[-1]


def test_zipf_skew_is_deterministic_and_redundant_experts_cut_it():
    """32 experts on EP4, top-2, p_i ~ i^-1.2, 4096 tokens: the busiest of 4 ranks holds the 8 most popular experts;
    spare slots placed for the loads bring the busiest rank towards the mean."""
    loads = zipf_loads(32, 2, 1.2, 4096)
    assert loads.sum() == 4096 * 2 and np.array_equal(loads, zipf_loads(32, 2, 1.2, 4096))
    ratios = [busiest_over_mean(loads, 4, spares) for spares in (0, 1, 2)]
    assert ratios[0] == pytest.approx(loads[:8].sum() / loads.sum() * 4)
    assert ratios[0] > 2.5 and ratios[0] > ratios[1] > ratios[2] >= 1
    assert busiest_over_mean(zipf_loads(32, 2, 0.0, 4096), 4) < 1.1  # S = 0: uniform popularity
    config = load_config(TINY, ["parallel.gpus_per_node=2"])  # EP2 in one node: replicas anywhere
    assert zipf_imbalance(config, 1.2, 256) == (busiest_over_mean(zipf_loads(8, 2, 1.2, 512), 2),) * ROUTED


def _metrics(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_measured_loads_are_the_mean_busiest_over_mean_of_a_runs_records(tmp_path):
    straggle = [{"step": s, "stragglers": {"ep": 2, "busiest_over_mean": [1.0 + s, 1.5, 2.0]}} for s in range(2)]
    run = _metrics(tmp_path / "run", [{"step": 0, "loss": 1.0}, *straggle])
    assert measured_imbalance(run, load_config(TINY)) == (1.5, 1.5, 2.0)
    out = tmp_path / "plan.json"
    assert main([TINY, "--loads", str(run), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ep"]["busiest_over_mean"] == [1.5, 1.5, 2.0]


@pytest.mark.parametrize("argv, message", [
    (["--imbalance", "zipf:-1"], "--imbalance 'zipf:-1' is not allowed: give zipf:S with a finite exponent S >= 0"),
    (["--imbalance", "pareto:1"], "--imbalance 'pareto:1' is not allowed"),
    (["--imbalance", "zipf:1.2", "--search", "--gpus", "4"], "--imbalance with --search"),
    (["--loads", "{empty}"], "--loads {empty}: {empty}/metrics.jsonl holds no 'stragglers' records"),
    (["--loads", "{nothing}"], "--loads {nothing}: no metrics.jsonl there"),
    (["--loads", "{ep4}"], "--loads {ep4}: measured on EP4 over 3 MoE layers, the config plans EP2 over 3"),
])
def test_bad_skew_input_is_refused_naming_the_flag(argv, message, tmp_path, capsys):
    dirs = {"empty": str(_metrics(tmp_path / "empty", [{"step": 0, "loss": 1.0}])), "nothing": str(tmp_path),
            "ep4": str(_metrics(tmp_path / "ep4", [{"stragglers": {"ep": 4, "busiest_over_mean": [2.0] * 3}}]))}
    assert main([TINY, *[a.format(**dirs) for a in argv]]) == 2
    assert message.format(**dirs) in capsys.readouterr().err


def test_redundant_experts_add_their_weights_copies_and_bytes():
    """R = 1 on tiny (EP2 in one node, fp32): each MoE layer a rank holds adds one expert's weights (3 H F, no
    optimizer state), each chunk through it keeps the owned and spare weights its grouped GEMMs ran on, and each
    optimizer step sends the spare's weights one way and its grads the other."""
    node = ["parallel.gpus_per_node=2"]
    without, spare = plan(node), plan([*node, "parallel.redundant_experts=1"])
    expert = 3 * 128 * 96 * 4
    for a, b in zip(without.ranks, spare.ranks):
        held = 2  # each pipeline rank holds two stages of one layer each, both MoE but stage 0's
        held -= 0 in a.stages
        assert b.states.params - a.states.params == held * expert
        assert (b.states.grads, b.states.optimizer) == (a.states.grads, a.states.optimizer)
        assert b.bytes["ep"].intra_node - a.bytes["ep"].intra_node == 2 * held * expert
        assert b.activations > a.activations
    assert replace(spare.ranks[0], states=without.ranks[0].states).peak < spare.ranks[0].peak
