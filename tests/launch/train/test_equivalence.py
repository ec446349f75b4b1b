"""The trainer on every layout equals the single-process run of the same config (float64, 5 steps).

Each layout trains the same tiny model on the same global batches, once dropless and once with a
capacity factor that drops slots (not under TP or CP: see routings); per-step losses (LM and router)
must agree to 1e-10 relative and the final parameters, consolidated from the per-rank checkpoints, to
calc_diff < 1e-12. The capacity runs read a corpus on which no two routed tokens are equal in exact arithmetic
(drop_text), so that every drop is decided by a margin far above rounding (test_capacity_runs_drop_by_clear_margins)
and not by a layout's, or a CPU kernel's, summation order. MLA attention is checked dropless in pipeline, TP and CP
layouts, and CP x TP with GQA and MLA (test_batched_layouts_equal_single_process); every run of one world size is
trained in one spawn. Redundant experts (parallel.redundant_experts, re-placed after steps 1 and 3) ride the
dropless dp2 ep2 flat run and DualPipeV x dp2 x ep2 with hierarchical dispatch under full recompute: both equal one
process, as the runs without them do, and their checkpoints hold a placement that uses a spare slot.

DeepSeek-V3's FP8 recipe (issue 46) is not exact arithmetic, so its layout run is compared within derived and
measured bounds instead (test_fp8_recipe_layout_tracks_single_process, where the figures are): RECIPE_LAYOUT
(pp2 DualPipeV x dp2 x ep2 across nodes, FP8 dispatch payload through the padded exchange) in float32, in the
world-4 spawn.

Issue 48's sync-free step is watched inside the same runs (tests/syncs.py): every layout's statistics copies, the
forward and backward reads of every sync-free layout and of the exact exchange's flat and hierarchical forms at EP 2
(watch_mode), the padded exchange's layouts (flat; DualPipeV x dp2 x ep2 hierarchical in 2 chunks, CHUNKED_PADDED)
against their exact twins, and the FP8 recipe's padded run reading nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import shutil
from datetime import timedelta
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from launch.parallel.spawn import run_processes
from launch.checkpoint.checkpointer import consolidate
from launch.config.run import build_config
from launch.metrics.records import decode_array
from launch.train.build import build_model
from launch.train.loop import train
from moe.router import TopKRouter
from tests.spawns import from_shared_spawn
from tests.syncs import step_reads

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

STEPS = 5
CHUNKED_PADDED = "pp2 dp2 ep2 dualpipev hierarchical padded in 2 chunks"  # issue 48's named layout
DEVICE_SPLIT = "dp2 ep2 hierarchical device_split in 2 chunks"
# redundant experts (moe.replicas): a spare slot per EP rank, placed after steps 1 and 3 and used by steps 2 to 4
REDUNDANT = {"redundant_experts": 1, "rebalance_every": 2}
CUT = 3  # the resharding runs' cut
LAYOUTS = {
    "pp2 dualpipev": {"pp": 2, "schedule": "dualpipev"},
    "pp2 dualpipe": {"pp": 2, "schedule": "dualpipe"},
    "pp2 1f1b": {"pp": 2, "schedule": "1f1b"},
    "pp2 afab": {"pp": 2, "schedule": "afab"},
    "dp2 zero1": {"dp": 2},
    "dp2 ep2 flat": {"dp": 2, "ep": 2},
    "dp2 ep2 hierarchical": {"dp": 2, "ep": 2, "dispatch_backend": "hierarchical", "gpus_per_node": 1},
    "dp4 ep4 hierarchical 2x2": {"dp": 4, "ep": 4, "dispatch_backend": "hierarchical", "gpus_per_node": 2},
    "dp4 ep4 hierarchical 2x2 in 3 chunks": {"dp": 4, "ep": 4, "dispatch_backend": "hierarchical", "gpus_per_node": 2,
                                             "dispatch_chunks": 3},
    "pp2 dp2 ep2 dualpipev, EP across nodes": {"pp": 2, "dp": 2, "ep": 2, "schedule": "dualpipev",
                                               "dispatch_backend": "hierarchical", "gpus_per_node": 1},
    # issue 48: the padded exchange; headroom 0.5 overflows the first steps' bounds (rerun exactly, bounds doubled)
    "dp2 ep2 flat padded": {"dp": 2, "ep": 2, "dispatch_exchange": "padded", "dispatch_headroom": 0.5},
    # its hops pipelined in 2 chunks: the exact layout "pp2 dp2 ep2 dualpipev, EP across nodes", padded
    CHUNKED_PADDED: {"pp": 2, "dp": 2, "ep": 2, "schedule": "dualpipev", "dispatch_backend": "hierarchical",
                     "gpus_per_node": 1, "dispatch_exchange": "padded", "dispatch_chunks": 2},
    # the device-split exchange (dispatch.device_split: its gloo reference), hierarchical in 2 chunks; headroom 0.5
    # overflows the first steps' bounds (rerun exactly, bounds doubled)
    DEVICE_SPLIT: {"dp": 2, "ep": 2, "dispatch_backend": "hierarchical", "gpus_per_node": 1,
                   "dispatch_exchange": "device_split", "dispatch_chunks": 2, "dispatch_headroom": 0.5},
    "tp2 sp": {"tp": 2, "sequence_parallel": True},
    "dp2 tp2 ep2": {"dp": 2, "tp": 2, "ep": 2},
    "pp2 tp2 dualpipev sp": {"pp": 2, "tp": 2, "schedule": "dualpipev", "sequence_parallel": True},
    "cp2 ring": {"cp": 2},
    "cp2 ep2 all-gather KV": {"cp": 2, "ep": 2, "cp_method": "allgather"},
    "pp2 dualpipev cp2": {"pp": 2, "cp": 2, "schedule": "dualpipev"},
}
# Layouts trained only beside others of their world size (test_batched_layouts_equal_single_process), dropless
BATCHED = {"cp2 tp2 ep4 sp": {"cp": 2, "tp": 2, "ep": 4, "sequence_parallel": True},
           "pp2 dp2 ep2 dualpipev hierarchical, redundant experts": {
               "pp": 2, "dp": 2, "ep": 2, "schedule": "dualpipev", "dispatch_backend": "hierarchical",
               "gpus_per_node": 2, **REDUNDANT}}
# The dropless runs of these layouts also hold redundant experts (REDUNDANT, which change no math): no run of its own
DROPLESS_REDUNDANT = ("dp2 ep2 flat",)
ROUTING = {"dropless": None, "capacity 1.0": 1.0}
ATTENTION = {"gqa": {}, "mla": {"attention": "mla", "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                "qk_rope_head_dim": 4, "v_head_dim": 8}}
# By world size: (layout, attention, data.document_mask on a corpus of short documents, train.recompute)
SPAWNS = {2: [(name, "mla", False, "none") for name in ("pp2 dualpipev", "pp2 1f1b", "tp2 sp", "cp2 ring")]
          + [("pp2 dualpipev", "gqa", True, "none"), ("tp2 sp", "gqa", True, "none")]
          + [("tp2 sp", "mla", False, "selective")],  # the rebuilt tensors of TP-split heads and FFN columns
          4: [(name, "mla", False, "none") for name in ("dp2 tp2 ep2", "pp2 tp2 dualpipev sp",
                                                         "pp2 dp2 ep2 dualpipev, EP across nodes")]
          + [("cp2 tp2 ep4 sp", "gqa", False, "none"), ("cp2 tp2 ep4 sp", "mla", False, "none"),
             ("pp2 tp2 dualpipev sp", "mla", True, "none")]
          # train.recompute under DualPipeV's B/W split and EP's async dispatch (ZeRO-1 over dp2 too)
          + [("pp2 dp2 ep2 dualpipev, EP across nodes", "mla", False, "selective"),
             ("pp2 dp2 ep2 dualpipev hierarchical, redundant experts", "gqa", False, "full")]}
MTP_LAYOUTS = {"pp2 1f1b": LAYOUTS["pp2 1f1b"],
               "pp2 dp2 ep2 dualpipev": {"pp": 2, "dp": 2, "ep": 2, "schedule": "dualpipev"},
               "dp2 tp2 sp": {"dp": 2, "tp": 2, "sequence_parallel": True}}
MTP_SPAWNS = {2: ["pp2 1f1b"], 4: ["pp2 dp2 ep2 dualpipev", "dp2 tp2 sp"]}  # MLA + MTP depth 1, dropless
EXACT_READS_SEEN = ("dp2 ep2 flat", "dp2 ep2 hierarchical")  # exact exchanges whose reads are checked (watch_mode)
SPAWN_S = 1200  # one spawn trains every run of its world size (the spawned fixture): its bound, start-up included
_WORLDS = itertools.count(1)  # a spawned rank's worlds after its first (release_groups)


def routings(parallel: dict) -> dict[str, float | None]:
    """The routings a layout must reproduce: under TP (CP) each rank routes its own S/tp (S/cp) tokens, so a
    capacity limit applies per sequence shard (moe.tp.TensorParallelRouter) and drops other slots than one process."""
    return {k: v for k, v in ROUTING.items() if v is None or parallel.get("tp", 1) == parallel.get("cp", 1) == 1}


def raw_config(run_dir: str, corpus: str, parallel: dict, capacity_factor: float | None,
               attention: str = "gqa", mtp_depth: int = 0, document_mask: bool = False,
               recompute: str = "none") -> dict:
    """A 4-layer (1 dense + 3 MoE) float64 model with GQA or MLA attention and mtp_depth MTP depths, 8 micro-batches
    of 2 x 16 tokens per step, activations recomputed as recompute says; with document_mask also a padded vocab
    (300 ids in 320 rows: under tp2 the second rank's block holds the 20 padded ids)."""
    model = {"vocab_size": 256, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
             "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_size": 48, "num_experts": 8,
             "expert_ffn_size": 16, "top_k": 2, "num_shared_experts": 1, "score_func": "sigmoid",
             "num_groups": 2, "topk_groups": 1, "aux_loss_coeff": 0.01, "seq_aux_loss_coeff": 0.001,
             "bias_update_rate": 0.01, "drop_policy": "probs", "mtp_depth": mtp_depth, **ATTENTION[attention]}
    if capacity_factor is not None:
        model["capacity_factor"] = capacity_factor
    if document_mask:
        model.update(vocab_size=300, vocab_multiple=64)
    settings = {"steps": STEPS, "micro_batch_size": 2, "grad_accum_steps": 8, "seq_len": 16, "lr": 0.01,
                "warmup_steps": 1, "dtype": "float64", "eval_batches": 0, "run_dir": run_dir,
                "rank_metrics_every": 2, "recompute": recompute}
    return {"model": model, "train": settings,
            "data": {"corpus": corpus, "max_bytes": 40_000, "document_mask": document_mask},
            "parallel": parallel}


RECIPE_LAYOUT = "pp2 dp2 ep2 dualpipev, EP across nodes"  # trained with DeepSeek-V3's FP8 recipe too
RECIPE = {"model": {"linear_precision": "fp8", "expert_precision": "fp8", "activation_cache": "fp8"},
          "train": {"dtype": "float32", "recompute": "selective"}, "optim": {"moment_dtype": "bfloat16"}}


RECIPE_STEPS = 3  # steps of the recipe runs (test_fp8_recipe_layout_tracks_single_process)
FIRST_GAP = 1e-6  # relative, test_fp8_recipe_layout_tracks_single_process's step 0 loss
GRAD_GAP = 1e-3  # relative, its step 0's grad norm
RECIPE_GAP = 8e-3  # relative, its every step's loss


def recipe_raw(run_dir: str, corpus: str, parallel: dict, seed: int = 0) -> dict:
    """raw_config (GQA, dropless) with every key of DeepSeek-V3's FP8 training recipe on (issue 46), in float32
    weights (test_fp8_recipe's reason), from train.seed, for RECIPE_STEPS steps; under EP the dispatched rows travel in
    FP8 too, through the padded exchange (issue 48: FP8 experts take its padding rows)."""
    raw = raw_config(run_dir, corpus, parallel, None)
    for section, keys in RECIPE.items():
        raw[section] = {**raw.get(section, {}), **keys}
    raw["train"].update(seed=seed, steps=RECIPE_STEPS)
    if parallel.get("ep", 1) > 1:
        raw["parallel"] = {**parallel, "dispatch_payload": "fp8", "dispatch_exchange": "padded"}
    return raw


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


def check_node_limit(records: list[dict], raw: dict) -> None:
    """Node-limited routing (topk_groups of the EP nodes' groups) bounds the inter-node copies: each
    routed token crosses to at most topk_groups other nodes, counted by the dispatchers' byte counters."""
    model, settings = raw["model"], raw["train"]
    row_bytes = model["hidden_size"] * 8  # float64 payload rows
    routed = settings["grad_accum_steps"] * settings["micro_batch_size"] * settings["seq_len"]
    bound = routed * (model["num_layers"] - model["first_k_dense"]) * model["topk_groups"] * row_bytes
    for record in (r for r in records if "traffic_bytes" in r):  # the per-rank steps
        inter = sum(rank[1] for rank in record["traffic_bytes"]["dispatch"])
        assert 0 < inter <= bound, (record["step"], inter, bound)


def check_traffic_matrix(record: dict) -> None:
    """The per-peer matrix accounts for every byte the per-kind counters saw (payload and metadata)."""
    counted = sum(sum(rank) for rank in (row for kind in record["traffic_bytes"].values() for row in kind))
    matrix = decode_array(record["traffic"]["rank_bytes"])
    assert matrix.sum() == counted
    assert record["traffic"]["inter_node_bytes"] == sum(
        rank[1] + rank[3] for kind in record["traffic_bytes"].values() for rank in kind)


def corpus_of(document_mask: bool, corpus: str, documents: str) -> str:
    """The equivalence runs' corpus: the short documents with document masking, else the one long text."""
    return documents if document_mask else corpus


def routed_corpus(capacity_factor: float | None, corpus: str, drop_corpus: str) -> str:
    """The corpus of a run routed with capacity_factor: drop_corpus (drop_text) under a capacity limit, else corpus."""
    return corpus if capacity_factor is None else drop_corpus


ROW_STARTS = [chr(c) for c in range(33, 127)]  # printable ASCII but the space: 94 first bytes of rows
DROP_MARGIN = 1e-8  # relative; a layout moves the router's float64 scores by ~4e-16 relative


def drop_text(seed: int = 0, width: int = 17) -> str:
    """The capacity runs' corpus: len(ROW_STARTS) rows of width = train.seq_len + 1 bytes (the byte tokenizer's
    rows, cut from the start), each starting with its own byte and no row holding the same byte twice in a row.

    A capacity limit ranks an expert's slots by router score and drops the last ones, so it is a step function of
    the scores: two slots whose scores are equal in exact arithmetic are ranked by rounding, which differs between
    a layout and one process (an expert's rows from several ranks, other reduction orders) and between the CPU
    kernels torch dispatches to (ATEN_CPU_CAPABILITY). With attention the only place positions enter (RoPE), tokens
    are equal in exact arithmetic where their contexts are: the two rows of a micro-batch starting with the same
    bytes (bit for bit equal too), or a row starting with a run of one byte (equal up to rounding: attention over
    equal values returns that value). The code-like corpus has both (indents of 4 spaces, lines of one template),
    and under ATEN_CPU_CAPABILITY=default dp2 ep2 kept the second of two such tokens where one process kept the
    first. Here no two tokens of a micro-batch share a context: 5 steps read 80 of the 92 training rows (2% held
    out), one epoch, each row once."""
    gen = random.Random(seed)
    starts = list(ROW_STARTS)
    gen.shuffle(starts)
    body = [chr(c) for c in range(32, 127)]
    rows = []
    for start in starts:
        row = [start]
        while len(row) < width:
            row.append(gen.choice([c for c in body if c != row[-1]]))
        rows.append("".join(row))
    return "".join(rows)


@contextlib.contextmanager
def drop_margins():
    """Yields a list that collects, for each capacity decision of every TopKRouter in this process and each expert
    that drops slots, (lowest kept score - highest dropped score) / lowest kept score."""
    margins: list[float] = []
    capacity_mask = TopKRouter._capacity_mask

    def recording(self, indices, priority):
        kept = capacity_mask(self, indices, priority)
        experts, scores, kept_flat = indices.reshape(-1), priority.reshape(-1), kept.reshape(-1)
        for expert in experts[~kept_flat].unique().tolist():
            mine = experts == expert
            lowest_kept = scores[mine & kept_flat].min()
            margins.append(((lowest_kept - scores[mine & ~kept_flat].max()) / lowest_kept).item())
        return kept
    with mock.patch.object(TopKRouter, "_capacity_mask", recording):
        yield margins


def test_capacity_runs_drop_by_clear_margins(drop_corpus, tmp_path):
    """The single process's capacity run (the layouts' reference) decides every drop by a relative score margin above
    DROP_MARGIN: 1e-8, ten thousand times the scores' rounding and a hundred times the losses' bound, so that no
    layout's (or CPU kernel's) summation order can drop another slot. On the code-like corpus this fails: margin 0."""
    text = Path(drop_corpus).read_text()
    rows = [text[i:i + 17] for i in range(0, len(text), 17)]
    assert sorted(row[0] for row in rows) == ROW_STARTS
    assert all(a != b for row in rows for a, b in zip(row, row[1:]))
    with drop_margins() as margins:
        records = train(build_config(raw_config(str(tmp_path), drop_corpus, {}, ROUTING["capacity 1.0"])),
                        progress=False)
    assert all(r["dropped_tokens"] > 0 for r in records) and len(margins) > 100
    assert min(margins) > DROP_MARGIN, sorted(margins)[:5]


def spawned_raws(corpus: str, documents: str, drop_corpus: str, root) -> dict[tuple, dict]:
    """Every spawned run of the equivalence tests, by key: ("layout", name, routing) for each routing a layout must
    reproduce, ("batched", name, attention, document mask, recompute), ("mtp", name) and ("recipe", RECIPE_LAYOUT)
    -> its raw config."""
    layouts = LAYOUTS | BATCHED
    keyed = [(("layout", name, routing), (routed_corpus(capacity, corpus, drop_corpus),
                                          parallel | (REDUNDANT if capacity is None and name in DROPLESS_REDUNDANT
                                                      else {}), capacity))
             for name, parallel in LAYOUTS.items() for routing, capacity in routings(parallel).items()]
    keyed += [(("batched", name, attention, masked, recompute),
               (corpus_of(masked, corpus, documents), layouts[name], None, attention, 0, masked, recompute))
              for runs in SPAWNS.values() for name, attention, masked, recompute in runs]
    keyed += [(("mtp", name), (corpus, MTP_LAYOUTS[name], None, "mla", 1))
              for names in MTP_SPAWNS.values() for name in names]
    raws = {key: raw_config(run_dir(root, key), *args) for key, args in keyed}
    return raws | {("recipe", RECIPE_LAYOUT): recipe_raw(run_dir(root, ("recipe", RECIPE_LAYOUT)), corpus,
                                                         LAYOUTS[RECIPE_LAYOUT])}


def run_dir(root: Path, key: tuple) -> str:
    """A spawned run's directory, named by its key."""
    return str(root / "_".join(map(str, key)).replace(" ", "_").replace(",", ""))


@pytest.fixture(scope="module")
def spawned(corpus, documents, drop_corpus, tmp_path_factory):
    """Run key (spawned_raws) -> (raw config, records, each rank's final embedding or None); the runs of one world
    size are all trained in one spawn, on first use of any of them."""
    raws = spawned_raws(corpus, documents, drop_corpus, tmp_path_factory.mktemp("layouts"))
    worlds = {key: build_config(raw).parallel.world_size for key, raw in raws.items()}
    out = {}

    def run(key: tuple) -> tuple[dict, list[dict], list[torch.Tensor | None]]:
        keys = [k for k in raws if worlds[k] == worlds[key]]

        def spawn() -> list[tuple[dict, list[dict], list[torch.Tensor | None]]]:
            watched = [watch_mode(k) for k in keys]
            results = run_processes(_train_with_embedding, worlds[key], [(raws[k], w) for k, w in zip(keys, watched)],
                                    timeout_s=600, run_timeout_s=SPAWN_S)
            run.reads.update((k, [rank[i][2] for rank in results]) for i, k in enumerate(keys) if watched[i])
            return [(raws[k], results[0][i][0], [rank[i][1] for rank in results]) for i, k in enumerate(keys)]
        return from_shared_spawn(out, key, keys, spawn)
    run.reads = {}  # run key -> per rank, per forward and backward: (host reads (kind, where), stats copies)
    return run


@pytest.mark.timeout(SPAWN_S + 120)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_single_process(layout, spawned, reference):
    parallel = LAYOUTS[layout]
    for name in routings(parallel):
        raw, records, _ = spawned(("layout", layout, name))
        check_equal_runs(records, raw, reference(name), parallel, name)


def watch_mode(key: tuple) -> str | None:
    """How a spawned run is watched (tests/syncs.py step_reads): "reads" (the sync detector and the statistics
    copies) for the runs whose reads a test checks: the FP8 recipe's, every sync-free layout's, and the exact
    exchange's in its flat and hierarchical forms at EP 2 (EXACT_READS_SEEN); "copies" (the copies only: the
    detector doubles a small step's time) for the other exact-exchange layouts, whose reads are known and claimed
    by nothing; None for the rest."""
    if key[0] == "recipe":
        return "reads"
    if key[0] != "layout":
        return None
    return "reads" if sync_free(LAYOUTS[key[1]]) or key[1] in EXACT_READS_SEEN else "copies"


def sync_free(parallel: dict) -> bool:
    """Whether a layout's steps read nothing to the host in forward and backward (issue 48): no expert parallelism,
    or its padded or device-split exchange (the exact one reads its exchange sizes)."""
    return parallel.get("ep", 1) == 1 or parallel.get("dispatch_exchange") in ("padded", "device_split")


@pytest.mark.timeout(SPAWN_S + 120)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_steps_read_nothing_in_forward_and_backward_and_copy_their_statistics_once(layout, spawned, reference):
    """Issue 48, seen by the sync detector inside the spawned ranks (and around the single process): a sync-free
    layout's forward and backward read nothing to the host on any rank, dropless or dropping, and every attempt of a
    step copies to the host once, its statistics (per-rank metrics apart); the exact exchange's reads are listed."""
    parallel = LAYOUTS[layout]
    for name in routings(parallel):
        _, records, _ = spawned(("layout", layout, name))
        reruns = records[-1].get("dispatch_reruns", 0)  # attempts on the exact exchange after an overflow
        for rank, attempts in enumerate(spawned.reads["layout", layout, name]):
            assert len(attempts) == STEPS + reruns and all(copies == 1 for _, copies in attempts), (name, rank)
            if watch_mode(("layout", layout, name)) == "reads":
                free = [got for got, _ in attempts if not got]
                assert len(free) == (STEPS if sync_free(parallel) else 0), (name, rank, attempts[0][0][:5])
        reference(name)
        assert [(got, copies) for got, copies in reference.reads[name, "gqa", 0, False]] == [([], 1)] * STEPS


@pytest.mark.timeout(SPAWN_S + 120)
@pytest.mark.parametrize("routing", list(ROUTING))
def test_padded_exchange_equals_the_exact_one_and_reruns_overflowed_steps(routing, spawned):
    """The padded flat exchange trains as the exact one (float64, losses to 1e-12 relative): its first steps overflow
    the bounds of headroom 0.5 and rerun on the exact path (counted), its later ones run padded with grown bounds."""
    check_padded_run("dp2 ep2 flat padded", "dp2 ep2 flat", routing, spawned)


@pytest.mark.timeout(SPAWN_S + 120)
@pytest.mark.parametrize("routing", list(ROUTING))
def test_device_split_exchange_equals_the_exact_one_and_reruns_overflowed_steps(routing, spawned):
    """The device-split exchange (its gloo reference: whole blocks moved, rows past the device counts padded),
    hierarchical in 2 chunks, trains as the exact exchange in one chunk (float64, losses to 1e-12 relative): its first
    steps overflow the bounds of headroom 0.5 and rerun on the exact path (counted), its later ones run split with grown
    bounds, and its EP traffic (counted from the device counts) is the exact run's plus the counts it trades."""
    split = check_padded_run(DEVICE_SPLIT, "dp2 ep2 hierarchical", routing, spawned)
    _, exact, _ = spawned(("layout", "dp2 ep2 hierarchical", routing))
    reruns = [0] + [r["dispatch_reruns"] for r in split]
    compared = [i for i, got in enumerate(split)
                if "traffic_bytes" in got and reruns[i + 1] == reruns[i]]  # per-rank steps run split, not rerun
    for i in compared:
        for kind, ranks in split[i]["traffic_bytes"].items():  # payload: the rows moved, as the exact exchange's
            assert [r[:2] for r in ranks] == [r[:2] for r in exact[i]["traffic_bytes"][kind]], (i, kind)
    assert compared, reruns


def check_padded_run(layout: str, exact_layout: str, routing: str, spawned) -> list[dict]:
    """layout's run (padded or device-split, overflowing at first) trains as exact_layout's: reruns counted on some
    steps but not all, losses to 1e-12 relative. Returns layout's records."""
    _, padded, _ = spawned(("layout", layout, routing))
    _, exact, _ = spawned(("layout", exact_layout, routing))
    reruns = [r["dispatch_reruns"] for r in padded]
    assert 0 < reruns[-1] < STEPS and all(r["dispatch_reruns"] == 0 for r in exact), reruns
    for got, want in zip(padded, exact, strict=True):
        for key in ("loss", "lm_loss", "aux_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-12), (got["step"], key)
    return padded


@pytest.mark.timeout(SPAWN_S + 120)
@pytest.mark.parametrize("routing", list(ROUTING))
def test_chunked_padded_exchange_trains_as_the_exact_one(routing, spawned):
    """Issue 48's named layout, pp2 DualPipeV x dp2 x ep2 hierarchical with its hops in 2 chunks, padded, runs every
    step padded (none overflows its bounds, none reruns) and trains as the same layout's exact exchange in one chunk
    (equal to any chunks, dispatch.transport): every step's losses and grad norm, and every tensor of the final
    checkpoint, to 1e-12 relative. Measured: dropless losses and grad norms equal bit for bit, capacity 1.0's last grad
    norm 2e-16 apart, params at most 1.4e-17 apart, and the padded layout in one chunk gives the 2 chunks' run bit for
    bit. What moves the last bit is the experts' grouped GEMMs (kernels.grouped_ref): the padded ones run over a
    fixed number of rows, the exact ones over the pairs, and the CPU BLAS orders a sum by the row count (the layer
    alone, tests/dispatch/test_moe_ep.py, equals the exact path bit for bit at its sizes)."""
    raw, padded, _ = spawned(("layout", CHUNKED_PADDED, routing))
    exact_raw, exact, _ = spawned(("layout", "pp2 dp2 ep2 dualpipev, EP across nodes", routing))
    assert raw["parallel"]["dispatch_chunks"] == 2 and exact_raw["parallel"].get("dispatch_chunks", 1) == 1
    assert [r["dispatch_reruns"] for r in padded] == [0] * STEPS
    for got, want in zip(padded, exact, strict=True):
        for key in ("loss", "lm_loss", "aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), (got["step"], key)
    got, want = (consolidate(f"{r['train']['run_dir']}/checkpoint") for r in (raw, exact_raw))
    assert set(got) == set(want)
    for key, value in want.items():
        scale = value.abs().max().item() if value.is_floating_point() and value.numel() else 0.0
        torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-12 * scale, msg=key)


@pytest.mark.timeout(SPAWN_S + 120)
@pytest.mark.parametrize("world", list(SPAWNS))
def test_batched_layouts_equal_single_process(world, spawned, reference):
    """The layouts of one world size with their attention, trained dropless: MLA (query latent, joint KV latent,
    TP-split heads with replicated down-projections) in pipeline, TP and CP layouts, and CP x TP (heads split over
    TP, each CP shard's sequence over SP, routers summing over cp x tp, EP over both) with GQA and MLA; document
    masking with a padded vocab under DualPipeV (rank 1 holds only middle stages: document ids reach it as the
    runtime's context), TP + SP (the padded ids in one rank's vocab block), and both; and recomputed activations
    (train.recompute) against the single process without."""
    layouts = LAYOUTS | BATCHED
    for name, attention, masked, recompute in SPAWNS[world]:
        raw, records, _ = spawned(("batched", name, attention, masked, recompute))
        assert build_config(raw).parallel.world_size == world
        check_equal_runs(records, raw, reference("dropless", attention, 0, masked), layouts[name],
                         f"{attention} {name} document_mask={masked} recompute={recompute}")


def release_groups(records: list[dict]) -> list[dict]:
    """A spawned run's records, once every rank has finished it and a fresh world replaces the process groups it
    made: a spawn training many runs would otherwise keep every run's gloo groups (polling threads each) and slow
    down. The new world's keys live under a prefix of their own in the rendezvous store, so that the next run's
    groups (the same names) meet none of the last run's."""
    store, rank, world = distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"run{next(_WORLDS)}", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=SPAWN_S))
    return records


