"""A plan as text tables and as a JSON-ready dict."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace

import torch

from launch.plan.efficiency import VALIDATED
from launch.plan.memory import RECOMPUTE, ActivationModel, schedule_peaks
from launch.plan.planner import BYTE_KINDS, Plan, chunk_tokens, make_schedule
from launch.plan.traffic import total

GB = 1e9


def si(value: float) -> str:
    """A count or byte size with an SI prefix (1.23M, 45.6G)."""
    for power, prefix in ((12, "T"), (9, "G"), (6, "M"), (3, "k")):
        if abs(value) >= 10 ** power:
            return f"{value / 10 ** power:.2f}{prefix}"
    return f"{value:.0f}"


def ms(seconds: float) -> str:
    """Seconds as milliseconds, 3 significant digits."""
    return f"{seconds * 1e3:.3g}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned text table."""
    cells = [list(map(str, header))] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def activation_variants(plan: Plan) -> list[tuple[bool, str, float]]:
    """(sequence parallel, recompute, peak activation GB of the busiest rank) for every combination."""
    cfg, par, train = plan.config.model, plan.config.parallel, plan.config.train
    base = ActivationModel(cfg, plan.params.attention, getattr(torch, train.dtype).itemsize, par.tp, False,
                           "none", plan.options.kernels, par.cp, par.cp_method)
    schedule = make_schedule(plan.config)
    tokens = chunk_tokens(plan.config)
    out = []
    for sp in (False, True):
        for mode in RECOMPUTE:
            model = replace(base, sequence_parallel=sp, recompute=mode)
            stage = [model.stage(span, s == len(plan.layers) - 1, tokens) for s, span in enumerate(plan.layers)]
            deferred = [model.deferred_stage(span, s == len(plan.layers) - 1, tokens)
                        for s, span in enumerate(plan.layers)]
            backward = [model.backward_stage(span, s == len(plan.layers) - 1, tokens)
                        for s, span in enumerate(plan.layers)]
            peaks = schedule_peaks(schedule, stage, None, deferred, backward) if schedule else [backward[0]]
            out.append((sp, mode, max(peaks) / GB))
    return out


def _gemms(plan: Plan) -> str:
    flat = plan.machine.gemm_efficiency
    if flat is not None:
        return f"at {flat:.0%} of peak"
    linears = plan.options.linears
    return (f"priced by shape and precision ({linears or 'bf16 dense, experts per config'}; "
            f"launch/plan/efficiency.py; at x{plan.machine.clock:g} of the boost clock, attention "
            f"x{plan.machine.attention_clock:g}), {plan.machine.slot_seconds * 1e9:g} ns per routed slot")


def known_error() -> str:
    """The planner's error on the published runs (efficiency.VALIDATED), as one line under a plan's throughput."""
    (fitted, fit_low, fit_high), (held, low, high) = VALIDATED["fitted"], VALIDATED["held_out"]
    return (f"known error (moe-plan --validate): predicted/published tokens/s {fit_low:.2f}-{fit_high:.2f} on the "
            f"{fitted} published runs its constants are fitted to, {low:.2f}-{high:.2f} on {held} held out; "
            f"{VALIDATED['within']} of {fitted + held} within +-20%")


