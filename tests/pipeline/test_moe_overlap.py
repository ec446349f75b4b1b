"""DualPipeV / DualPipe over real MoE stages, 2 pipeline ranks x 2 EP ranks (4 gloo processes):
EP overlap in both directions, one direction and off all equal a single-process reference, and an
event log proves that each direction's exchange is in flight while the other chunk computes."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dispatch import EPDispatcher
from dispatch.channel import Pending
from launch.parallel.spawn import run_processes
from moe.config import ModelConfig
from moe.layer import MoELayer
from pipeline import DualPipe, DualPipeV
from pipeline.overlap import complete
from tests.pipeline.models import calc_diff

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

HIDDEN, EXPERTS, ROWS, CHUNKS = 16, 4, 8, 4  # ROWS tokens per EP rank (one DP replica) and step
PP, EP = 2, 2
GATE_S = 60.0  # bound on a gate of the witness run; only reached when the overlap is missing
MODES = {"both": (True, True), "forward": (True, False), "off": (False, True)}  # (overlap, grad_group)
CASES = {"dualpipev": (DualPipeV, 2 * PP, "hierarchical"), "dualpipe": (DualPipe, PP, "flat")}


class _Mark(torch.autograd.Function):
    """Identity whose backward calls a callback (marks a point of the backward in the event log)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, callback) -> torch.Tensor:  # noqa: D102
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        ctx.callback()
        return grad, None


class MoEStage(nn.Module):
    """x -> h = tanh(Linear(x)) -> h + MoE(h): a pipeline stage around the real MoE layer."""

    def __init__(self) -> None:
        super().__init__()
        cfg = ModelConfig(hidden_size=HIDDEN, num_experts=EXPERTS, top_k=2, expert_ffn_size=HIDDEN,
                          num_shared_experts=1)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoELayer(cfg)
        self.on_backward = None  # called when the backward reaches the MoE layer's input

    @property
    def concurrent_backward(self) -> bool:
        """The MoE layer's: True when its dispatcher has a grad group."""
        return self.moe.concurrent_backward

    def forward_steps(self, x: torch.Tensor):
        """forward, pausing while the MoE layer's exchanges are in flight."""
        h = torch.tanh(self.proj(x))
        if self.on_backward is not None:
            h = _Mark.apply(h, self.on_backward)
        out, _ = yield from self.moe.forward_steps(h)
        return h + out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """forward_steps without pausing."""
        return complete(self.forward_steps(x))


def make_stages(num_stages: int) -> list[MoEStage]:
    """The full model's stages in float64, identical in every process."""
    torch.manual_seed(0)
    return [MoEStage().double() for _ in range(num_stages)]