def _train_with_embedding(rank: int, world: int, raws: list[tuple[dict, str | None]]
                          ) -> list[tuple[list[dict], torch.Tensor | None, list[tuple[list | None, int]]]]:
    """Each run's records, this rank's final embedding (None where no stage holds it), and for the runs watched
    (watch_mode: "reads" or "copies") per forward and backward its host reads (kind, where; None unless "reads") and
    the copies of its statistics (tests/syncs.py step_reads)."""
    held, runs = [], []

    def build(*args, **kwargs):
        out = build_model(*args, **kwargs)
        held.append(next((s.embed.weight for s in out[0] if s.embed is not None), None))
        return out
    with mock.patch("launch.train.loop.build_model", build):  # where train() looks it up
        for raw, watch in raws:
            with step_reads(detect=watch == "reads") if watch else contextlib.nullcontext([]) as steps:
                records = release_groups(train(build_config(raw), progress=False))
            runs.append((records, held[-1], [(s.reads and [(r.kind, r.where) for r in s.reads], s.copies)
                                             for s in steps]))
    return runs


@pytest.mark.timeout(SPAWN_S + 120)
@pytest.mark.parametrize("world", list(MTP_SPAWNS))
def test_mla_mtp_layouts_equal_single_process(world, spawned, reference):
    """MLA with MTP depth 1: the MTP depth on the last stage shares the embedding tensor with the first under
    DualPipeV, holds a copy under 1F1B (grads summed over both pipeline ranks, the copies equal after training), and
    runs under TP + SP; losses (mtp_loss_1 too) and params as one process."""
    want = reference("dropless", "mla", 1)
    assert "mtp.0.eh_proj.weight" in want[1] and any(key.startswith("mtp.0.block.ffn.experts.") for key in want[1])
    for name in MTP_SPAWNS[world]:
        raw, records, embeddings = spawned(("mtp", name))
        assert build_config(raw).parallel.world_size == world
        check_equal_runs(records, raw, want, MTP_LAYOUTS[name], f"mla mtp {name}")
        for got, ref in zip(records, want[0]):
            assert got["mtp_loss_1"] == pytest.approx(ref["mtp_loss_1"], rel=1e-10), (name, got["step"])
        if name == "pp2 1f1b":  # rank 1's copy of the embedding equals rank 0's
            assert torch.equal(embeddings[0], embeddings[1])