def to_dict(plan: Plan) -> dict:
    """Every figure of the plan, JSON-ready (bytes in bytes, times in seconds)."""
    par = plan.config.parallel
    ep = plan.ep
    return {
        "layout": {**asdict(par), "world_size": par.world_size, "gpus_per_node": plan.machine.gpus_per_node,
                   "chunks_per_step": plan.config.chunks_per_step, "pipeline_steps": plan.pipeline_steps},
        "machine": {**asdict(plan.machine.gpu), "gemm_efficiency": plan.machine.gemm_efficiency,
                    "comm_sm_share": plan.machine.comm_sm_share, "slot_seconds": plan.machine.slot_seconds,
                    "clock": plan.machine.clock, "attention_clock": plan.machine.attention_clock,
                    "pair_hidden": plan.machine.pair_hidden},
        "attention": plan.params.attention.kind,
        "params": {"total": plan.params.total.total, "activated": plan.params.activated, "mtp": plan.params.mtp.total,
                   "activated_with_embedding": plan.params.activated_with_embedding,
                   "stages": [{"layers": [s.start, s.stop], **asdict(p), "total": p.total}
                              for s, p in zip(plan.layers, plan.params.stages)]},
        "ranks": [{"rank": r.rank, "stages": r.stages, "dense_params": r.dense_params,
                   "expert_params": r.expert_params, **{f"{k}_bytes": v for k, v in asdict(r.states).items()},
                   "activation_bytes": r.activations, "recompute_transient_bytes": r.transient,
                   "backward_workspace_bytes": r.workspace,
                   "peak_bytes": r.peak, "bytes_per_step": {k: v.as_dict() for k, v in r.bytes.items()}}
                  for r in plan.ranks],
        "activation_variants_gb": [{"sequence_parallel": sp, "recompute": m, "peak_gb": gb}
                                   for sp, m, gb in activation_variants(plan)],
        "ep": None if ep is None else {**{k: v for k, v in asdict(ep).items() if k != "layer"},
                                       "layer_bytes": {k: v.as_dict() for k, v in ep.layer.items()},
                                       "busiest_over_mean": list(plan.options.imbalance) or None},
        "time": {"stage_costs": [asdict(c) for c in plan.stage_costs], "p2p_s": plan.p2p_seconds,
                 "pipeline_makespan_s": plan.makespan, "idle_fraction": plan.idle_fraction,
                 "dp_sync_s": plan.dp_sync_seconds, "step_s": plan.step_seconds,
                 "tokens_per_step": plan.tokens_per_step, "tokens_per_s": plan.tokens_per_second,
                 "tokens_per_s_per_gpu": plan.tokens_per_second / par.world_size,
                 "model_flops_per_token": plan.flops_per_token, "peak_flops_per_gpu": plan.peak_flops,
                 "mfu": plan.mfu},
        "known_error": {kind: dict(zip(("runs", "lowest_ratio", "highest_ratio"), VALIDATED[kind]))
                        for kind in ("fitted", "held_out")} | {"within_20_percent": VALIDATED["within"]},
        "peak_memory_bytes": plan.peak_memory, "fits": plan.fits,
    }


