"""The trainer under optim.zero_stage 2 and 3 and optim.offload equals the single-process run (float64, 5 steps),
reduces every backward, frees its full grads (and ZeRO-3 its dense params), and its checkpoints reshard to and from
other layouts; moe-plan's model states per rank match the measured and rehearsed ones, offload moves them to host.

Layouts of one world size train in one spawn (tests/launch/train/test_equivalence.py's method and tolerances: losses
1e-10 relative, consolidated params calc_diff < 1e-12); capacity factor 1.0 drops slots in the dp2 ep2 runs (on
test_equivalence's drop corpus, which leaves no drop to rounding).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from launch.parallel.spawn import run_processes
from launch.config.run import build_config, load_config
from launch.plan.measure import measure
from launch.plan.planner import Machine, make_plan
from launch.plan.presets import GPUS
from launch.train.loop import train
from optim.shard import ShardedParams
from optim.zero import ZeroOptimizer
from tests.launch.train.test_equivalence import (SPAWN_S, STEPS, check_equal_runs, check_resumed_runs, raw_config,
                                           release_groups, reshard, routed_corpus)
from tests.syncs import step_reads

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

# name -> ([parallel], [optim], capacity factor); grad_accum_steps 8: 4 micro-batches per DP rank
RUNS = {2: {"zero2 dp2 ep2 capacity 1.0": ({"dp": 2, "ep": 2}, {"zero_stage": 2}, 1.0),
            "zero3 dp2 ep2 capacity 1.0": ({"dp": 2, "ep": 2}, {"zero_stage": 3}, 1.0),
            "zero1 offload dp2": ({"dp": 2}, {"offload": "optimizer"}, None),
            "zero2 offload dp2 ep2 capacity 1.0": ({"dp": 2, "ep": 2}, {"zero_stage": 2, "offload": "optimizer"}, 1.0),
            "zero2 pp2 dualpipev, 2 pipeline steps per step": ({"pp": 2, "schedule": "dualpipev", "num_chunks": 4},
                                                               {"zero_stage": 2}, None)},
        # its EP exchange padded (issue 48): ZeRO-3's gathers and reductions read nothing to the host either
        4: {"zero3 pp2 dp2 ep2 dualpipev, B/W split, padded exchange": (
            {"pp": 2, "dp": 2, "ep": 2, "schedule": "dualpipev", "overlap_fb_pairs": False,
             "dispatch_exchange": "padded"}, {"zero_stage": 3}, None)}}
ROUTING_NAME = {None: "dropless", 1.0: "capacity 1.0"}


def zero_raw(path, corpus: str, parallel: dict, optim: dict, capacity: float | None) -> dict:
    """raw_config with an [optim] section."""
    return {**raw_config(str(path), corpus, parallel, capacity), "optim": optim}


def _train_counting(rank: int, world: int, raws: list[dict]) -> list[tuple[list[dict], list[int], list[int]]]:
    """Each run's records, the bucket reductions started per zero_grad-to-zero_grad step divided by the buckets
    this rank's optimizer holds, the full-grad bytes ZeRO-2 held after each step's optimizer update, and then the
    (groups of ZeRO-3-sharded params, the bytes of their full params held), and per forward and backward its host
    reads and statistics copies (tests/syncs.py step_reads)."""
    out = []
    for raw in raws:
        launches: list[int] = []
        held: list[int] = []
        buckets: list[int] = []
        params: list[tuple[int, int]] = []
        launch, zero_grad, step = ShardedParams.launch, ZeroOptimizer.zero_grad, ZeroOptimizer.step

        def counted_launch(self, bucket):
            launches[-1] += 1
            return launch(self, bucket)

        def counted_zero_grad(self, *args, **kwargs):
            launches.append(0)
            buckets.append(sum(len(shard.layout.buckets) for shard in self._shards))
            return zero_grad(self, *args, **kwargs)

        def measured_step(self, *args, **kwargs):
            result = step(self, *args, **kwargs)
            held.append(sum(g.untyped_storage().nbytes() for shard in self._shards for g in shard.grad_buckets))
            sharded = [shard for shard in self._shards if shard.shard_params]
            params.append((len(sharded), sum(shard.param_flat.untyped_storage().nbytes() for shard in sharded)))
            return result
        ShardedParams.launch, ZeroOptimizer.zero_grad = counted_launch, counted_zero_grad
        ZeroOptimizer.step = measured_step
        try:
            watched = raw["parallel"].get("dispatch_exchange") == "padded"  # the runs whose reads are checked
            with step_reads() if watched else contextlib.nullcontext([]) as attempts:
                records = release_groups(train(build_config(raw), progress=False))
        finally:
            ShardedParams.launch, ZeroOptimizer.zero_grad, ZeroOptimizer.step = launch, zero_grad, step
        reads = [(len(a.reads), a.copies) for a in attempts]
        out.append((records, [n / b for n, b in zip(launches, buckets)], held, params, reads))
    return out


@pytest.mark.parametrize("world", list(RUNS))
def test_zero2_layouts_equal_single_process(world, corpus, drop_corpus, reference, tmp_path):
    """Losses and params as one process; under ZeRO-2/3 each backward (micro-batch, or pipeline step) reduces every
    bucket once and no full grad buffer is held after the update, under ZeRO-3 no full dense param either (ZeRO-1,
    offloaded here: one reduction per step, full grads kept); with a padded EP exchange no forward or backward reads
    the device and each step copies its statistics once."""
    runs = RUNS[world]
    raws = [zero_raw(tmp_path / name.replace(" ", "_").replace(",", ""), routed_corpus(spec[2], corpus, drop_corpus),
                     *spec) for name, spec in runs.items()]
    assert {build_config(raw).parallel.world_size for raw in raws} == {world}
    results = run_processes(_train_counting, world, raws, timeout_s=600)
    for i, ((name, (parallel, _, capacity)), raw) in enumerate(zip(runs.items(), raws)):
        check_equal_runs(results[0][i][0], raw, reference(ROUTING_NAME[capacity]), parallel, name)
        micro = raw["train"]["grad_accum_steps"] // parallel.get("dp", 1)
        backwards = micro // parallel.get("num_chunks", micro) if "pp" in parallel else micro  # pipeline steps
        stage = raw["optim"].get("zero_stage", 1)
        for rank in range(world):
            _, launches, held, params, reads = results[rank][i]
            if parallel.get("dispatch_exchange") == "padded":
                assert reads == [(0, 1)] * STEPS, (name, rank, reads)
            assert all((n == 0) == (stage >= 2) for n in held), (name, rank, held)  # ZeRO-1 keeps its full grads
            assert all((groups > 0) == (stage == 3) and nbytes == 0 for groups, nbytes in params), (name, rank, params)
            assert launches == [backwards if stage >= 2 else 1] * STEPS, (name, rank, launches)


SHARDED = {"zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3},
           "zero2 offload": {"zero_stage": 2, "offload": "optimizer"}}  # resharded to and from 1 process in dp2 ep2


@pytest.fixture(scope="module")
def resharded(corpus, uninterrupted, tmp_path_factory) -> dict[str, list]:
    return reshard({name: ({"dp": 2, "ep": 2}, optim) for name, optim in SHARDED.items()}, corpus, uninterrupted,
                   tmp_path_factory.mktemp("reshard"))


@pytest.mark.timeout(SPAWN_S + 120)
@pytest.mark.parametrize("optim", list(SHARDED))
def test_sharded_checkpoints_reshard_to_and_from_one_process(optim, resharded, uninterrupted):
    """A 1-process ZeRO-1 checkpoint resumes under ZeRO-2/3 (or offloaded) dp2 ep2 and a ZeRO-2/3 (offloaded) dp2
    ep2 one in 1 process (ZeRO-1): both continue the uninterrupted 1-process run."""
    check_resumed_runs(uninterrupted, resharded[optim])


@pytest.mark.parametrize("optim, parallel, field", [
    ({"zero_stage": 4}, {}, "optim.zero_stage"),
    ({"zero_stage": 2}, {"dp": 2, "tp": 2}, "optim.zero_stage"),
    ({"zero_stage": 2}, {"dp": 2, "overlap_grad_reduce": False}, "parallel.overlap_grad_reduce"),
    ({"offload": "gpu"}, {}, "optim.offload"),
    ({"zero_stage": 3}, {"pp": 2, "schedule": "1f1b"}, "parallel.overlap_fb_pairs"),
    ({"zero_stage": 3, "offload": "optimizer"}, {}, "optim.offload"),
])
def test_bad_optim_settings_name_the_field(optim, parallel, field, corpus, tmp_path):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build_config(zero_raw(tmp_path, corpus, parallel, optim, None))


# the tiny config at dp2 x ep2 (no pipeline): dense params sharded over 2 DP ranks, each expert on one rank
TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"
DP2_EP2 = ["parallel.pp=1", "parallel.dp=2", "parallel.ep=2", 'parallel.schedule="none"', "parallel.gpus_per_node=0",
           'parallel.dispatch_backend="flat"', "train.seq_len=32", "train.grad_accum_steps=4"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_planned_model_states_match_the_measured_bytes_per_rank(stage):
    """moe-plan's params, grads and optimizer bytes per rank (zero_model_states at optim.zero_stage) within 10% of
    what a rank of the trainer holds after a step (optim.memory.model_state_bytes); each stage plans less."""
    config = load_config(TINY, [*DP2_EP2, f"optim.zero_stage={stage}"])
    plan = make_plan(config, Machine(GPUS["h800"], 8), timed=False)
    measured = measure(config, steps=1, timeout_s=300)
    for m in measured:
        states = plan.ranks[m.pp_rank].states
        for kind, want in (("params", states.params), ("grads", states.grads), ("optimizer", states.optimizer)):
            got = m.model_state_bytes[kind]
            assert abs(got - want) <= 0.10 * want, (m.rank, kind, got, want)
    if stage > 1:
        lower = make_plan(load_config(TINY, [*DP2_EP2, f"optim.zero_stage={stage - 1}"]), Machine(GPUS["h800"], 8),
                          timed=False)
        assert plan.ranks[0].states.total < lower.ranks[0].states.total


def test_plan_moves_the_offloaded_optimizer_to_host_memory():
    """optim.offload: no optimizer bytes on the GPU; on the host, per param of the rank's shard (fp32 training):
    AdamW's two moments (8), the fp32 master held apart from the param (4) and the grad shard's copy (4)."""
    on_gpu, offloaded = (make_plan(load_config(TINY, [*DP2_EP2, *extra]), Machine(GPUS["h800"], 8), timed=False).ranks[0]
                         for extra in ([], ['optim.offload="optimizer"']))
    shard = on_gpu.dense_params / 2 + on_gpu.expert_params  # dense over dp = 2, each expert on one rank
    assert offloaded.states.optimizer == 0 and on_gpu.states.host == 0
    assert offloaded.states.host == pytest.approx(16 * shard)
    assert (offloaded.states.params, offloaded.states.grads) == (on_gpu.states.params, on_gpu.states.grads)


@pytest.mark.parametrize("stage", [2, 3])
def test_rehearsal_on_meta_holds_the_planned_model_states(stage):
    """moe-train --rehearse of the tiny layout (DualPipeV pp2 x dp2, EP 2) under ZeRO-2/3: the rank's params,
    grads and optimizer bytes as moe-plan's within 1%; ZeRO-3 all-gathers over dp = 2 during forward and
    backward, many more times than ZeRO-2's one gather per bucket after the step."""
    from launch.plan.rehearse import rehearse  # here only: this module's spawned ranks need not import its tracing stack
    overrides = [f"optim.zero_stage={stage}", "parallel.overlap_fb_pairs=false"]
    result = rehearse(load_config(TINY, overrides))
    for category in ("params", "grads", "optimizer"):
        assert result.peak[category] == pytest.approx(result.planned[category], rel=0.01), category
    gathers = {k: calls for k, group, calls, _ in result.collectives.rows() if group == 2 and "allgather" in k}
    if stage == 3:
        lower = rehearse(load_config(TINY, ["optim.zero_stage=2", "parallel.overlap_fb_pairs=false"]))
        fewer = {k: calls for k, group, calls, _ in lower.collectives.rows() if group == 2 and "allgather" in k}
        assert sum(gathers.values()) > 4 * sum(fewer.values()) > 0, (gathers, fewer)


def test_plan_prices_the_offloaded_optimizers_copies_over_the_host_link():
    """Per step a rank copies its fp32 grad shard to the host and its updated params back, both directions at
    once: 4 bytes per param of its shard over the GPU's host link, added to the step."""
    machine = Machine(GPUS["h800"], 8)
    on_gpu, offloaded = (make_plan(load_config(TINY, [*DP2_EP2, *extra]), machine)
                         for extra in ([], ['optim.offload="optimizer"']))
    rank = offloaded.ranks[0]
    want = 4 * (rank.dense_params / 2 + rank.expert_params) / (GPUS["h800"].host_gbps * 1e9)
    assert on_gpu.offload_seconds == 0 and offloaded.offload_seconds == pytest.approx(want)
    assert offloaded.step_seconds == pytest.approx(on_gpu.step_seconds + want)