@pytest.mark.timeout(SPAWN_S + 120)
def test_fp8_recipe_layout_tracks_single_process(spawned, corpus, tmp_path):
    """DeepSeek-V3's FP8 recipe (recipe_raw: FP8 linears and experts, FP8-cached SwiGLUs, selective recompute, BF16
    moments, FP8 dispatch payload) on RECIPE_LAYOUT, trained in the world-4 spawn, against one process with the same
    recipe and seed (relative gaps): step 0's loss within FIRST_GAP and its grad norm within GRAD_GAP (one forward and
    backward of the same weights on the same batch), every step's loss within RECIPE_GAP.

    Derived. Step 0's forward computes the same products in another order (EP rows gathered from two ranks, combine
    sums; the FP8 payload is the e4m3 tiles the experts would make themselves): fp32 reordering moves a value by
    ~2^-22 relative, and an e4m3 rounding only where the value sits that close to a rounding midpoint (e4m3 steps are
    2^-4..2^-3 relative): ~2^-19 of the ~1e5 elements quantised per pass flip, each moving one product term by one
    e4m3 step, so the loss moves by ~1e-7: FIRST_GAP = 1e-6. Its backward quantises differently by design: under
    DualPipeV's B/W split a plain FP8 linear's deferred wgrads merge the chunks' rows into one GEMM whose 1x128 token
    tiles run across chunks, and the attention out projection's input is quantised in rows at B and re-tiled
    (kernels.linear), where one process quantises each micro-batch k-grouped once: each such wgrad carries its own
    e4m3 rounding (calc_diff ~7e-4 from the exact product, tests/kernels/test_fp8_quality.py), two independent
    roundings move a norm by ~that, so GRAD_GAP = 1e-3. From step 1 on the runs are two FP8-rounded versions of the
    same exact run (AdamW's normalised updates carry any rounding difference in full, its first one being lr x sign
    g), each as far from it as the recipe is from plain training: |layout - one| <= 2 |recipe - plain| (measured on
    this model, largest over the 3 steps, seeds 0-4: 8.9e-3, 6.3e-3, 5.0e-3, 3.6e-3, 9.3e-4).
    Measured (seeds 0-4 x ATEN_CPU_CAPABILITY = native, default, avx2; 2-core Intel Xeon with AVX-512, torch 2.13 CPU,
    2026-11-28): step 0 loss 0..5.4e-8, grad norm 2.5e-5..2.6e-4 (seeds 0-4; 12 of the 15 runs, a seed's dispatches
    alike; GRAD_GAP is 3.8x the largest); the largest gap of the RECIPE_STEPS steps 1.9e-4..2.6e-3
    (each under its seed's 2 |recipe - plain|; a seed's dispatches mostly alike, seed 2's default 3.2e-4 where native
    and avx2 give 1.6e-5). RECIPE_GAP = 8e-3: 3x the largest,
    under seed 0's ceiling 1.8e-2. Planted bugs caught: FP8 dispatch rows sent with 6% stale scales
    (dispatch.fp8.encode_fp8): step 0 loss 6.4e-6 (its later steps' gaps stay in range); DualPipeV's deferred FP8
    wgrads from 6% stale input scales (kernels.linear._merged_wgrad): step 0 grad norm 6.2e-3 (loss gaps in range);
    the layout without the recipe (a plain layout equals plain one process to ~1e-7; seed 0): step 0 loss 8.9e-5."""
    raw, records, _ = spawned(("recipe", RECIPE_LAYOUT))
    assert raw["parallel"]["dispatch_payload"] == "fp8" and raw["optim"]["moment_dtype"] == "bfloat16"
    with step_reads() as steps:
        one = train(build_config(recipe_raw(str(tmp_path), corpus, {})), progress=False)
    # issue 48: FP8 experts, linears and payload read nothing in forward and backward, on one process and in the
    # layout's padded exchange (which none of these steps overflows), and each step copies its statistics once
    assert [(s.reads, s.copies) for s in steps] == [([], 1)] * RECIPE_STEPS
    assert records[-1]["dispatch_reruns"] == 0
    for rank, attempts in enumerate(spawned.reads["recipe", RECIPE_LAYOUT]):
        assert attempts == [([], 1)] * RECIPE_STEPS, (rank, attempts[0][0][:5])
    gaps = {key: [abs(got[key] - want[key]) / want[key] for got, want in zip(records, one, strict=True)]
            for key in ("lm_loss", "grad_norm")}
    assert len(gaps["lm_loss"]) == RECIPE_STEPS, gaps
    assert gaps["lm_loss"][0] <= FIRST_GAP and gaps["grad_norm"][0] <= GRAD_GAP, gaps  # one forward and backward
    assert max(gaps["lm_loss"]) <= RECIPE_GAP, gaps


