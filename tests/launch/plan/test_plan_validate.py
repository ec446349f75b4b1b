"""moe-plan --validate: every published run of the calibration file is planned in its own layout and printed
beside its published throughput with the ratio; a run outside the band is marked; the search never ranks a
layout that does not fit."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from launch.config.run import load_config
from launch.plan.calibrate import (BAND, MISS_FIELDS, PublishedRun, fit_pair_hidden, fit_slot_seconds, fitted_constants,
                                   load_runs, overlap_pairs, plan_run, render, validate)
from launch.plan.efficiency import MOE_HANDLING, SLOT_SECONDS, VALIDATED
from launch.plan.cli import main
from launch.plan.docs import PAGE, blocks, fill, stale
from launch.plan.planner import PAIR_HIDDEN, Machine
from launch.plan.presets import GPUS
from launch.plan.search import search

pytestmark = pytest.mark.slow  # one shared `moe-plan --validate` run takes seconds

ROOT = Path(__file__).resolve().parents[3]
GB200_V3_MISSES = ("deepseek-v3-gb200-bridge-2602", "deepseek-v3-gb200-megatron-guide")


def test_every_calibration_run_names_its_source_and_plans_in_its_own_layout():
    runs = load_runs()
    assert len(runs) >= 6 and len({r.name for r in runs}) == len(runs)
    for run in runs:
        assert run.source and run.tokens_per_s_per_gpu > 0 and run.gpu in GPUS and run.config
        config = load_config(ROOT / run.config, run.set)
        assert config.parallel.world_size == run.gpus
        assert plan_run(run).config.parallel == config.parallel  # the run's own layout, not a searched one


def test_a_run_without_a_public_layout_is_listed_not_planned(tmp_path):
    """A run whose layout is not public (no config) is listed with its figure and marked not planned; the
    counts and fits leave it out."""
    path = tmp_path / "runs.toml"
    path.write_text('[[run]]\nname = "secret"\nmodel = "m"\nstack = "s"\ngpu = "h100"\ngpus = 8\n'
                    'layout = "not stated"\nprecision = "BF16"\npublished = "1 tok/s"\ntokens_per_s_per_gpu = 1.0\n'
                    'source = "src"\n')
    checks = validate(path)
    assert [c.plan for c in checks] == [None] and checks[0].within is None
    text = render(checks, fitted_constants(checks))
    assert next(line for line in text.splitlines() if line.strip().startswith("secret ")).endswith("not planned")
    assert "inside +-20%: 0 of 0 planned runs" in text and "outside +-20%" not in text


@pytest.fixture(scope="module")
def validated(tmp_path_factory) -> tuple[str, dict]:
    """`moe-plan --validate --json FILE` run once: (what it printed, the JSON it wrote)."""
    out, printed = tmp_path_factory.mktemp("validate") / "validate.json", io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--validate", "--json", str(out)]) == 0
    return printed.getvalue(), json.loads(out.read_text())


def test_validate_prints_predicted_published_and_ratio_and_marks_misses(validated):
    text, result = validated
    rows = result["runs"]
    slots, pairs = result["constants"]["slot_seconds"], result["constants"]["pair_hidden"]
    assert set(slots) == set(MOE_HANDLING)
    for handling, slot in slots.items():
        assert slot["planned"] == SLOT_SECONDS[handling] and slot["runs"] >= 2
        assert (f"routed-slot cost, {handling} handling: {slot['planned'] * 1e9:g} ns planned, "
                f"{slot['fitted'] * 1e9:g} ns fitted to its {slot['runs']} MoE runs") in text
    assert len(pairs) == len(overlap_pairs(load_runs())) >= 2
    for pair in pairs:
        assert pair["planned"] == PAIR_HIDDEN and f"{pair['fitted']:g} fitted to {pair['paired']} against" in text
    inside = [r for r in rows if r["within_band"]]
    assert f"inside +-20%: {len(inside)} of {len(rows)} planned runs" in text
    assert [r["name"] for r in rows] == [r.name for r in load_runs()]
    header = next(line for line in text.splitlines() if line.strip().startswith("run"))
    assert all(word in header for word in ("handling", "predicted tok/s/GPU", "published", "ratio", "leave-one-out",
                                           "peak memory"))
    for row in rows:
        line = next(line for line in text.splitlines() if line.strip().startswith(row["name"] + " "))
        ratio = row["predicted_tokens_per_s_per_gpu"] / row["published_tokens_per_s_per_gpu"]
        assert row["ratio"] == ratio and row["moe_handling"] in MOE_HANDLING
        assert f"{ratio:.2f}" in line and f"{row['predicted_tokens_per_s_per_gpu']:,.0f}" in line
        assert f" {row['moe_handling']} " in line
        assert line.rstrip().endswith("ok" if abs(ratio - 1) <= BAND else "MISS")
        assert re.search(r"GB (fits|DOES NOT FIT)", line)
        assert row["source"] in text


def test_search_never_ranks_a_layout_that_does_not_fit_above_one_that_does():
    config = load_config(ROOT / "configs" / "tiny.toml", ["train.grad_accum_steps=8", "train.micro_batch_size=64",
                                                          "train.seq_len=256", "model.max_seq_len=256"])
    roomy = search(config, 4, Machine(GPUS["h100"], 4))
    peaks = sorted(p.peak_memory for p in roomy.ranked)
    limit = peaks[len(peaks) // 2] / 1e9  # a GPU that holds only the leaner half of the layouts
    tight = Machine(GPUS["h100"].__class__(**{**GPUS["h100"].__dict__, "memory_gb": limit}), 4)
    result = search(config, 4, tight)
    assert result.ranked and any("does not fit" in why for _, why in result.cut)
    assert all(p.fits for p in result.ranked)
    times = [p.step_seconds for p in result.ranked]
    assert times == sorted(times)


@pytest.fixture(scope="module")
def checks():
    """Every calibration run planned (with and without the routed-slot cost) and its leave-one-out ratio."""
    return validate()


def test_the_shipped_routed_slot_costs_are_the_fits_to_the_published_runs(checks):
    """efficiency.SLOT_SECONDS holds, per way of handling the slots, what that way's calibration runs give (to the
    fit's 1 ns grid); the fit prices a run on the line through its plans at 0 and at its shipped cost, which a plan at
    another cost falls on (the step time is linear in it)."""
    for handling in MOE_HANDLING:
        assert abs(fit_slot_seconds(checks, handling) - SLOT_SECONDS[handling]) <= 1e-9, handling
    planned = [c for c in checks if c.plan is not None]
    for check in planned:
        assert check.ratio_at(SLOT_SECONDS[check.run.moe_handling]) == pytest.approx(check.ratio, rel=1e-9)
    moe = [c for c in planned if c.slot_share > 0]
    assert len(moe) >= 8 and all(c.slot_share == 0 for c in planned if c.plan.config.model.num_moe_layers == 0)
    check = moe[0]
    doubled = plan_run(check.run, 2 * SLOT_SECONDS["synced"])
    published = doubled.tokens_per_step / (check.run.tokens_per_s_per_gpu * check.run.gpus)
    assert published / doubled.step_seconds == pytest.approx(check.ratio_at(2 * SLOT_SECONDS["synced"]), rel=0.01)


def test_captured_handling_predicts_the_runs_it_was_not_fitted_to(checks):
    """The captured cost, fitted to NVIDIA's HybridEP A/B of Qwen3-30B on 16 H100 only, predicts the other published
    runs of a captured stack (Qwen3-30B on 8 B200 at MBS4 on HybridEP; DeepSeek-V3 on 256 B200 and Qwen3-235B on 256
    H100, both on DeepEP with pairs; Qwen3-30B and Qwen3-235B on GB200) within the band, where the synced cost every
    other stack is planned with misses them all (0.32-0.76). The held-out runs include other GPUs and other models.
    DeepSeek-V3 on GB200 misses (1.26, 1.29): GB200_V3_MISSES, pinned by the next test."""
    captured = [c for c in checks if c.run.moe_handling == "captured"]
    fitted = [c for c in captured if c.run.fit]
    held_out = [c for c in captured if not c.run.fit and c.run.name not in GB200_V3_MISSES]
    assert {c.run.gpu for c in fitted} == {"h100"} and "b200" in {c.run.gpu for c in held_out}
    assert len(held_out) >= 3 and len({c.run.config for c in held_out} - {fitted[0].run.config}) >= 2
    for check in held_out:
        run = check.run
        assert check.within, (run.name, check.ratio)
        synced = plan_run(run, SLOT_SECONDS["synced"]).tokens_per_second / run.gpus / run.tokens_per_s_per_gpu
        assert synced < 0.78, (run.name, synced)
    assert SLOT_SECONDS["captured"] < SLOT_SECONDS["synced"] / 3


def test_deepseek_v3_on_gb200_misses_between_the_two_fitted_costs(checks):
    """The two held-out captured runs the captured cost misses, DeepSeek-V3 on GB200 (Megatron-Bridge 26.02's preset and
    NVIDIA's optimisation guide), imply a routed-slot cost between the captured and the synced ones: more than any
    other captured run implies, less than the synced cost. Qwen3 on the same GB200 preset implies less than 100 ns."""
    by_name = {c.run.name: c for c in checks}

    def implied(check) -> float:  # the slot cost at which the plan meets the published figure (ratio falls with it)
        low, high = 0.0, 2e-6
        for _ in range(40):
            low, high = ((low + high) / 2, high) if check.ratio_at((low + high) / 2) > 1 else (low, (low + high) / 2)
        return low

    for name in GB200_V3_MISSES:
        check = by_name[name]
        assert check.run.moe_handling == "captured" and not check.run.fit and not check.within, name
        assert SLOT_SECONDS["captured"] * 2.5 < implied(check) < SLOT_SECONDS["synced"], (name, implied(check))
    for name in ("qwen3-30b-gb200-bridge-2602", "qwen3-235b-gb200-bridge-2602", "qwen3-235b-gb200-bridge-2604"):
        assert by_name[name].within and implied(by_name[name]) < 100e-9, name


def test_torchtitans_published_a_b_ratios_are_planned_within_five_percent(checks):
    """torchtitan's DeepSeek-V3 on 256 B200 (held out) published two A/B steps on one layout: DeepEP for the NCCL
    all-to-all (x1.32) and then MXFP8 routed experts (x1.07). The planner misses the three absolute figures
    (their miss says why) but plans each step's gain within 5%: the exchange model (flat against hierarchical)
    and the FP8 expert GEMMs' pricing, not the rest of the step, are what the two changes touch."""
    by_name = {c.run.name: c for c in checks}
    steps = [("deepseek-v3-b200-torchtitan", "deepseek-v3-b200-torchtitan-deepep"),
             ("deepseek-v3-b200-torchtitan-deepep", "deepseek-v3-b200-torchtitan-mxfp8")]
    for before, after in steps:
        a, b = by_name[before], by_name[after]
        changed = ("parallel.dispatch_backend=", "model.expert_precision=")
        assert not a.run.fit and not b.run.fit and a.run.config == b.run.config and a.run.plan == b.run.plan
        kept = [[s for s in c.run.set if not s.startswith(changed)] for c in (a, b)]
        assert kept[0] == kept[1]
        published = b.run.tokens_per_s_per_gpu / a.run.tokens_per_s_per_gpu
        assert published > 1.05 and b.predicted / a.predicted == pytest.approx(published, rel=0.05), (before, after)


def test_the_gb200_preset_is_the_rack_spec_per_gpu():
    """GB200 NVL72's spec is a rack's: 360 / 720 PFLOPS BF16 / FP8 with sparsity, 13.4 TB HBM3e at 576 TB/s and 130
    TB/s of NVLink over 72 GPUs; the preset holds one GPU's dense share, NVLink one direction."""
    gpu = GPUS["gb200"]
    assert gpu.bf16_tflops == 360e3 / 72 / 2 and gpu.fp8_tflops == 720e3 / 72 / 2
    assert gpu.memory_gb == pytest.approx(13.4e3 / 72, abs=0.5) and gpu.hbm_gbps == 576e3 / 72
    assert gpu.intra_node_gbps == pytest.approx(130e3 / 72 / 2, rel=0.01)


def test_a_calibration_run_names_an_allowed_slot_handling():
    """A run's moe_handling is one of efficiency.MOE_HANDLING, refused by name otherwise."""
    with pytest.raises(ValueError, match="moe_handling = 'graphs' is not allowed; choose one of synced, captured"):
        PublishedRun(name="x", model="m", stack="s", gpu="h100", gpus=8, layout="l", precision="p", published="1",
            tokens_per_s_per_gpu=1.0, source="s", moe_handling="graphs")


def test_every_run_outside_the_band_states_the_assumption_it_breaks(checks, validated):
    """A planned run outside the band states which of the planner's assumptions its figure breaks and why public
    data cannot settle it (its miss: both fields); a run inside states none, so a miss the planner fixes goes too.
    --validate prints them under the table and in its JSON, and docs/planner.md's table of misses lists the same runs
    at the same ratios."""
    planned = [c for c in checks if c.plan is not None]
    misses = [c for c in planned if not c.within]
    unstated = [c.run.name for c in misses if set(c.run.miss) != set(MISS_FIELDS)]
    assert misses and not unstated, unstated
    assert not [c.run.name for c in planned if c.within and c.run.miss]
    text, result = validated
    section = text[text.index("outside +-20%: the assumption each run breaks"):]
    for c in misses:
        assert f"  {c.run.name} ({c.ratio:.2f})\n    assumes: {c.run.miss['assumption']}\n" in section
        assert f"    unknown: {c.run.miss['unknown']}\n" in section
    assert {r["name"] for r in result["runs"] if r["miss"]} == {c.run.name for c in misses}
    page = (ROOT / "docs" / "planner.md").read_text()
    rows = re.findall(r"^\| ([a-z0-9.-]+) \| \*\*(\d\.\d\d)\*\* \| ", page, re.M)
    assert sorted(rows) == sorted((c.run.name, f"{c.ratio:.2f}") for c in misses)



def test_the_planner_page_quotes_what_validate_gives(checks, validated):
    """docs/planner.md's generated blocks (the published runs planned, the fitted constants with the known error, the
    misses) are what `python -m launch.plan.docs` writes from the code now: a refit or a new run that leaves the page
    behind fails here, naming the blocks and the command."""
    page = PAGE.read_text()
    texts = blocks(checks, validated[1]["constants"])
    assert fill(page, texts) == page, \
        f"stale blocks in docs/planner.md: {stale(page, texts)}; run python -m launch.plan.docs"


def test_the_page_generator_refuses_a_page_without_its_blocks():
    with pytest.raises(ValueError, match="the page's generated blocks are none; python -m launch.plan.docs writes a"):
        fill("# no blocks\n", {"a": "x\n"})
    page = "<!-- generated by python -m launch.plan.docs: a -->\nold\n<!-- end of a -->\n"
    assert fill(page, {"a": "new\n"}) == page.replace("old", "new") and stale(page, {"a": "new\n"}) == ["a"]

def test_a_miss_gives_the_assumption_and_what_is_unknown():
    """A run's miss holds exactly an assumption and an unknown, each stated; anything else is refused by name."""
    kwargs = dict(name="x", model="m", stack="s", gpu="h100", gpus=8, layout="l", precision="p", published="1",
                  tokens_per_s_per_gpu=1.0, source="s")
    for miss in ({"assumption": "even routing"}, {"assumption": "even routing", "unknown": ""},
                 {"assumption": "even routing", "unknown": "  "}, {"assumption": "a", "unknown": 3},
                 {"assumption": "a", "unknown": "b", "why": "c"}):
        with pytest.raises(ValueError, match="calibration run x: miss must give exactly assumption and unknown"):
            PublishedRun(**kwargs, miss=miss)
    assert PublishedRun(**kwargs, miss={"assumption": "a", "unknown": "b"}).miss["unknown"] == "b"


def test_every_plan_states_the_error_validate_measures(checks, tmp_path, capsys):
    """The known error a plan prints (efficiency.VALIDATED) is what the calibration runs give now: per set (fitted,
    held out) the count and the lowest and highest ratio to 2 decimals, and the count within the band."""
    planned = [c for c in checks if c.plan is not None]
    for kind, fit in (("fitted", True), ("held_out", False)):
        ratios = [c.ratio for c in planned if c.run.fit == fit]
        assert VALIDATED[kind] == (len(ratios), round(min(ratios), 2), round(max(ratios), 2)), kind
    assert VALIDATED["within"] == sum(c.within for c in planned)
    out = tmp_path / "plan.json"
    assert main([str(ROOT / "configs" / "tiny.toml"), "--json", str(out)]) == 0
    fitted, held = VALIDATED["fitted"], VALIDATED["held_out"]
    assert (f"{fitted[1]:.2f}-{fitted[2]:.2f} on the {fitted[0]} published runs its constants are fitted to, "
            f"{held[1]:.2f}-{held[2]:.2f} on {held[0]} held out") in capsys.readouterr().out
    assert json.loads(out.read_text())["known_error"]["held_out"]["runs"] == held[0]


def test_the_shipped_pair_share_is_the_fit_to_the_published_overlap_a_b():
    """planner.PAIR_HIDDEN gives the model zoo's Qwen3-235B its published speedup from Megatron-Core's combined
    1F1B (17.6 against 19.7 s/step) to the fit's 0.01 grid; hiding every exchange the other half could cover
    would promise far more, hiding none nothing."""
    ((paired, alone),) = [(p, a) for p, a in overlap_pairs(load_runs()) if p.share_fit]
    assert paired.plan.get("paired") and not alone.plan.get("paired") and paired.config == alone.config
    assert fit_pair_hidden(paired, alone) == pytest.approx(PAIR_HIDDEN, abs=0.01)
    published = paired.tokens_per_s_per_gpu / alone.tokens_per_s_per_gpu
    base = plan_run(alone).step_seconds
    gain = {share: base / plan_run(paired, pair_hidden=share).step_seconds for share in (0.0, PAIR_HIDDEN, 1.0)}
    assert gain[0.0] == pytest.approx(1.0) and gain[PAIR_HIDDEN] == pytest.approx(published, rel=0.02)
    assert gain[1.0] > published + 0.1


def test_a_held_out_overlap_a_b_asks_every_exchange_hidden():
    """NVIDIA's A/B of Megatron-Core's EP overlap on HybridEP (Qwen3-30B, 16 H100, one stage: consecutive
    micro-batches paired) published x1.18; planned at the captured slot cost, pairs hiding all the EP exchanges the
    other half could cover give x1.17, the shipped share (PAIR_HIDDEN, fitted to the 2025 zoo's DeepEP A/B) x1.08:
    this stack's pairs hide all of it. The share stays one constant: DeepSeek-V3 on DeepEP in 26.04.01 (captured,
    paired) reads 1.01 at the shipped share and 1.31 hiding all."""
    ((paired, alone),) = [(p, a) for p, a in overlap_pairs(load_runs()) if not p.share_fit]
    assert paired.config == alone.config and paired.set == alone.set and paired.plan.get("paired")
    assert paired.moe_handling == alone.moe_handling == "captured"
    published = paired.tokens_per_s_per_gpu / alone.tokens_per_s_per_gpu
    base = plan_run(alone).step_seconds
    gain = {share: base / plan_run(paired, pair_hidden=share).step_seconds for share in (0.0, PAIR_HIDDEN, 1.0)}
    assert gain[0.0] == pytest.approx(1.0) and 1.0 < gain[PAIR_HIDDEN] < published - 0.05
    assert gain[1.0] == pytest.approx(published, abs=0.02) and fit_pair_hidden(paired, alone) == 1.0
    v3 = next(r for r in load_runs() if r.name == "deepseek-v3-b200-bridge-260401")
    assert v3.moe_handling == "captured" and v3.plan.get("paired")
    hiding_all = plan_run(v3, pair_hidden=1.0).tokens_per_second / v3.gpus / v3.tokens_per_s_per_gpu
    assert hiding_all > 1 + BAND


def release(run) -> tuple[int, ...]:
    """The Megatron-Bridge container a run's stack names, as numbers (26.02.01 -> (26, 2, 1)); () for other stacks."""
    found = re.search(r"Megatron-Bridge (\d+(?:\.\d+)+)", run.stack)
    return tuple(int(part) for part in found.group(1).split(".")) if found else ()


def test_each_run_fits_its_gpu_and_the_fit_predicts_runs_it_did_not_see(checks):
    """Every planned run fits its GPU's memory, as the published run did. Fitted to the other runs only, the slot
    cost predicts each MoE run within 0.7x-1.35x (Qwen3-30B on H100, two thirds of its time the slot cost: 1.30), and
    the shipped cost each held-out run of the releases it was fitted over (up to 26.02) within 0.7x-1.3x. Every
    held-out run, later releases included, is slower than its plan without the cost (1.08-4.5x): none makes it
    unneeded (the band the acceptance asks is +-20%: docs/planner.md)."""
    held_out = [c for c in checks if c.plan is not None and not c.run.fit]
    assert len(held_out) >= 8 and all(c.loo is None for c in held_out)
    for check in checks:
        if check.plan is None:
            continue
        assert check.plan.fits, (check.run.name, check.plan.peak_memory)
        if check.loo is not None:
            assert 0.7 <= check.loo <= 1.35, (check.run.name, check.loo)
    seen = [c for c in held_out if () < release(c.run) <= (26, 2)]
    assert len(seen) >= 5
    for check in seen:
        assert 0.7 <= check.ratio <= 1.3, (check.run.name, check.ratio)
    for check in held_out:
        assert check.ratio_at(0.0) > 1.0, (check.run.name, check.ratio_at(0.0))


def test_runs_of_one_benchmark_config_plan_alike_and_were_published_alike():
    """Qwen3-30B on 16 H100: Megatron-Bridge 26.02.01 and 26.04 ran one benchmark preset (v0.3.1's, unchanged in
    v0.4.0: EP16 on HybridEP, whatever 26.02.01's table columns say); planned in it, the two plan alike, and their
    published figures are 2% apart: the public record agrees with itself where the config is the same. The 26.02
    row, 1.77x slower, ran another config (PP2 VP12 EP8 on DeepEP) in a container NVIDIA reports without DeepEP."""
    runs = {run.name: run for run in load_runs()}
    early, late, later = (runs[f"qwen3-30b-h100-bridge-{tag}"] for tag in ("2602", "260201", "2604"))
    assert (late.config, late.set, late.plan, late.gpus) == (later.config, later.set, later.plan, later.gpus)
    assert plan_run(late).tokens_per_second == plan_run(later).tokens_per_second
    assert late.tokens_per_s_per_gpu / later.tokens_per_s_per_gpu == pytest.approx(1.0, abs=0.02)
    assert early.set != late.set and late.tokens_per_s_per_gpu / early.tokens_per_s_per_gpu > (1 + BAND) / (1 - BAND)


def test_zero3_gathers_hide_behind_the_compute_they_prefetch_for():
    """NeMo AutoModel's layout planned as ZeRO-3 (FSDP2): its per-micro-batch all-gathers of the dense params
    move hundreds of GB a step over the inter-node links, more than 10 s of link time, yet the step exposes
    almost none of it: they run beside the micro-batches' compute."""
    run = next(r for r in load_runs() if r.name == "deepseek-v3-h100-automodel")
    plan = plan_run(run)
    assert plan.config.optim.zero_stage == 3
    link = max(r.bytes["dp"].inter_node for r in plan.ranks) / (plan.machine.gpu.inter_node_gbps * 1e9)
    assert link > 10 and plan.dp_sync_seconds < 0.01 * plan.step_seconds
