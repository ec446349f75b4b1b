"""TP parts on 2 gloo ranks: SP byte claims on counters, vocab-parallel loss, deferred weight grads, group checks,
state dict round trip, backward beside a forward on a grad_group."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from launch.parallel.spawn import run_processes
from launch.bench.tp import CommMeter, run_stack
from moe.config import ModelConfig
from moe.model import Block, MoETransformer, rope_tables
from moe.tp import (TPRegion, check_tp_group, concurrent_backward, full_state_dict, parallelize_block,
                    vocab_parallel_cross_entropy)
from pipeline.memory import SavedTensorMeter
from pipeline.wgrad import WeightGradStore, install_split_linear
from tests.dispatch.cases import calc_diff

pytestmark = pytest.mark.slow  # spawns processes (tests/conftest.py)

WORLD, BATCH, SEQ, VOCAB, TOKENS = 2, 2, 8, 64, 12
CFG = dict(vocab_size=VOCAB, hidden_size=32, num_heads=4, num_kv_heads=2, max_seq_len=SEQ, dense_ffn_size=32,
           num_experts=4, expert_ffn_size=8, num_shared_experts=1, top_k=2)
ATTENTION = {"gqa": {"num_kv_heads": 1}, "mla": dict(attention="mla", q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4,
                                                     qk_rope_head_dim=4, v_head_dim=6)}
ATTENTION_LINEARS = {"gqa": ("kv", "out", "qkv"), "mla": ("kv_a", "kv_b", "out", "q_a", "q_b")}


class LargestTensor(TorchDispatchMode):
    """Largest element count of any tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _stack_figures(sp: bool, moe: bool) -> dict:
    """Comm bytes and norm-region saved bytes of a dense (or MoE) two-block stack on this rank."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, first_k_dense=0 if moe else 2, **CFG)
    stack = torch.nn.ModuleList(Block(cfg, moe=moe) for _ in range(2)).double()
    for block in stack:
        parallelize_block(block, dist.group.WORLD, sp)
    cos, sin = rope_tables(SEQ, 8, cfg.rope_theta)
    x = torch.randn(BATCH, SEQ // WORLD if sp else SEQ, 32, dtype=torch.float64, requires_grad=True)
    meter, comm = SavedTensorMeter(params=stack.parameters()), CommMeter()
    with comm, meter.hooks(), meter.region([m for b in stack for m in (b.attn_norm, b.ffn_norm)]):
        out = run_stack(stack, x, cos, sin)
        out.sum().backward()
    return {"comm": comm.bytes, "calls": comm.calls, "norm_bytes": meter.region_bytes}


def _loss_case(rank: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(TOKENS, VOCAB, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    labels[2] = -100
    block = slice(rank * VOCAB // WORLD, (rank + 1) * VOCAB // WORLD)
    mine = logits[:, block].clone().requires_grad_()
    largest = LargestTensor()
    with largest:
        loss = vocab_parallel_cross_entropy(mine, labels, dist.group.WORLD)
        loss.backward()
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, labels)
    want.backward()
    return {"loss": (loss.item(), want.item()), "grad": calc_diff(mine.grad, full.grad[:, block]),
            "largest": largest.numel}


def _deferred_grads(rank: int, attention: dict) -> dict:
    """A TP+SP model (GQA with KV heads replicated, or MLA; shared experts, vocab-parallel embedding and head) under
    a B/W split: every weight of a linear, the embedding and the experts waits for W, then equals the unsplit grads."""
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(num_layers=2, first_k_dense=1, **(CFG | attention))).double()
    model.to_tensor_parallel(dist.group.WORLD, sequence_parallel=True)
    split = copy.deepcopy(model)
    linears = install_split_linear([split])
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    store = WeightGradStore()
    loss = split(tokens[:, :-1], tokens[:, 1:]).loss
    with store.capture("chunk"):
        loss.backward()
    deferred = [name for name, p in split.named_parameters() if p.grad is None]
    ran = store.run("chunk")
    ref = dict(model.named_parameters())
    return {"linears": sorted(name for name, m in split.named_modules() if m in linears), "deferred": sorted(deferred),
            "ran": ran, "diffs": {name: calc_diff(p.grad, ref[name].grad) for name, p in split.named_parameters()}}


def _bad_groups(rank: int) -> list[str]:
    """Converting a model whose shapes do not split over the group fails, naming the field."""
    errors = []
    for overrides in ({"num_heads": 3, "hidden_size": 36, "num_kv_heads": 1}, {"vocab_size": 63}):
        model = MoETransformer(ModelConfig(num_layers=2, **(CFG | overrides)))
        try:
            model.to_tensor_parallel(dist.group.WORLD, sequence_parallel=True)
        except ValueError as err:
            errors.append(str(err))
    model = MoETransformer(ModelConfig(num_layers=2, **CFG))
    model.to_tensor_parallel(dist.group.WORLD, sequence_parallel=True)
    alone = dist.new_group([0])
    for bad in (lambda: model(torch.zeros(1, 7, dtype=torch.long)), lambda: check_tp_group(dist.group.WORLD, 4),
                lambda: TPRegion(dist.group.WORLD, True, grad_group=alone)):
        try:
            bad()
        except ValueError as err:
            errors.append(str(err))
    return errors


def _state_round_trip(rank: int) -> dict:
    """A single-process state dict loads into a model that is then converted (KV heads replicated, so attn.kv
    appears), and full_state_dict of the TP model loads back, strictly, into a fresh single-process model."""
    cfg = ModelConfig(num_layers=2, first_k_dense=1, **(CFG | {"num_kv_heads": 1}))
    torch.manual_seed(0)
    source = MoETransformer(cfg)
    source.moe_layers()[0].router.expert_bias.normal_()
    torch.manual_seed(1)
    model = MoETransformer(cfg)
    model.load_state_dict(source.state_dict())
    model.to_tensor_parallel(dist.group.WORLD, sequence_parallel=True)
    local_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    torch.manual_seed(2)
    back = MoETransformer(cfg)
    back.load_state_dict(full_state_dict(model, dist.group.WORLD))
    want = source.state_dict()
    return {"equal": all(torch.equal(t, want[name]) for name, t in back.state_dict().items()),
            "kv": local_shapes["blocks.0.attn.kv.weight"], "qkv": local_shapes["blocks.0.attn.qkv.weight"],
            "head": local_shapes["lm_head.weight"], "seq": model.sequence_length(torch.zeros(1, SEQ // WORLD, 32))}


def _concurrent_backward(rank: int) -> dict:
    """Backward of micro-batch A on a helper thread beside the forward of B (a DualPipe F&B pair), TP+SP
    collectives of the backward on a grad_group: outputs and grads bitwise equal to running them in turn."""
    grad_group = dist.new_group(list(range(WORLD)))
    torch.manual_seed(0)
    first = MoETransformer(ModelConfig(num_layers=2, first_k_dense=1, **CFG)).double()
    second = copy.deepcopy(first)
    for model in (first, second):
        model.to_tensor_parallel(dist.group.WORLD, sequence_parallel=True, grad_group=grad_group)
    tokens = torch.randint(0, VOCAB, (2, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    in_turn = [first(*b).loss for b in batches[:1]]
    in_turn[0].backward()
    in_turn.append(first(*batches[1]).loss)
    in_turn[1].backward()
    loss_a = second(*batches[0]).loss
    start = threading.Barrier(2)

    def backward_a() -> None:
        start.wait()
        loss_a.backward()

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(backward_a)
        start.wait()
        loss_b = second(*batches[1]).loss
        done.result(timeout=120)
    loss_b.backward()
    grads = dict(first.named_parameters())
    shared_group = MoETransformer(second.cfg)
    shared_group.to_tensor_parallel(dist.group.WORLD, sequence_parallel=False)
    return {"concurrent": concurrent_backward(second), "shared": concurrent_backward(shared_group),
            "losses": [loss_a.item(), loss_b.item()] == [x.item() for x in in_turn],
            "grads": all(torch.equal(p.grad, grads[name].grad) for name, p in second.named_parameters())}


def _parts(rank: int, world_size: int) -> dict:
    return {"stacks": {(sp, moe): _stack_figures(sp, moe) for sp in (False, True) for moe in (False, True)},
            "loss": _loss_case(rank), "deferred": {kind: _deferred_grads(rank, ATTENTION[kind]) for kind in ATTENTION}, "errors": _bad_groups(rank),
            "concurrent": _concurrent_backward(rank), "state": _state_round_trip(rank)}


@pytest.fixture(scope="module")
def results():
    return run_processes(_parts, WORLD, timeout_s=240)


def test_sequence_parallel_moves_the_same_bytes_as_plain_tp(results):
    for res in results:
        plain, sp = res["stacks"][False, False], res["stacks"][True, False]
        assert plain["comm"] == sp["comm"] > 0
        assert set(plain["calls"]) == {"all_reduce"} and set(sp["calls"]) == {"all_gather_into_tensor",
                                                                             "reduce_scatter_tensor"}


def test_moe_blocks_with_sp_move_no_more_than_without(results):
    for res in results:
        assert 0 < res["stacks"][True, True]["comm"] <= res["stacks"][False, True]["comm"]


@pytest.mark.parametrize("moe", [False, True])
def test_norm_activations_per_rank_fall_by_the_tp_degree_with_sp(results, moe):
    for res in results:
        plain, sp = res["stacks"][False, moe]["norm_bytes"], res["stacks"][True, moe]["norm_bytes"]
        assert plain > 0 and abs(sp * WORLD / plain - 1) <= 0.05


def test_vocab_parallel_loss_equals_cross_entropy_without_full_logits(results):
    for res in results:
        got, want = res["loss"]["loss"]
        assert abs(got - want) <= 1e-12 * abs(want)
        assert res["loss"]["grad"] < 1e-14
        assert res["loss"]["largest"] == TOKENS * VOCAB // WORLD  # never [tokens, vocab]


@pytest.mark.parametrize("attention", list(ATTENTION))
def test_tp_weight_grads_wait_for_the_w_action(results, attention):
    """Every linear's weight (MLA: its down- and up-projections too) waits; norm scales are computed in B."""
    linears = sorted([f"blocks.{i}.attn.{name}" for i in (0, 1) for name in ATTENTION_LINEARS[attention]]
                     + ["blocks.0.ffn.down", "blocks.0.ffn.gate_up", "blocks.1.ffn.shared.down",
                        "blocks.1.ffn.shared.gate_up", "lm_head"])
    experts = ["blocks.1.ffn.experts.w_down", "blocks.1.ffn.experts.w_gate_up"]
    for res in results:
        deferred = res["deferred"][attention]
        assert deferred["linears"] == linears
        assert deferred["deferred"] == sorted([name + ".weight" for name in linears] + experts + ["embed.weight"])
        assert deferred["ran"] >= len(deferred["deferred"])
        for name, diff in deferred["diffs"].items():
            assert diff < 1e-14, name


def test_group_that_does_not_fit_the_config_is_refused(results):
    heads, vocab, seq, group, grad_group = results[0]["errors"]
    assert "model.num_heads = 3" in heads and "parallel.tp = 2" in heads and "[1, 3]" in heads
    assert "model.vocab_size = 63" in vocab and "[1, 3, 7, 9, 21, 63]" in vocab
    assert "train.seq_len = 7" in seq and "parallel.tp = 2" in seq
    assert "has 2 ranks but parallel.tp = 4" in group
    assert "grad_group must hold the TP group's ranks [0, 1], got [0]" in grad_group


def test_backward_on_a_grad_group_runs_beside_a_forward(results):
    for res in results:
        assert res["concurrent"] == {"concurrent": True, "shared": False, "losses": True, "grads": True}


def test_single_process_state_dict_loads_into_the_tp_model_and_back(results):
    for res in results:
        assert res["state"] == {"equal": True, "kv": (2 * 8, 32), "qkv": (2 * 8, 32), "head": (VOCAB // WORLD, 32),
                                "seq": SEQ}