def check_equal_runs(records: list[dict], raw: dict, reference: tuple[list[dict], dict], parallel: dict,
                     name: str) -> None:
    """A layout's records and final params (its checkpoint, consolidated) equal the single process's."""
    want_records, want_state = reference
    assert [r["step"] for r in records] == list(range(STEPS))
    for got, want in zip(records, want_records):
        for key in ("loss", "lm_loss", "aux_loss"):  # the router's statistics are float64 here too
            assert got[key] == pytest.approx(want[key], rel=1e-10, abs=1e-14), (name, got["step"], key)
        assert got["dropped_tokens"] == want["dropped_tokens"], (name, got["step"])
        assert got["expert_load_max_over_mean"] == want["expert_load_max_over_mean"], (name, got["step"])
        for field in ("load", "bias"):  # full per-expert counts summed over ranks, biases of every layer
            assert np.array_equal(decode_array(got["moe"][field]), decode_array(want["moe"][field])), field
        # per-rank sections every train.rank_metrics_every = 2 steps and at the last
        assert ("ranks" in got) == ("traffic_bytes" in got) == (got["step"] % 2 == 1 or got["step"] == STEPS - 1)
        if "traffic_bytes" in got:
            check_traffic_matrix(got)
    if raw["model"].get("capacity_factor") is not None:
        assert sum(r["dropped_tokens"] for r in records) > 0
    spares = raw["parallel"].get("redundant_experts")
    if parallel.get("dispatch_backend") == "hierarchical" and not spares:
        check_node_limit(records, raw)  # (the redundant layout's EP group is one node: no inter-node bytes)
    state = consolidate(f"{raw['train']['run_dir']}/checkpoint")
    placements = {key: state.pop(key) for key in list(state) if key.endswith(".replica_placement")}
    if spares:  # the checkpoint holds owners and the placement; some spare slot is used
        assert placements and any((p >= 0).any() for p in placements.values()), placements
    assert set(state) == set(want_state)
    for key, want in want_state.items():
        if want.is_floating_point() and want.abs().sum() > 0:
            assert calc_diff(state[key], want) < 1e-12, (name, key)
        else:
            assert torch.equal(state[key], want), (name, key)