def make_data(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [ROWS, HIDDEN] of one DP replica (= EP rank)."""
    g = torch.Generator().manual_seed(100 + replica)
    return (torch.randn(ROWS, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(ROWS, HIDDEN, generator=g, dtype=torch.float64))


def criterion(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Loss of one chunk."""
    return ((out - label) ** 2).mean()


def held_stages(kind: str, pp_rank: int) -> tuple[int, int]:
    """Stages (m0, m1) a pipeline rank holds."""
    return pp_rank, CASES[kind][1] - 1 - pp_rank


def step_inputs(kind: str, pp_rank: int, replica: int) -> tuple[tuple, tuple]:
    """(inputs, labels) a pipeline rank passes to step(), in DualPipe's convention."""
    x, label = make_data(replica)
    if kind == "dualpipev":
        return ((x,), (label,)) if pp_rank == 0 else ((), ())
    halves = x.chunk(2), label.chunk(2)
    return (halves[0][pp_rank],), (halves[1][1 - pp_rank],)


def build(kind: str, mode: str, groups: dict, pp_rank: int, ep_rank: int):
    """This rank's runtime over its two stages, each MoE layer on its EP block."""
    cls, num_stages, backend = CASES[kind]
    overlap, with_grad_group = MODES[mode]
    stages = make_stages(num_stages)
    held = [copy.deepcopy(stages[s]) for s in held_stages(kind, pp_rank)]
    for stage in held:
        stage.moe.to_expert_parallel(EPDispatcher(EXPERTS, group=groups["ep"], gpus_per_node=1, backend=backend,
                                                  grad_group=groups["ep_grad"] if with_grad_group else None))
    return cls(tuple(held), process_group=groups["pp"], overlap=overlap)


def make_groups(rank: int) -> dict:
    """Pipeline groups {0,2},{1,3}; EP groups {0,1},{2,3}, each with a second group for grad exchanges."""
    made = {"pp": [dist.new_group([r, r + EP]) for r in range(EP)],
            "ep": [dist.new_group([p * EP, p * EP + 1]) for p in range(PP)],
            "ep_grad": [dist.new_group([p * EP, p * EP + 1]) for p in range(PP)]}
    return {"pp": made["pp"][rank % EP], "ep": made["ep"][rank // EP], "ep_grad": made["ep_grad"][rank // EP]}


def run_step(kind: str, pipe, pp_rank: int, replica: int):
    inputs, labels = step_inputs(kind, pp_rank, replica)
    loss, _ = pipe.step(*inputs, num_chunks=CHUNKS, criterion=criterion, labels=labels)
    return loss


class Witness:
    """Event log of a rank's first concurrent F&B pair; gates hold each thread at one point until the
    other thread has done the work the proof needs, so the interleaving does not depend on timing:

    - the forward issues its first exchange, meets the backward at a barrier, computes the shared
      experts, and waits for that exchange only after the backward has computed (marked at the
      MoE layer's input, after its expert backward);
    - the backward issues its first grad exchange, meets the forward at the barrier, and returns
      to wait for it only after the forward has computed.
    Without the overlap the barrier breaks (BrokenBarrierError) and the run fails.
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.in_pair = False
        self.done = False
        self.barrier = threading.Barrier(2, timeout=GATE_S)
        self.forward_computed = threading.Event()
        self.backward_computed = threading.Event()
        self._first = {"F": True, "B": True}

    def active(self) -> bool:
        return self.in_pair and not self.done

    def note(self, event: str) -> None:
        if self.active():
            thread = "main" if threading.current_thread() is threading.main_thread() else "helper"
            self.events.append((thread, event))

    def wrap_pair(self, pipe) -> None:
        run = pipe._forward_backward

        def pair(act):
            self.in_pair = True
            run(act)
            self.in_pair, self.done = False, True
        pipe._forward_backward = pair

    def wrap_channel(self, channel, side: str) -> None:
        issue = channel.start_exchange

        def start_exchange(*args, **kwargs) -> Pending:
            pending = issue(*args, **kwargs)
            if not self.active():
                return pending
            first, self._first[side] = self._first[side], False
            self.note(f"{side} issued")
            if first:
                self.barrier.wait()
                if side == "B":  # the grad exchange stays in flight until the forward has computed
                    assert self.forward_computed.wait(GATE_S), "the forward never computed beside the backward"

            def wait():
                if first and side == "F":  # the forward's exchange stays in flight until the backward computed
                    assert self.backward_computed.wait(GATE_S), "the backward never computed beside the forward"
                out = pending.wait()
                self.note(f"{side} arrived")
                return out
            return Pending(None, wait)
        channel.start_exchange = start_exchange

    def on_shared(self, *_) -> None:
        if self.active() and threading.current_thread() is threading.main_thread():
            self.note("F computed")
            self.forward_computed.set()

    def on_backward(self) -> None:
        if self.active() and threading.current_thread() is not threading.main_thread():
            self.note("B computed")
            self.backward_computed.set()


def witness_run(groups: dict, pp_rank: int, ep_rank: int) -> list[tuple[str, str]]:
    """DualPipeV, overlap in both directions, with a Witness on every stage: the event log of the
    first F&B pair."""
    pipe = build("dualpipev", "both", groups, pp_rank, ep_rank)
    witness = Witness()
    witness.wrap_pair(pipe)
    for stage in pipe.module:
        witness.wrap_channel(stage.moe.dispatcher.channels[0], "F")
        witness.wrap_channel(stage.moe.dispatcher.grad_channels[0], "B")
        stage.moe.shared.register_forward_hook(witness.on_shared)
        stage.on_backward = witness.on_backward
    run_step("dualpipev", pipe, pp_rank, ep_rank)
    return witness.events


def ranks_main(rank: int, world: int) -> dict:
    """Every (schedule, mode) step's losses and grads, and the witness log, on this rank."""
    groups = make_groups(rank)
    pp_rank, ep_rank = rank // EP, rank % EP
    out: dict = {"pp": pp_rank, "ep": ep_rank}
    for kind in CASES:
        for mode in MODES:
            pipe = build(kind, mode, groups, pp_rank, ep_rank)
            loss = run_step(kind, pipe, pp_rank, ep_rank)
            grads = {(s, name): p.grad for s, m in zip(held_stages(kind, pp_rank), pipe.module)
                     for name, p in m.named_parameters()}
            out[kind, mode] = {"loss": loss, "grads": grads}
            dist.barrier()
    out["witness"] = witness_run(groups, pp_rank, ep_rank)
    return out


def reference(kind: str) -> tuple[dict, dict]:
    """Single process, float64: per replica the per-chunk losses; per (replica, stage, name) the
    grads each EP rank's parameters should hold (dense: its replica's; experts: its block, all
    replicas' tokens)."""
    losses, dense, experts = {}, {}, {}
    for replica in range(EP):
        model = make_stages(CASES[kind][1])
        x, label = make_data(replica)
        losses[replica] = []
        for xc, lc in zip(x.chunk(CHUNKS), label.chunk(CHUNKS)):
            out = xc
            for stage in model:
                out = stage(out)
            loss = criterion(out, lc)
            loss.backward()
            losses[replica].append(loss.detach())
        for s, stage in enumerate(model):
            for name, p in stage.named_parameters():
                if name.startswith("moe.experts."):
                    experts[s, name] = experts.get((s, name), 0) + p.grad
                else:
                    dense[replica, s, name] = p.grad
    block = EXPERTS // EP
    grads = dict(dense)
    for (s, name), g in experts.items():
        for replica in range(EP):
            grads[replica, s, name] = g[replica * block:(replica + 1) * block]
    return {r: torch.stack(v) for r, v in losses.items()}, grads


@pytest.fixture(scope="module")
def results():
    return run_processes(ranks_main, PP * EP, timeout_s=300)


@pytest.mark.parametrize("kind", list(CASES))
def test_moe_pipeline_equals_single_process(results, kind):
    ref_losses, ref_grads = reference(kind)
    for mode in MODES:
        for replica in range(EP):
            ranks = [r for r in results if r["ep"] == replica]
            if kind == "dualpipev":  # pipeline rank 0 ends every chunk
                loss = next(r for r in ranks if r["pp"] == 0)[kind, mode]["loss"]
            else:  # the last pipeline rank ends the first half's chunks, rank 0 the second half's
                by_pp = {r["pp"]: r[kind, mode]["loss"] for r in ranks}
                loss = torch.cat([by_pp[PP - 1], by_pp[0]])
            torch.testing.assert_close(loss, ref_losses[replica], rtol=1e-12, atol=0)
            summed: dict = {}
            for r in ranks:  # DualPipe: add up the mirrored copies of each stage
                for key, g in r[kind, mode]["grads"].items():
                    summed[key] = summed.get(key, 0) + g
            assert summed.keys() == {(s, n) for (rep, s, n) in ref_grads if rep == replica}
            for (s, name), g in summed.items():
                assert calc_diff(g, ref_grads[replica, s, name]) < 1e-12, (kind, mode, replica, s, name)


@pytest.mark.parametrize("kind", list(CASES))
def test_overlap_modes_give_identical_numbers(results, kind):
    for r in results:
        off = r[kind, "off"]
        for mode in ("both", "forward"):
            loss = r[kind, mode]["loss"]
            assert loss is None if off["loss"] is None else torch.equal(loss, off["loss"]), (kind, mode)
            for key, g in off["grads"].items():
                assert torch.equal(r[kind, mode]["grads"][key], g), (kind, mode, key)


def test_both_directions_overlap_inside_a_pair(results):
    for r in results:
        events = r["witness"]
        at = {event: events.index(event) for event in dict.fromkeys(events)}  # first occurrence
        assert all(thread == ("main" if event.startswith("F") else "helper") for thread, event in events), events
        # the forward's first exchange is in flight while the backward computes ...
        assert at["main", "F issued"] < at["helper", "B computed"] < at["main", "F arrived"], events
        # ... and the backward's first grad exchange while the forward computes
        assert at["helper", "B issued"] < at["main", "F computed"] < at["helper", "B arrived"], events
