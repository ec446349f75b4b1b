"""The planner on a profiled machine: each stage's measured seconds drive the pipeline simulator (ranks that
share cores run faster while others wait), checked against the 1F1B bubble formula; a profile of another
layout is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from launch.config.run import load_config
from launch.plan.planner import Machine, make_plan
from launch.plan.presets import GPUS
from launch.plan.profile import StageSeconds, Profile

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"
ONE_F_ONE_B = ["parallel.pp=2", "parallel.dp=1", "parallel.ep=1", 'parallel.schedule="1f1b"']
STAGE = StageSeconds(f=1.0, b=1.4, w=0.6)  # a full backward: 2.0
# links so fast the p2p hops vanish: the bubble is the schedule's alone
INSTANT = replace(GPUS["h800"], intra_node_gbps=1e12, inter_node_gbps=1e12)


def _plan(overrides: list[str], profile: Profile):
    config = load_config(TINY, overrides)
    return make_plan(config, Machine(INSTANT, config.parallel.gpus_per_node or config.parallel.world_size,
                                     profile=profile))


def test_stage_costs_are_the_profiled_seconds():
    profile = Profile([STAGE, StageSeconds(2.0, 3.0, 1.0)], ranks=2, cores=2)
    plan = _plan(ONE_F_ONE_B, profile)
    assert [(c.f, c.b, c.w, c.comm_f, c.comm_b) for c in plan.stage_costs] == [(1.0, 2.0, 0.6, 0, 0),
                                                                              (2.0, 4.0, 1.0, 0, 0)]


def test_equal_stages_give_the_1f1b_bubble_formula():
    plan = _plan(ONE_F_ONE_B, Profile([STAGE, STAGE], ranks=2, cores=2))
    chunks, pp = plan.config.chunks_per_step, 2
    assert plan.idle_fraction == pytest.approx((pp - 1) / (chunks + pp - 1), rel=1e-6)
    assert plan.idle_fractions == pytest.approx([(pp - 1) / (chunks + pp - 1)] * pp, rel=1e-6)


def test_ranks_sharing_cores_speed_up_while_a_pipeline_rank_waits():
    profile = Profile([STAGE, STAGE], ranks=4, cores=2)   # pp2 x dp2 on 2 cores: profiled a pipeline rank at a time
    assert profile.speed(2)(1) == 1.0 and profile.speed(2)(2) == 0.5
    assert Profile([STAGE, STAGE], ranks=2, cores=2).speed(2) is None
    layout = [*ONE_F_ONE_B[:1], "parallel.dp=2", *ONE_F_ONE_B[2:]]
    shared, alone = _plan(layout, profile), _plan(layout, replace(profile, cores=4))
    # the two cores are never idle (some pipeline rank can always run, the hops are instant), so the step takes
    # the profiled seconds (each measured on a core of its own) of every action of all 4 ranks over the 2 cores
    per_rank = shared.config.chunks_per_step * (STAGE.f + STAGE.b + STAGE.w)
    assert shared.makespan == pytest.approx(4 * per_rank / 2, rel=1e-6)
    assert alone.makespan == pytest.approx(per_rank + STAGE.f + STAGE.b + STAGE.w, rel=1e-6)  # 1F1B's bubble
    assert shared.idle_fraction < alone.idle_fraction


def test_a_profile_of_another_layout_is_refused():
    with pytest.raises(ValueError, match="profile has 3 stages, the layout 2"):
        _plan(ONE_F_ONE_B, Profile([STAGE] * 3, ranks=2, cores=2))
