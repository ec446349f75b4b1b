"""moe-plan memory: ZeRO's model-state formulas, the schedules' live chunks and parameter copies, activations."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from launch.config.run import load_config
from launch.metrics.flops import attention_shape
from launch.plan.compute import Precisions, head_seconds, moe_block_seconds
from launch.plan.memory import FP8_CACHED, ActivationModel, backward_workspace, schedule_peaks, zero_model_states
from launch.plan.params import count_params
from launch.plan.planner import Machine, Options, chunk_tokens, make_plan
from launch.plan.presets import GPUS, RECIPES
from launch.plan.timing import StageCost
from pipeline.schedules import build

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.parametrize("stage, gigabytes", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_stages_reproduce_the_papers_7_5b_model_on_64_gpus(stage, gigabytes):
    # ZeRO (Rajbhandari et al. 2020), Figure 1: 7.5B params, N_d = 64, K = 12: 120 / 31.4 / 16.6 / 1.9 GB
    states = zero_model_states(7.5e9, 64, stage, RECIPES["zero-paper"])
    assert states.total / 1e9 == pytest.approx(gigabytes, abs=0.05)


def test_zero_stage_bytes_split_two_two_twelve():
    psi, n = 1000.0, 8
    recipe = RECIPES["zero-paper"]
    assert (recipe.param, recipe.grad, recipe.optimizer) == (2, 2, 12)
    one, two, three = (zero_model_states(psi, n, s, recipe) for s in (1, 2, 3))
    assert (one.params, one.grads, one.optimizer) == (2 * psi, 2 * psi, 12 * psi / n)
    assert (two.params, two.grads, two.optimizer) == (2 * psi, 2 * psi / n, 12 * psi / n)
    assert (three.params, three.grads, three.optimizer) == (2 * psi / n, 2 * psi / n, 12 * psi / n)
    with pytest.raises(ValueError, match="ZeRO stage = 4 is not allowed"):
        zero_model_states(psi, n, 4, recipe)


@pytest.mark.parametrize("name, ranks, expected", [
    ("1f1b", 8, [8, 7, 6, 5, 4, 3, 2, 1]),   # PP on the first rank
    ("dualpipe", 8, [9] * 8),                # PP + 1 on every rank
    ("dualpipev", 4, [9] * 4),               # PP + 1 with PP = 8 stages on PP/2 ranks
])
def test_live_chunks_follow_the_dualpipe_table(name, ranks, expected):
    schedule = build(name, ranks, 32)
    assert schedule_peaks(schedule, [1.0] * schedule.layout.num_stages) == expected


@pytest.mark.parametrize("forward, backward, rank0", [(None, None, 5.0), (1.0, 2.0, 4.5), (1.0, 1.0, 4.0),
                                                      (2.0, 1.0, 4.0)])
def test_an_overlapped_pair_frees_while_its_forward_allocates(forward, backward, rank0):
    # DualPipeV on 2 ranks: rank 0 holds 4 chunks when its first F&B pair starts. Counted forward first the
    # pair peaks at 5; run at once at even rates, the backward has freed min(1, F/B) of its chunk when the
    # forward ends. Rank 1 holds 5 chunks at the end of its warm-up, before any pair.
    schedule = build("dualpipev", 2, 8)
    costs = None if forward is None else [StageCost(forward, backward, 0.0, 0.0, 0.0)] * 4
    assert schedule_peaks(schedule, [1.0] * 4, costs) == [rank0, 5.0]


def _tiny(**parallel):
    """The tiny model on a layout given in full (the shipped tiny config's own layout may change)."""
    layout = {"dp": 1, "tp": 1, "ep": 1, "gpus_per_node": 0, "num_chunks": 0, **parallel}
    overrides = [f"parallel.{k}={v!r}".replace("'", '"') for k, v in layout.items()]
    return load_config(CONFIGS / "tiny.toml", ["train.grad_accum_steps=8", "train.micro_batch_size=2", *overrides])


def test_dualpipe_holds_two_stages_per_rank_and_dualpipev_two_half_stages():
    machine = Machine(GPUS["h100"], 8)
    one = make_plan(_tiny(pp=4, schedule="1f1b"), machine, timed=False)
    dual = make_plan(_tiny(pp=4, schedule="dualpipe"), machine, timed=False)
    vee = make_plan(_tiny(pp=2, schedule="dualpipev"), machine, timed=False)
    assert [r.stages for r in dual.ranks] == [[0, 3], [1, 2], [1, 2], [0, 3]]
    assert [r.stages for r in vee.ranks] == [[0, 3], [1, 2]]
    for r in dual.ranks:
        assert r.dense_params + r.expert_params == sum(one.ranks[s].dense_params + one.ranks[s].expert_params
                                                       for s in r.stages)
    # DualPipe mirrors the stage pair on two ranks: ZeRO-1 shards over both, so optimizer bytes do not double
    assert dual.ranks[0].states.optimizer == pytest.approx((one.ranks[0].states.optimizer
                                                            + one.ranks[3].states.optimizer) / 2)


def test_a_backward_that_reruns_its_segments_holds_them_beside_the_live_chunks():
    # 1F1B on 4 ranks, 8 chunks of 1 byte per stage: rank 0 holds 4 chunks when its first backward starts, which
    # holds 3 bytes more while it reruns (a backward stage of 4 bytes); the last rank holds 1 chunk and 3 more
    schedule = build("1f1b", 4, 8)
    assert schedule_peaks(schedule, [1.0] * 4, backward_bytes=[4.0] * 4) == [7.0, 6.0, 5.0, 4.0]
    # DualPipeV's pairs: the rerun counted at the backward's start, beside none of the paired forward (rank 0: 4
    # chunks when its first pair starts); rank 1's first backward, after its 5-chunk warm-up, is not paired
    dualpipev = build("dualpipev", 2, 8)
    costs = [StageCost(1.0, 1.0, 0.0, 0.0, 0.0)] * 4
    assert schedule_peaks(dualpipev, [1.0] * 4, costs, backward_bytes=[1.5] * 4) == [4.5, 5.5]


def test_full_recompute_backward_peaks_at_the_largest_rerun_beside_the_layers_before_it():
    cfg = load_config(CONFIGS / "tiny.toml").model  # 1 dense + 3 MoE layers
    full = ActivationModel(cfg, count_params(cfg).attention, 4, recompute="full")
    none = replace(full, recompute="none")
    dense, moe = full.layer(False), full.layer(True)
    assert full.backward_layer(False) == none.layer(False)  # its input, saved again by the rerun, counted once
    # the last MoE layer reruns its attention (larger than its experts' SwiGLUs here) beside the 3 layers before it
    attention = none._attention() + none._norm()
    assert full.backward_layer(True) == max(moe + 2 * none._swiglu(96), attention, moe + none._swiglu(96))
    assert full.backward_stage(range(4), False, 10) == 10 * max(none.layer(False), dense + moe + moe
                                                               + full.backward_layer(True))
    assert none.backward_stage(range(4), True, 10) == none.stage(range(4), True, 10)


def test_moe_recompute_keeps_attention_and_the_norm_inputs_and_reruns_the_moe_block_in_backward():
    """Megatron-Core's `--recompute-modules layernorm moe` (planner recompute "moe"): an MoE layer keeps its attention
    whole (the attention norm fused into the q/k/v linear keeps its input and output), its FFN norm's input only and
    nothing of its MoE block, whose bytes come back beside the rest for its own backward; a dense layer and the head
    keep what they keep without recompute."""
    cfg = load_config(CONFIGS / "qwen3-235b-a22b.toml").model
    moe_mode = ActivationModel(cfg, count_params(cfg).attention, 2, 4, True, "moe", "fused")
    none = replace(moe_mode, recompute="none")
    hidden = 4096 * 2 / 4  # one hidden-wide bf16 tensor, split by SP
    qkv, out = none._core()
    assert moe_mode.layer(True) == 2 * hidden + qkv + out + hidden  # fused norm in and out, q/k/v, output; FFN norm in
    block = none.layer(True) - (none._attention() + none._norm())  # router, 8 slots over tp 4, no shared experts
    assert block == 8 * none._slot() / 4 + none._router() > 0
    assert moe_mode.backward_layer(True) == moe_mode.layer(True) + block
    assert moe_mode.layer(False) == none.layer(False) and moe_mode.head() == none.head()
    # less than this runtime's full recompute, which keeps each slot's expert input so as not to rerun the exchanges
    assert moe_mode.layer(True) < replace(none, recompute="full").layer(True) < none.layer(True)


def test_moe_recompute_reruns_each_moe_blocks_forward_and_exchanges_before_its_backward():
    """Under recompute "moe" a stage's B grows by its MoE blocks' forward (router, experts, slots) and the
    backward's exposed EP time by the forward's exchanges, F and W unchanged; no pair may overlap that rerun."""
    config = load_config(CONFIGS / "qwen3-235b-a22b.toml", ["parallel.dispatch_backend=flat"])
    machine, base = Machine(GPUS["h100"], 8), Options(kernels="fused", recipe="megatron")
    plain, rerun = (make_plan(config, machine, replace(base, recompute=mode)) for mode in ("none", "moe"))
    cfg, par = config.model, config.parallel
    block = moe_block_seconds(machine.gemms, cfg, chunk_tokens(config), par.tp, par.ep, Precisions.of(cfg)).f
    for a, b, layers in zip(plain.stage_costs, rerun.stage_costs, rerun.layers):
        assert (b.f, b.w, b.comm_f) == (a.f, a.w, a.comm_f)
        assert b.b - a.b == pytest.approx(block * len(layers))  # every Qwen3 layer is an MoE layer
        assert b.comm_b - a.comm_b == pytest.approx(a.ep_f) == b.ep_b - a.ep_b and a.ep_f > 0
    with pytest.raises(ValueError, match="paired 1F1B does not run with recompute 'moe'"):
        make_plan(config, machine, replace(base, recompute="moe", paired=True))


def test_layer_recompute_keeps_each_layers_input_and_reruns_the_whole_layer_in_backward():
    """The other stacks' full recompute (planner recompute "layer": a checkpoint around each whole block) keeps a
    layer's input only, split by SP, dense or MoE alike, and holds the whole layer's bytes again during its own
    backward; the head keeps what it keeps without recompute. An MoE layer keeps less than under this runtime's
    full recompute, which keeps the dispatched rows so as not to exchange them twice."""
    cfg = load_config(CONFIGS / "deepseek-v3.toml").model
    layer = ActivationModel(cfg, count_params(cfg).attention, 2, 4, True, "layer", "fused")
    none = replace(layer, recompute="none")
    hidden = 7168 * 2 / 4  # one hidden-wide bf16 tensor, split by SP over TP 4
    for moe in (False, True):
        assert layer.layer(moe) == hidden and layer.backward_layer(moe) == none.layer(moe) > hidden
    assert layer.head() == none.head()
    assert layer.layer(True) < replace(none, recompute="full").layer(True)
    assert layer.backward_stage(range(3, 6), False, 10) == 10 * (2 * hidden + none.layer(True))


@pytest.mark.parametrize("cp", [1, 2])
def test_layer_recompute_reruns_each_layers_forward_with_its_exchanges_and_collectives(cp):
    """Under recompute "layer" a stage's B grows by its layers' forward (not the head's) and the backward's exposed
    communication by the forward's (EP exchanges, TP collectives and, under CP, the K/V exchanges), F and W unchanged;
    the bytes a step sends grow by the same reruns; no pair may overlap them."""
    config = load_config(CONFIGS / "qwen3-235b-a22b.toml",
                         ["parallel.dispatch_backend=flat", f"parallel.cp={cp}", f"parallel.dp={16 // cp}"])
    machine, base = Machine(GPUS["h100"], 8), Options(kernels="fused", recipe="megatron")
    plain, rerun = (make_plan(config, machine, replace(base, recompute=mode)) for mode in ("none", "layer"))
    cfg, par = config.model, config.parallel
    assert par.tp > 1 and cfg.mtp_depth == 0
    head = head_seconds(machine.gemms, cfg, chunk_tokens(config), par.tp).f
    for stage, (a, b) in enumerate(zip(plain.stage_costs, rerun.stage_costs)):
        assert (b.f, b.w, b.comm_f, b.ep_f) == (a.f, a.w, a.comm_f, a.ep_f)
        assert b.b - a.b == pytest.approx(a.f - (head if stage == par.pp - 1 else 0.0))
        assert b.comm_b - a.comm_b == pytest.approx(a.comm_f) and a.comm_f > a.ep_f > 0
        assert b.ep_b - a.ep_b == pytest.approx(a.ep_f) and b.rerun_slots == a.slots / 2 > 0
    for a, b in zip(plain.ranks, rerun.ranks):
        before, after = ({kind: r.bytes[kind].intra_node + r.bytes[kind].inter_node for kind in r.bytes}
                         for r in (a, b))
        assert after["tp"] == pytest.approx(1.5 * before["tp"]) and before["tp"] > 0
        assert after["ep"] > before["ep"] > 0 and after["pp"] == before["pp"]
        assert (after["cp"] > before["cp"]) == (cp > 1)
    with pytest.raises(ValueError, match="paired 1F1B does not run with recompute 'layer'"):
        make_plan(config, machine, replace(base, recompute="layer", paired=True))


def test_sequence_parallel_and_recompute_shrink_activations():
    cfg = load_config(CONFIGS / "deepseek-v3.toml").model
    attention = count_params(cfg).attention
    sizes = {(sp, mode): ActivationModel(cfg, attention, 2, 4, sp, mode).layer(moe=True)
             for sp in (False, True) for mode in ("none", "selective", "full")}
    assert sizes[(True, "none")] < sizes[(False, "none")]
    assert sizes[(False, "full")] < sizes[(False, "selective")] < sizes[(False, "none")]
    # full: an MoE layer keeps its input and the FFN norm's output (bf16, split by SP; the router's input as given),
    # the router's logits and scores and 8 slots' ids/weights (+12), and per slot (8 over tp 4) the expert input, the
    # expert output and combine's weight and row ids; a dense layer keeps its input only
    router = 2 * 4 * 256 + 8 * 13 + 12
    routed = 8 * (2 * 7168 * 2 + 4 + 16) / 4
    assert sizes[(False, "full")] == 2 * 7168 * 2 + router + routed
    assert sizes[(True, "full")] == 2 * 7168 * 2 / 4 + router + routed
    dense = {sp: ActivationModel(cfg, attention, 2, 4, sp, "full").layer(moe=False) for sp in (False, True)}
    assert dense == {False: 7168 * 2, True: 7168 * 2 / 4}
    with pytest.raises(ValueError, match="recompute = 'most' is not allowed"):
        ActivationModel(cfg, attention, recompute="most")


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallelism_divides_each_ranks_activations_by_about_cp(cp):
    # the same micro-batches, each sequence over cp ranks: a rank keeps S / cp tokens of every layer (moe.cp's
    # attention core, in float32 with K/V unexpanded, differs a little from the fused one of a whole sequence)
    base = ["parallel.pp=1", 'parallel.schedule="none"', "parallel.num_chunks=0", "parallel.dp=1", "parallel.ep=1"]
    one = make_plan(load_config(CONFIGS / "tiny.toml", base), Machine(GPUS["h100"], 8), timed=False)
    split = make_plan(load_config(CONFIGS / "tiny.toml", [*base, f"parallel.cp={cp}"]), Machine(GPUS["h100"], 8),
                      timed=False)
    assert 0.8 / cp < split.ranks[0].activations / one.ranks[0].activations < 1.2 / cp
    # fused kernels (Transformer Engine's ring attention) keep the rank's own q, k, v and output as without CP
    fused = ActivationModel(one.config.model, one.params.attention, 2, kernels="fused")
    assert replace(fused, cp=cp)._core() == fused._core() != replace(fused, cp=cp, kernels="project")._core()
    before, after = one.ranks[0].states, split.ranks[0].states  # CP splits no parameter; ZeRO-1 shards over cp
    assert after.params == before.params and after.optimizer == pytest.approx(before.optimizer / cp)
    with pytest.raises(ValueError, match="cp_method = 'tree' is not allowed"):
        ActivationModel(one.config.model, one.params.attention, cp=2, cp_method="tree")


def test_deepseek_v3_plan_holds_4_experts_per_gpu_and_reaches_at_most_4_nodes():
    config = load_config(CONFIGS / "deepseek-v3.toml")
    plan = make_plan(config, Machine(GPUS["h800"], 8), Options(sample_tokens=256))
    ep = plan.ep
    assert (ep.ep, ep.nodes, ep.experts_per_gpu) == (64, 8, 4)
    assert ep.nodes_per_token_max == 4  # 8 groups of 32 experts = 8 nodes, 4 groups kept
    # hierarchical: one IB copy per other node (< 4 when the token's own node is chosen); flat: per rank
    assert 3.0 < ep.inter_copies_hierarchical < 4.0 < ep.inter_copies_flat
    assert plan.ranks[5].stages == [5, 10]
    assert plan.ranks[5].expert_params == 8 * 4 * 3 * 7168 * 2048  # 2 stages x 4 MoE layers x 4 experts


def test_backward_workspace_is_the_largest_grad_before_zero1_takes_it():
    v3 = load_config(CONFIGS / "deepseek-v3.toml")
    cfg, par = v3.model, v3.parallel
    experts = cfg.num_experts // par.ep  # 4 per rank at EP64
    # an FP8 MoE layer: the kernel's fp32 gate|up grad of the rank's 4 experts beside its bf16 cast
    assert backward_workspace(cfg, range(3, 5), False, False, par.ep, 1, 2, 4096) == 4 * 2 * 2048 * 7168 * (4 + 2)
    assert experts == 4
    # the first stage: the embedding's bf16 grad (129280 x 7168)
    assert backward_workspace(cfg, range(0, 4), True, False, par.ep, 1, 2, 4096) == 129280 * 7168 * 2
    # the last: the cross-entropy's two fp32 grads of a 4096-token chunk's logits (and log-probabilities)
    assert backward_workspace(cfg, range(58, 61), False, True, par.ep, 1, 2, 4096) == 2 * 4 * 129280 * 4096
    plan = make_plan(v3, Machine(GPUS["h800"], 8), Options(), timed=False)
    assert plan.ranks[0].peak == pytest.approx(plan.ranks[0].states.total + plan.ranks[0].activations
                                               + plan.ranks[0].workspace)


def test_fused_fp8_linears_keep_their_input_tiles_for_the_deferred_weight_grad():
    """A split backward leaves each linear's input and output grad to its W: in the training dtype for this
    project's and fused BF16 kernels; under fused-fp8 an FP8 linear's W holds its input's e4m3 1x128 tiles (its
    forward's, re-tiled along tokens when W runs) and the output grad in the training dtype (kernels.linear), the LM
    head (a plain nn.Linear) both in the training dtype."""
    cfg = load_config(CONFIGS / "deepseek-v3.toml").model
    bf16, fp8 = (ActivationModel(cfg, attention_shape(cfg), 2, kernels=k) for k in ("fused", "fused-fp8"))
    assert fp8._linear_pairs(7168, 1536) == 7168 * FP8_CACHED + 1536 * 2
    assert bf16._linear_pairs(7168, 1536) == (7168 + 1536) * 2
    tokens = 4096
    head = (cfg.hidden_size + cfg.padded_vocab_size) * 2 * tokens
    assert (fp8.deferred_stage(range(60, 61), True, tokens) - fp8.deferred_layer(True) * tokens
            == pytest.approx(head))
    assert fp8.deferred_layer(True) < bf16.deferred_layer(True)