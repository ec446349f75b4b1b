"""moe-plan's step of one pipeline rank by kind of work (launch.plan.compute.WORK_KINDS), the kinds `moe-bench gpu`
sums a profiled step's kernels into (launch.bench.breakdown), so a GPU result says which of the planner's terms is
off (`moe-plan --measure-gpu`: launch.plan.measure_gpu).

Every term the planner prices for a rank's step goes to one kind: the compute of each chunk's F, B and W by kind
(Plan.stage_work: launch.plan.compute's terms, a recompute's rerun under its own kinds), over the rank's compute
actions of one optimizer step; "communication" the EP exchanges, TP and CP collectives the actions leave exposed (as
launch.plan.timing.action_seconds prices them: an overlapped F&B pair hides some) and the DP gradient sync after the
step; "elementwise & copy" the offloaded optimizer's copies to and from the host. No priced term is left for an
"other". moe-plan prices no optimizer step (Plan.step_seconds), so "optimizer" has no prediction (UNPRICED).
The rank's idle time in a pipeline (bubble, waits on p2p) is no kind: Plan.step_seconds less the kinds' sum.
"""

from __future__ import annotations

from launch.plan.compute import COMMUNICATION, ELEMENTWISE, OPTIMIZER, WORK_KINDS, Work
from launch.plan.planner import Plan, make_schedule
from launch.plan.timing import action_seconds, paired
from pipeline.schedules import Op

UNPRICED = {OPTIMIZER: "moe-plan prices no optimizer step (its AdamW kernels; Plan.step_seconds)"}
PRICED = tuple(kind for kind in WORK_KINDS if kind not in UNPRICED)


def _add(out: dict[str, float], work: Work, op: Op, split: bool, times: float) -> None:
    """Add `times` of work's F, B (split: without its weight grads) or W, kind by kind, to out."""
    for kind, s in work.kinds.items():
        out[kind] += times * {Op.F: s.f, Op.B: s.b - (s.w if split else 0.0), Op.W: s.w}[op]


def step_kinds(plan: Plan, rank: int = 0) -> dict[str, float]:
    """Seconds of pipeline rank `rank`'s optimizer step by kind of work (PRICED, in WORK_KINDS' order; see the
    module doc). They sum to the rank's busy time in the plan's pipeline steps plus the DP sync and offload after them:
    Plan.step_seconds itself without a pipeline. ValueError for a plan priced from a measured profile (its stages'
    seconds are totals, not split by kind)."""
    if not plan.stage_work:
        raise ValueError("this plan's stage seconds come from a measured profile (--profile): they are not split by "
                         "kind of work; plan without the profile")
    config, machine = plan.config, plan.machine
    if not 0 <= rank < config.parallel.pp:
        raise ValueError(f"rank {rank} is not a pipeline rank of this plan (0 to {config.parallel.pp - 1})")
    costs = (paired(plan.stage_costs, machine.comm_sm_share, machine.pair_hidden) if plan.options.paired
             else plan.stage_costs)
    steps, schedule = plan.pipeline_steps, make_schedule(config)
    out = dict.fromkeys(PRICED, 0.0)
    if schedule is None:  # the micro-batches in turn, nothing overlapped (make_plan's serial)
        chunks = steps * config.chunks_per_step
        for op in (Op.F, Op.B):
            _add(out, plan.stage_work[0], op, False, chunks)
        out[COMMUNICATION] += chunks * (costs[0].comm_f + costs[0].comm_b)
    else:
        def stage_of(phase: int) -> int:
            return schedule.layout.stage_of(rank, phase)

        for action in schedule.compute_actions(rank):
            compute = 0.0
            for half in action.halves():
                stage, times = stage_of(half.phase), len(half.chunks) if half.op is Op.W else 1
                _add(out, plan.stage_work[stage], half.op, half.split, steps * times)
                compute += times * costs[stage].compute(half.op, half.split)
            took = action_seconds(action, costs, stage_of, config.parallel.overlap_fb_pairs,
                                  comm_share=machine.comm_sm_share)
            out[COMMUNICATION] += steps * (took - compute)  # what the action's communication leaves exposed
    out[COMMUNICATION] += plan.dp_sync_seconds
    out[ELEMENTWISE] += plan.offload_seconds
    return out