def _train_runs(rank: int, world: int, runs: list[tuple[dict, bool]]) -> list[list[dict]]:
    return [release_groups(train(build_config(raw), resume=resume, progress=False)) for raw, resume in runs]


def cut_raw(run_dir, corpus: str, parallel: dict, steps: int, optim: dict | None = None) -> dict:
    """raw_config (dropless) of `steps` steps with an [optim] section, its warmup covering the cut at CUT (so LRs do
    not depend on train.steps)."""
    out = {**raw_config(str(run_dir), corpus, parallel, None), "optim": optim or {}}
    out["train"].update(steps=steps, warmup_steps=CUT)
    return out


def reshard(variants: dict[str, tuple[dict, dict]], corpus: str, uninterrupted: tuple, root: Path
            ) -> dict[str, list[tuple[Path, list[dict], int]]]:
    """For each name -> (parallel, optim): the 1-process run cut at CUT (a copy) resumed in that layout, and the
    layout's own first CUT steps resumed on 1 process (ZeRO-1); the layouts' runs in one spawn. Returns name ->
    [(run dir, records, first step)] for check_resumed_runs."""
    runs = []
    for name, (parallel, optim) in variants.items():
        shutil.copytree(uninterrupted[2], root / name / "from_one")
        runs += [(cut_raw(root / name / "from_layout", corpus, parallel, CUT, optim), False),
                 (cut_raw(root / name / "from_one", corpus, parallel, STEPS, optim), True)]
    records = iter(run_processes(_train_runs, 2, runs, timeout_s=300, run_timeout_s=SPAWN_S)[0])
    out = {}
    for name in variants:
        saved, resumed = next(records), next(records)
        back = train(build_config(cut_raw(root / name / "from_layout", corpus, {}, STEPS)), resume=True,
                     progress=False)
        out[name] = [(root / name / "from_one", resumed, CUT), (root / name / "from_layout", saved + back, 0)]
    return out


