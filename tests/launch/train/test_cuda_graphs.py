"""train.cuda_graphs (issue 48, launch.train.graphs) on the CPU: the trainer's micro-batches captured and replayed by
the replay simulator (tests/graph_replay.py: the same capture logic, the aten operators recorded and re-run on the same
tensors, never the Python) train to losses and final parameters bitwise equal to the eager run, in float32, on
one process: dropless, with capacity drops, with DeepSeek-V3's FP8 recipe (the CPU references), and with MLA, an MTP
depth and selective recompute, with full recompute and document masking (EOS = the byte tokenizer's 0, about 1 in
128 random tokens); and on 2 processes (slow): dp2, and dp2 x ep2 with the padded exchange overflowing in a replayed
step.

The comparison can fail: Python-side state in the forward (a counter, tallies rebound to new tensors, as
Stage.reset_tallies did before the capture) makes the replayed run differ, and a host read inside the captured region
is refused at the capture. Layouts the capture does not hold yet are refused before any process starts."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch

from launch.config.run import build_config
from launch.parallel.stages import LayerTally, Stage
from launch.plan.rehearse import RandomFeed
from launch.train import loop
from launch.train.graphs import WARMUP_MICRO_BATCHES, GraphStateError, StepGraphs, check_graphable, step_graphs
from launch.train.preflight import check_run
from moe.layer import MoELayer
from tests.graph_replay import ReplayGraphs
from tests.syncs import HostRead

STEPS, MICRO = 4, 2
RECIPE = {"expert_precision": "fp8", "linear_precision": "fp8", "activation_cache": "fp8"}  # DeepSeek-V3's FP8 recipe
MLA = {"attention": "mla", "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 8}
# by name: (model, train, data) settings over tiny's
CASES = {"dropless": ({}, {}, {}), "capacity 1.0": ({"capacity_factor": 1.0}, {}, {}), "fp8 recipe": (RECIPE, {}, {}),
         "mla, mtp, selective recompute": ({**MLA, "mtp_depth": 1}, {"recompute": "selective"}, {}),
         "full recompute, document mask": ({}, {"recompute": "full"}, {"document_mask": True})}


def tiny(run_dir, model: dict | None = None, parallel: dict | None = None, graphs: bool = True, **train) -> dict:
    """A float32 model of 1 dense and 1 MoE layer (4 experts, top-2, aux loss and bias update on), MICRO micro-batches
    of 2 x 16 tokens a step, on one process."""
    return {"model": {"vocab_size": 128, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                      "dense_ffn_size": 64, "num_experts": 4, "expert_ffn_size": 16, "top_k": 2, "max_seq_len": 16,
                      "first_k_dense": 1, "aux_loss_coeff": 0.01, "bias_update_rate": 0.01, **(model or {})},
            "train": {"steps": STEPS, "micro_batch_size": 2, "seq_len": 16, "grad_accum_steps": MICRO, "lr": 0.01,
                      "warmup_steps": 1, "eval_batches": 0, "run_dir": str(run_dir), "cuda_graphs": graphs, **train},
            "parallel": parallel or {}}


def run(run_dir, case: str, graphs: bool) -> tuple[list[float], dict[str, torch.Tensor], ReplayGraphs | None]:
    """(each step's loss, the final parameters, the simulator) of STEPS steps of CASES[case] on random tokens, graphed
    or eager."""
    model, train, data = CASES[case]
    cfg = build_config({**tiny(run_dir, model, graphs=graphs, **train), "data": data})
    held, build = {}, loop.build_model

    def keep(*args, **kwargs):
        held["stages"], runtime = build(*args, **kwargs)
        return held["stages"], runtime
    backend = ReplayGraphs() if graphs else None
    with mock.patch.object(loop, "build_model", keep):
        records = loop.train(cfg, progress=False, feed=RandomFeed(cfg, torch.device("cpu")), checkpoints=False,
                             graph_backend=backend)
    params = {name: p.detach().clone() for stage in held["stages"] for name, p in stage.named_parameters()}
    return [r["loss"] for r in records], params, backend


def assert_bitwise(graphed: tuple, eager: tuple) -> None:
    assert graphed[0] == eager[0], "losses"
    assert all(torch.equal(graphed[1][name], p) for name, p in eager[1].items()), "final parameters"


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    """The eager runs, by case (made once)."""
    return {case: run(tmp_path_factory.mktemp("eager"), case, graphs=False) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_graphed_steps_equal_eager_ones_bitwise(case, eager, tmp_path):
    graphed = run(tmp_path, case, graphs=True)
    assert_bitwise(graphed, eager[case])
    backend = graphed[2]
    assert (backend.captures, backend.replays) == (1, STEPS * MICRO - WARMUP_MICRO_BATCHES)


def test_python_state_in_the_forward_makes_the_replay_differ(eager, tmp_path):
    """Two plants of state a replay does not redo: the routing tallies rebound to new tensors at every step (what
    Stage.reset_tallies did: the graph keeps adding into the first ones, the step's statistics read zeros), and a
    Python counter scaling each MoE layer's output (frozen at its capture value)."""
    def rebinding(stage: Stage) -> None:
        device = next(stage.parameters()).device
        stage.tallies = {i: LayerTally.zeros(stage.cfg.num_experts, device) for i in stage.moe_layers()}
    with mock.patch.object(Stage, "reset_tallies", rebinding):
        with pytest.raises(AssertionError, match="losses"):
            assert_bitwise(run(tmp_path / "rebinding", "dropless", graphs=True), eager["dropless"])

    forward = MoELayer.forward_steps

    def counted(calls):
        def forward_steps(self, *args, **kwargs):
            out, stats = yield from forward(self, *args, **kwargs)
            return out * (1 + next(calls) / 64), stats
        return forward_steps
    with mock.patch.object(MoELayer, "forward_steps", counted(itertools.count())):
        planted = run(tmp_path / "counted eager", "dropless", graphs=False)
    with mock.patch.object(MoELayer, "forward_steps", counted(itertools.count())):
        with pytest.raises(AssertionError, match="losses"):
            assert_bitwise(run(tmp_path / "counted", "dropless", graphs=True), planted)


def test_a_host_read_in_the_captured_region_is_refused(tmp_path):
    forward = MoELayer.forward_steps

    def reading(self, x, *args, **kwargs):
        x.sum().item()
        return (yield from forward(self, x, *args, **kwargs))
    with mock.patch.object(MoELayer, "forward_steps", reading), pytest.raises(HostRead, match="Tensor.item"):
        run(tmp_path, "dropless", graphs=True)


def test_a_capture_that_rebinds_a_grad_is_refused():
    """A replay accumulates into the .grad tensors bound at the capture: a capture that binds a new one (a grad that
    did not exist, set_to_none) is refused, naming the parameter; with the grads bound before, it passes."""
    layer = torch.nn.Linear(4, 2)
    graphs = StepGraphs(ReplayGraphs(), dict(layer.named_parameters()), warmup=0)

    def work(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(layer(inputs.float()), labels)
        loss.backward()
        return loss.detach()
    inputs, labels = torch.ones(3, 4, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    with pytest.raises(GraphStateError, match="rebound the .grad of weight, bias"):
        graphs.micro_batch(work, inputs, labels, 1.0)
    eager = work(inputs, labels)  # binds the grads
    assert torch.equal(graphs.micro_batch(work, inputs, labels, 1.0), eager)


def test_cuda_graphs_off_cuda_are_refused_by_the_trainer_too(tmp_path):
    """train() called directly (no preflight) on the CPU with train.cuda_graphs and no test backend: a clear error,
    before any step; a rehearsal on meta runs eagerly (no graphs)."""
    cfg = build_config(tiny(tmp_path))
    with pytest.raises(ValueError, match=r"train.cuda_graphs = true captures CUDA graphs, but this rank computes on "
                                         r"cpu"):
        loop.train(cfg, progress=False, feed=RandomFeed(cfg, torch.device("cpu")), checkpoints=False)
    assert step_graphs(cfg, [], torch.device("meta")) is None


@pytest.mark.parametrize("parallel, optim, key", [
    ({"dp": 2, "ep": 2, "dispatch_exchange": "padded", "redundant_experts": 1}, {}, "parallel.redundant_experts = 1"),
    ({"tp": 2}, {}, "parallel.tp = 2"),
    ({"cp": 2}, {}, "parallel.cp = 2"),
    ({"dp": 2}, {"zero_stage": 2}, "optim.zero_stage = 2"),
])
def test_layouts_not_captured_yet_are_refused_naming_the_key(parallel, optim, key, tmp_path, monkeypatch):
    """Refused by check_graphable, before any process starts (launch.train.preflight.check_run, here with a GPU
    faked so that the device check passes); dp x ep with the padded exchange passes, so do pipelines
    (tests/launch/train/test_pipeline_graphs.py), and so does the key off."""
    raw = tiny(tmp_path, parallel=parallel, grad_accum_steps=4)
    raw["optim"] = optim
    cfg = build_config(raw)
    refusal = rf"train.cuda_graphs = true cannot capture .*{key}.* train.cuda_graphs = false"
    with pytest.raises(ValueError, match=refusal):
        check_graphable(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ValueError, match=key):
        check_run(cfg)
    check_graphable(build_config(tiny(tmp_path, parallel={"dp": 2, "ep": 2, "dispatch_exchange": "padded"},
                                      grad_accum_steps=4)))
    check_graphable(build_config(tiny(tmp_path, parallel={"pp": 2, "schedule": "1f1b"}, grad_accum_steps=4)))
    check_graphable(build_config({**raw, "train": {**raw["train"], "cuda_graphs": False}}))


def _spawned_runs(rank: int, world: int, raws: list[dict]) -> list[tuple[list[tuple], int, int]]:
    """Each raw config's (per step: loss, grad norm, dispatch reruns so far, traffic), captures, replays) on this
    rank, graphed through the replay simulator where its train.cuda_graphs says so."""
    out = []
    for raw in raws:
        cfg = build_config(raw)
        backend = ReplayGraphs() if cfg.train.cuda_graphs else None
        records = loop.train(cfg, progress=False, feed=RandomFeed(cfg, torch.device("cpu")), checkpoints=False,
                             graph_backend=backend)
        out.append(([(r["loss"], r["grad_norm"], r["dispatch_reruns"], r["traffic"]) for r in records],
                    backend.captures if backend else 0, backend.replays if backend else 0))
    return out


@pytest.mark.slow  # spawns 2 processes
def test_data_and_expert_parallel_graphed_steps_equal_eager_ones_bitwise(tmp_path):
    """On 2 processes the graphed runs train to the eager runs' losses, grad norms, exact reruns and traffic, bitwise:
    - dp2 (ZeRO-1), one micro-batch a rank (each step's last, whose backward reduces the grads when eager: graphed,
      the reduction runs after the captured backward), captured at step 2;
    - dp2 x ep2 with the padded exchange (its all-to-alls captured, its byte counts redone at each replay:
      dispatch.traffic.deferred), 2 micro-batches a rank: headroom 1.0 overflows at step 0 only (steps 2 and 3
      replayed), 0.7 at steps 0 and 2: step 2 is captured and replayed, its overflow flag (set in place by the
      replays) reruns it exactly and eagerly, and the graphs are dropped (step 3 warms up again);
    - the same with the device-split exchange at headroom 1.0 (dispatch.device_split's reference: its counts
      exchanged and its padding masked inside the graph, its rows counted from the device counts each replay left):
      the padded run's overflows, graphed as eager."""
    from launch.parallel.spawn import run_processes

    padded = {"dp": 2, "ep": 2, "dispatch_exchange": "padded"}
    runs = {"dp": ({"dp": 2}, 2),
            **{headroom: ({**padded, "dispatch_headroom": headroom}, 4) for headroom in (1.0, 0.7)},
            "split": ({**padded, "dispatch_exchange": "device_split", "dispatch_headroom": 1.0}, 4)}
    raws = [tiny(tmp_path / f"{name}-{graphs}", parallel=parallel, graphs=graphs, rank_metrics_every=1,
                 grad_accum_steps=micro) for name, (parallel, micro) in runs.items() for graphs in (False, True)]
    done = run_processes(_spawned_runs, 2, raws, timeout_s=300)[0]
    (dp, _, _), dp_graphed, (roomy, _, _), roomy_graphed, (tight, _, _), tight_graphed, (split, _, _), split_graphed \
        = done
    assert dp_graphed == (dp, 1, 2) and len(dp) == STEPS
    assert roomy_graphed == (roomy, 1, 4) and [r[2] for r in roomy] == [1, 1, 1, 1]
    assert tight_graphed == (tight, 1, 2) and [r[2] for r in tight] == [1, 1, 2, 2]
    assert split_graphed == (split, 1, 4) and [r[2] for r in split] == [r[2] for r in roomy]
