"""moe-plan bytes per link: every chunk's EP and p2p bytes counted once per stage it visits, whatever the schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.config.run import load_config
from launch.plan.planner import Machine, make_plan
from launch.plan.presets import GPUS

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"


def _plan(schedule: str):
    config = load_config(TINY, ["parallel.pp=4", "parallel.dp=2", "parallel.ep=2", "parallel.gpus_per_node=2",
                                f'parallel.schedule="{schedule}"', "train.grad_accum_steps=16"])
    return make_plan(config, Machine(GPUS["h100"], 2))


@pytest.mark.parametrize("kind", ["ep", "pp"])
def test_dualpipe_moves_the_bytes_of_1f1b_split_over_each_stage_pair(kind):
    # DualPipe: ranks r and 3 - r both hold stages r and 3 - r, each running half of the chunks through them
    one, dual = _plan("1f1b"), _plan("dualpipe")
    for r in range(4):
        pair = [one.ranks[r].bytes[kind], one.ranks[3 - r].bytes[kind]]
        for side in ("intra_node", "inter_node"):
            assert getattr(dual.ranks[r].bytes[kind], side) == pytest.approx(sum(getattr(t, side) for t in pair) / 2)
    assert sum(r.bytes[kind].intra_node + r.bytes[kind].inter_node for r in one.ranks) > 0


@pytest.mark.parametrize("method, shards", [("ring", 3 * 4 - 2), ("allgather", 2 * (4 - 1))])
def test_cp_sends_each_attention_layers_kv_shard_as_moe_cp_counts(method, shards):
    # cp4 x tp2, no pipeline: every micro-batch runs all 4 attention layers; a rank's K/V shard is its
    # 128 / 4 tokens x 2 sequences of 1 KV head (2 heads over tp 2) of 2 x 32 fp32 elements (moe.cp's dtype)
    config = load_config(TINY, ["parallel.pp=1", 'parallel.schedule="none"', "parallel.dp=1", "parallel.cp=4",
                                "parallel.tp=2", "parallel.ep=8", "parallel.gpus_per_node=8",
                                f'parallel.cp_method="{method}"', "parallel.num_chunks=0"])
    kv_shard = 2 * 128 // 4 * 1 * 2 * 32 * 4
    plan = make_plan(config, Machine(GPUS["h100"], 8))
    assert plan.ranks[0].bytes["cp"].intra_node == 4 * 8 * shards * kv_shard
    assert plan.ranks[0].bytes["cp"].inter_node == 0
    assert sum(c.comm_b for c in plan.stage_costs) > 0