@pytest.fixture(scope="module")
def resharded(corpus, uninterrupted, tmp_path_factory) -> dict[str, list[tuple[Path, list[dict], int]]]:
    return reshard({name: (LAYOUTS[name], {}) for name in ("tp2 sp", "cp2 ring")}, corpus, uninterrupted,
                   tmp_path_factory.mktemp("reshard"))


@pytest.mark.timeout(SPAWN_S + 120)
@pytest.mark.parametrize("layout", ["tp2 sp", "cp2 ring"])
def test_tp_and_cp_checkpoints_reshard_to_and_from_one_process(layout, resharded, uninterrupted):
    """A 1-process checkpoint resumes under tp2 SP (cp2) and a tp2 SP (cp2) one in 1 process: both continue the
    uninterrupted 1-process run."""
    check_resumed_runs(uninterrupted, resharded[layout])


def check_resumed_runs(uninterrupted: tuple, runs: list[tuple[Path, list[dict], int]]) -> None:
    """Each (run dir, its records, first step) continues the uninterrupted run (its dir and records first in
    uninterrupted): the same LM losses (1e-10) from its first step, and its final checkpoint's params (1e-12)."""
    whole_dir, whole = uninterrupted[:2]
    want = consolidate(whole_dir / "checkpoint")
    for run_dir, records, first in runs:
        name = run_dir.relative_to(run_dir.parents[1])
        assert [r["step"] for r in records] == list(range(first, STEPS)), name
        for got, ref in zip(records, whole[first:]):
            assert got["lm_loss"] == pytest.approx(ref["lm_loss"], rel=1e-10), (name, got["step"])
        state = consolidate(run_dir / "checkpoint")
        assert set(state) == set(want)
        for key, value in want.items():
            if value.is_floating_point() and value.abs().sum() > 0:
                assert calc_diff(state[key], value) < 1e-12, (name, key)