def render(plan: Plan) -> str:
    """The plan as text: parameters, memory per rank, EP routing, bytes per link, time."""
    par, gpu = plan.config.parallel, plan.machine.gpu
    p = plan.params
    parts = [f"layout: pp={par.pp} dp={par.dp} tp={par.tp} ep={par.ep} schedule={par.schedule} "
             f"chunks={plan.config.chunks_per_step} x {plan.pipeline_steps} pipeline step(s) on {par.world_size} "
             f"GPUs ({par.world_size // plan.machine.gpus_per_node} nodes of {plan.machine.gpus_per_node})",
             f"machine: {gpu.name}: {gpu.bf16_tflops:g} TFLOPS bf16 / {gpu.fp8_tflops:g} fp8 dense, "
             f"{gpu.memory_gb:g} GB, NVLink {gpu.intra_node_gbps:g} GB/s, inter-node {gpu.inter_node_gbps:g} GB/s "
             f"per GPU; GEMMs {_gemms(plan)}, "
             f"{plan.machine.comm_sm_share:.0%} of SMs held by communication while it overlaps compute",
             f"  source: {gpu.source}",
             "",
             f"parameters ({p.attention.kind} attention): total {si(p.total.total)}, activated per token "
             f"{si(p.activated)} ({si(p.activated_with_embedding)} with the input embedding)"
             + (f"; +MTP {si(p.mtp.total)} (model.mtp_depth = {plan.config.model.mtp_depth}, on the last stage)"
                if p.mtp.total else ""),
             table(["stage", "layers", "dense", "expert", "total"],
                   [[s, f"{span.start}-{span.stop - 1}", si(q.dense), si(q.expert), si(q.total)]
                    for s, (span, q) in enumerate(zip(plan.layers, p.stages))]),
             "",
             f"memory per GPU (bytes; ZeRO-{plan.config.optim.zero_stage}"
             f"{', optimizer offloaded' if plan.config.optim.offload != 'none' else ''}, recompute="
             f"{plan.options.recompute}, sequence_parallel={par.sequence_parallel}):",
             table(["pp rank", "stages", "dense params", "expert params", "params", "grads", "optimizer",
                    "activations", "recompute", "bwd ws", "peak"],
                   [[r.rank, ",".join(map(str, r.stages)), si(r.dense_params), si(r.expert_params),
                     *map(si, (r.states.params, r.states.grads, r.states.optimizer, r.activations, r.transient,
                               r.workspace, r.peak))] for r in plan.ranks]),
             f"peak {si(plan.peak_memory)}B of {gpu.memory_gb:g} GB: {'fits' if plan.fits else 'DOES NOT FIT'}"
             + (f"; host memory per GPU (offloaded optimizer): {si(max(r.states.host for r in plan.ranks))}B"
                if plan.config.optim.offload != "none" else ""),
             "",
             "activation peak of the busiest rank by sequence parallelism and recomputation:",
             table(["SP", "recompute", "bytes"],
                   [[sp, mode, si(gb * GB)] for sp, mode, gb in activation_variants(plan)])]
    if plan.ep:
        ep = plan.ep
        parts += ["", f"EP{ep.ep}: {ep.experts_per_gpu} routed experts per GPU over {ep.nodes} node(s); nodes per "
                  f"token max {ep.nodes_per_token_max}, mean {ep.nodes_per_token_mean:.2f}; inter-node copies per "
                  f"token: hierarchical {ep.inter_copies_hierarchical:.2f}, flat {ep.inter_copies_flat:.2f} "
                  f"(routing of {ep.sampled_tokens} tokens scaled to {ep.tokens_per_rank} per rank)",
                  f"one MoE layer, one micro-batch, one rank ({par.dispatch_backend}, {par.dispatch_payload} payload), "
                  f"bytes sent:",
                  table(["kind", "intra-node", "inter-node"],
                        [[k, si(v.intra_node), si(v.inter_node)] for k, v in ep.layer.items()]),
                  "routing: " + (f"busiest EP rank's rows over the balanced share per MoE layer "
                                 f"{', '.join(f'{f:.3f}' for f in plan.options.imbalance)} (its expert GEMMs and "
                                 "exchanges priced there)" if plan.options.imbalance else
                                 "forced balance (every EP rank the mean rows; --loads or --imbalance price a skew)")]
    parts += ["", "bytes sent per GPU per optimizer step:",
              table(["pp rank", *[f"{k} {side}" for k in BYTE_KINDS for side in ("intra", "inter")],
                     "all intra", "all inter"],
                    [[r.rank, *[si(getattr(r.bytes[k], f"{side}_node")) for k in BYTE_KINDS
                                for side in ("intra", "inter")],
                      si(total(r.bytes).intra_node), si(total(r.bytes).inter_node)] for r in plan.ranks]),
              "",
              "time per chunk and stage (ms; comm = EP all-to-all, TP collectives and CP K/V, exposed unless "
              f"overlapped; slots: of F + B, the routed slots' handling at {plan.machine.slot_seconds * 1e9:g} ns "
              "a slot):",
              table(["stage", "F", "B", "W", "comm F", "comm B", "slots"],
                    [[s, *map(ms, (c.f, c.b, c.w, c.comm_f, c.comm_b, c.slots + c.rerun_slots))]
                     for s, c in enumerate(plan.stage_costs)]),
              *([f"paired 1F1B: a steady-state pair hides {plan.machine.pair_hidden:g} of the EP exchanges the other "
                 "half's compute could cover (--pair-hidden); TP and CP collectives stay exposed"]
                if plan.options.paired else []),
              f"pipeline step {ms(plan.makespan)} ms (bubble {plan.idle_fraction:.1%} of all ranks' time, "
              f"largest rank idle {max(plan.idle_fractions, default=0.0):.1%}, p2p hop "
              f"{ms(plan.p2p_seconds)} ms) x {plan.pipeline_steps} + DP grad sync {ms(plan.dp_sync_seconds)} ms "
              f"= step {ms(plan.step_seconds)} ms",
              f"tokens/s {plan.tokens_per_second:,.0f} ({plan.tokens_per_second / par.world_size:,.0f} per GPU), "
              f"model FLOPs/token {si(plan.flops_per_token)} (causal attention), MFU {plan.mfu:.1%} of "
              f"{plan.peak_flops / 1e12:,.0f} TFLOPS per GPU (bf16"
              f"{', routed experts at fp8' if plan.config.model.expert_precision == 'fp8' else ''})",
              known_error()]
    return "\n".join(parts)
