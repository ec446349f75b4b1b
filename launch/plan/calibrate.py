"""moe-plan --validate: plan every published run of calibration.toml in its own layout and compare its
predicted tokens/s per GPU with the published figure."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from launch.config.run import load_config
from launch.plan.efficiency import MOE_HANDLING, SLOT_SECONDS
from launch.plan.planner import PAIR_HIDDEN, Machine, Options, Plan, make_plan
from launch.plan.presets import gpu_preset
from launch.plan.report import table

CALIBRATION = Path(__file__).with_name("calibration.toml")
ROOT = Path(__file__).resolve().parents[2]
BAND = 0.20  # a prediction within +-20% of the published throughput passes
FIT_LIMIT_NS = 2000  # the routed-slot cost is fitted over 0..2 us
# What a run outside the band states (its `miss`): which of the planner's assumptions its published figure breaks,
# and why public data cannot settle what the run did instead.
MISS_FIELDS = {"assumption": "assumes", "unknown": "unknown"}


@dataclass
class PublishedRun:
    """One published run: what was run, on what, and what it reached."""

    name: str
    model: str
    stack: str
    gpu: str
    gpus: int
    layout: str
    precision: str
    published: str
    tokens_per_s_per_gpu: float
    source: str
    config: str | None = None
    set: list[str] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    derived: str = ""
    notes: str = ""
    fit: bool = True  # its handling's routed-slot cost is fitted to this run (False: held out, a test of the fit)
    moe_handling: str = "synced"  # how its stack handles the routed slots (efficiency.MOE_HANDLING)
    without_overlap: str = ""  # the run of this layout published without its paired 1F1B
    share_fit: bool = True  # with without_overlap: planner.PAIR_HIDDEN is fitted to this A/B (False: a test of it)
    miss: dict = field(default_factory=dict)  # outside the band: {assumption = ..., unknown = ...} (MISS_FIELDS)

    def __post_init__(self) -> None:
        if self.moe_handling not in MOE_HANDLING:
            raise ValueError(f"calibration run {self.name}: moe_handling = {self.moe_handling!r} is not allowed; "
                             f"choose one of {', '.join(MOE_HANDLING)}")
        stated = all(isinstance(text, str) and text.strip() for text in self.miss.values())
        if self.miss and (set(self.miss) != set(MISS_FIELDS) or not stated):
            raise ValueError(f"calibration run {self.name}: miss must give exactly {' and '.join(MISS_FIELDS)}, "
                             f"each a sentence (it gives {', '.join(self.miss) or 'nothing'})")

    def options(self) -> Options:
        """The planner options [run.plan] gives."""
        return Options(**self.plan)


def load_runs(path: Path = CALIBRATION) -> list[PublishedRun]:
    """The runs of a calibration file."""
    with path.open("rb") as handle:
        return [PublishedRun(**entry) for entry in tomllib.load(handle)["run"]]


@dataclass
class RunCheck:
    """One run planned (plan None: no public layout) beside its published throughput; base is the same plan
    without the routed-slot cost (efficiency.SLOT_SECONDS), loo the ratio with its handling's cost fitted to the other
    runs it is fitted to (None for a held-out run, a run without routed slots, or the only run of its handling)."""

    run: PublishedRun
    plan: Plan | None
    base: Plan | None = None
    loo: float | None = None

    @property
    def predicted(self) -> float | None:
        """Predicted tokens/s per GPU."""
        return None if self.plan is None else self.plan.tokens_per_second / self.run.gpus

    @property
    def ratio(self) -> float | None:
        """Predicted over published."""
        return None if self.plan is None else self.predicted / self.run.tokens_per_s_per_gpu

    @property
    def within(self) -> bool | None:
        """Whether the prediction is inside the band."""
        return None if self.plan is None else abs(self.ratio - 1) <= BAND

    @property
    def slot_share(self) -> float:
        """Step seconds per second of routed-slot cost (the step time is linear in it: the slot cost adds to every
        MoE stage's F and B alike); 0 without routed slots."""
        if self.plan is None or not self.plan.machine.slot_seconds:
            return 0.0
        return (self.plan.step_seconds - self.base.step_seconds) / self.plan.machine.slot_seconds

    def ratio_at(self, slot_seconds: float) -> float:
        """Predicted over published with slot_seconds a routed slot (on the line through base and plan)."""
        published = self.plan.tokens_per_step / (self.run.tokens_per_s_per_gpu * self.run.gpus)
        return published / (self.base.step_seconds + self.slot_share * slot_seconds)


def fitted_to(checks: list[RunCheck], handling: str) -> list[RunCheck]:
    """The checks a handling's routed-slot cost is fitted to: its planned MoE runs that are not held out."""
    return [c for c in checks if c.plan is not None and c.run.fit and c.run.moe_handling == handling and c.slot_share]


def fit_slot_seconds(checks: list[RunCheck], handling: str) -> float:
    """The routed-slot cost (seconds, to 1 ns) of one way of handling the slots that minimises the squared log
    ratios of the checks it is fitted to (fitted_to)."""
    planned = fitted_to(checks, handling)
    if not planned:
        raise ValueError(f"no published run with moe_handling = {handling!r} to fit its routed-slot cost to")
    grid = [n * 1e-9 for n in range(FIT_LIMIT_NS + 1)]
    return min(grid, key=lambda slot: sum(math.log(c.ratio_at(slot)) ** 2 for c in planned))


def plan_run(run: PublishedRun, slot_seconds: float | None = None, pair_hidden: float = PAIR_HIDDEN) -> Plan | None:
    """The run planned in its own layout on its GPU (None when its layout is not public), at slot_seconds a routed
    slot (default: its handling's shipped cost, efficiency.SLOT_SECONDS)."""
    slot_seconds = SLOT_SECONDS[run.moe_handling] if slot_seconds is None else slot_seconds
    if run.config is None:
        return None
    config = load_config(ROOT / run.config, run.set)
    if config.parallel.world_size != run.gpus:
        raise ValueError(f"calibration run {run.name}: the layout has {config.parallel.world_size} ranks, "
                         f"the run {run.gpus} GPUs")
    machine = Machine(gpu_preset(run.gpu), config.parallel.gpus_per_node or 8, slot_seconds=slot_seconds,
                      pair_hidden=pair_hidden)
    return make_plan(config, machine, run.options())


def overlap_pairs(runs: list[PublishedRun]) -> list[tuple[PublishedRun, PublishedRun]]:
    """(run with its paired 1F1B, the same layout published without it) for every run naming its twin; the two
    halves of an A/B handle the slots alike (ValueError otherwise)."""
    by_name = {run.name: run for run in runs}
    pairs = [(run, by_name[run.without_overlap]) for run in runs if run.without_overlap]
    for paired, alone in pairs:
        if paired.moe_handling != alone.moe_handling:
            raise ValueError(f"calibration runs {paired.name} and {alone.name}: an overlap A/B's halves must have "
                             f"one moe_handling (they have {paired.moe_handling!r} and {alone.moe_handling!r})")
    return pairs


def fit_pair_hidden(paired: PublishedRun, alone: PublishedRun, slot_seconds: float | None = None) -> float:
    """The share of the EP exchanges (to 0.01) a paired 1F1B hides for the planner to give `paired` the speedup over
    `alone` their published throughputs show (the planned speedup grows with the share: bisection)."""
    published = paired.tokens_per_s_per_gpu / alone.tokens_per_s_per_gpu
    base = plan_run(alone, slot_seconds).step_seconds
    gains: dict[int, float] = {}  # share in hundredths -> planned speedup

    def gain(share: int) -> float:
        if share not in gains:
            gains[share] = base / plan_run(paired, slot_seconds, share / 100).step_seconds
        return gains[share]

    low, high = 0, 100
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if gain(mid) < published else (low, mid)
    return min((low, high), key=lambda share: abs(math.log(gain(share) / published))) / 100


def validate(path: Path = CALIBRATION) -> list[RunCheck]:
    """Every run of the calibration file planned, with its leave-one-out ratio."""
    checks = [RunCheck(run, plan_run(run), plan_run(run, 0.0)) for run in load_runs(path)]
    fits = {handling: fitted_to(checks, handling) for handling in MOE_HANDLING}
    for check in checks:
        fit = fits[check.run.moe_handling]
        others = [c for c in fit if c is not check]
        if check in fit and others:
            check.loo = check.ratio_at(fit_slot_seconds(others, check.run.moe_handling))
    return checks


def render(checks: list[RunCheck], constants: dict) -> str:
    """The checks as a table (a run outside the band marked MISS, one without a public layout "-"), the fitted
    constants (fitted_constants) under it, and each run's source and notes."""
    rows = []
    for c in checks:
        run, plan = c.run, c.plan
        rows.append([run.name, f"{run.gpus} {gpu_preset(run.gpu).name}", run.precision, run.moe_handling,
                     "-" if plan is None else f"{c.predicted:,.0f}", f"{run.tokens_per_s_per_gpu:,.0f}",
                     "-" if plan is None else f"{c.ratio:.2f}",
                     "held out" if plan is not None and not run.fit else "-" if c.loo is None else f"{c.loo:.2f}",
                     "-" if plan is None else f"{plan.peak_memory / 1e9:.1f} GB {'fits' if plan.fits else 'DOES NOT FIT'}",
                     {None: "not planned", True: "ok", False: "MISS"}[c.within]])
    planned = [c for c in checks if c.plan is not None]
    held_out = [c for c in planned if not c.run.fit]
    lines = [f"published MoE runs, each planned in its own layout (band +-{BAND:.0%}; {CALIBRATION.name}):",
             table(["run", "GPUs", "precision", "handling", "predicted tok/s/GPU", "published", "ratio",
                    "leave-one-out", "peak memory", f"+-{BAND:.0%}"], rows),
             f"inside +-{BAND:.0%}: {sum(c.within for c in planned)} of {len(planned)} planned runs "
             f"({sum(c.within for c in held_out)} of the {len(held_out)} held out)",
             *(f"routed-slot cost, {handling} handling: {slot['planned'] * 1e9:g} ns planned, "
               + (f"{slot['fitted'] * 1e9:g} ns fitted to its {slot['runs']} MoE runs (least squares of log ratios, "
                  "held-out runs excluded)" if slot["runs"] else "no run to fit it to")
               for handling, slot in constants["slot_seconds"].items()),
             "leave-one-out: the ratio with its handling's cost fitted to the other runs of that handling"]
    lines += [f"paired 1F1B: its pairs hide {pair['planned']:g} of the EP exchanges the other half could cover, "
              f"planned; {pair['fitted']:g} fitted to {pair['paired']} against {pair['without']} "
              f"(published x{pair['published_gain']:.2f}"
              + (f"; held out, hiding all plans x{pair['gain_hiding_all']:.2f})" if pair["held_out"] else ")")
              for pair in constants["pair_hidden"]]
    misses = [c for c in planned if not c.within]
    if misses:
        lines.append(f"outside +-{BAND:.0%}: the assumption each run breaks, and why public data cannot settle it "
                     "(its miss in calibration.toml)")
        for c in misses:
            lines.append(f"  {c.run.name} ({c.ratio:.2f})")
            lines += [f"    {label}: {c.run.miss.get(key, 'NOT STATED')}" for key, label in MISS_FIELDS.items()]
    lines.append("")
    for c in checks:
        run = c.run
        lines.append(f"{run.name}: {run.stack}; {run.layout}; published {run.published}")
        lines += [f"  {label}: {text}" for label, text in (("derived", run.derived), ("notes", run.notes),
                                                             ("source", run.source)) if text]
    return "\n".join(lines)


def fitted_constants(checks: list[RunCheck]) -> dict:
    """The constants fitted to the published runs, as shipped and as these checks fit them (a routed-slot cost per
    handling; the pair share to every A/B, the shipped one to those not held out), JSON-ready."""
    pairs = overlap_pairs([c.run for c in checks])
    fits = {handling: fitted_to(checks, handling) for handling in MOE_HANDLING}
    return {"slot_seconds": {handling: {"planned": SLOT_SECONDS[handling], "runs": len(fit),
                                        "fitted": fit_slot_seconds(fit, handling) if fit else None}
                             for handling, fit in fits.items()},
            "pair_hidden": [{"paired": paired.name, "without": alone.name, "planned": PAIR_HIDDEN,
                             "fitted": fit_pair_hidden(paired, alone),
                             "published_gain": paired.tokens_per_s_per_gpu / alone.tokens_per_s_per_gpu,
                             "held_out": not paired.share_fit, "gain_hiding_all": plan_run(alone).step_seconds
                             / plan_run(paired, pair_hidden=1.0).step_seconds}
                            for paired, alone in pairs]}


def to_dicts(checks: list[RunCheck]) -> list[dict]:
    """The checks, JSON-ready."""
    return [{"name": c.run.name, "gpus": c.run.gpus, "gpu": c.run.gpu, "published_tokens_per_s_per_gpu":
             c.run.tokens_per_s_per_gpu, "predicted_tokens_per_s_per_gpu": c.predicted, "ratio": c.ratio,
             "leave_one_out_ratio": c.loo, "held_out": not c.run.fit, "moe_handling": c.run.moe_handling,
             "within_band": c.within, "fits": None if c.plan is None else c.plan.fits,
             "peak_memory_bytes": None if c.plan is None else c.plan.peak_memory, "source": c.run.source,
             "miss": c.run.miss or None}
            for c in checks]
