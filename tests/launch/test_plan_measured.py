"""moe-plan against measured counters: EPDispatcher's bytes on the tiny model's MoE layers (4 gloo ranks, 2
simulated nodes) equal the planner's prediction exactly; ZeRO1's optimizer bytes and each rank's parameters
equal the planned ones within 1%."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dispatch import EPDispatcher, make_topology
from dispatch.multiproc import run_processes
from launch.config import load_config
from launch.plan.planner import Machine, make_plan
from launch.plan.presets import GPUS
from launch.plan.traffic import moe_layer_traffic
from moe.model import MoETransformer
from optim.zero1 import ZeRO1

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WORLD, GPUS_PER_NODE = 4, 2
CASES = (("flat", "bf16"), ("hierarchical", "fp8"))
LAYOUT = ["parallel.dp=4", "parallel.ep=2", "parallel.tp=1", "parallel.pp=1", 'parallel.schedule="none"',
          "parallel.gpus_per_node=2", "parallel.num_chunks=0", "train.grad_accum_steps=4", "train.micro_batch_size=2",
          "train.seq_len=32"]


def _tiny():
    return load_config(CONFIGS / "tiny.toml", LAYOUT)


def _dispatch_worker(rank: int, world: int) -> list:
    """Per case: the router's indices of every MoE layer and the dispatcher's byte counters after fwd + bwd."""
    config = _tiny()
    torch.manual_seed(0)
    model = MoETransformer(config.model)
    out = []
    for backend, payload in CASES:
        layer = MoETransformer(config.model).moe_layers()[0]
        layer.load_state_dict(model.moe_layers()[0].state_dict())
        layer.to_expert_parallel(EPDispatcher(config.model.num_experts, gpus_per_node=GPUS_PER_NODE,
                                              backend=backend, payload=payload))
        seen = []
        layer.router.register_forward_hook(lambda _m, _a, result: seen.append(result.indices.clone()))
        x = torch.randn(64, config.model.hidden_size, generator=torch.Generator().manual_seed(rank),
                        requires_grad=True)
        y, _ = layer(x, seq_len=32)
        y.square().sum().backward()
        out.append((seen[0], {k: v.as_dict() for k, v in layer.dispatcher.total_bytes.items()}))
    return out


def test_dispatch_counters_equal_the_planned_bytes_exactly():
    results = run_processes(_dispatch_worker, WORLD, timeout_s=180)
    hidden, experts = _tiny().model.hidden_size, _tiny().model.num_experts
    for case, (backend, payload) in enumerate(CASES):
        indices = [results[r][case][0] for r in range(WORLD)]
        planned = moe_layer_traffic(indices, experts, make_topology(WORLD, GPUS_PER_NODE), hidden, backend, payload,
                                    torch.float32)
        for rank in range(WORLD):
            measured = results[rank][case][1]
            assert set(measured) == set(planned[rank])
            for kind, traffic in planned[rank].items():
                assert measured[kind] == traffic.as_dict(), (backend, payload, rank, kind)
        assert any(planned[r]["dispatch"].inter_node for r in range(WORLD))  # the 2 nodes are really crossed


def _zero_worker(rank: int, world: int) -> tuple[int, int, int]:
    """This rank's dense and expert parameter counts and ZeRO1's optimizer bytes, dp=4 and ep=2 as in LAYOUT."""
    config = _tiny()
    torch.manual_seed(0)
    model = MoETransformer(config.model)
    ep_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    expert_dp = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    for layer in model.moe_layers():
        layer.to_expert_parallel(EPDispatcher(config.model.num_experts, ep_groups[rank // 2], backend="flat"))
    experts = [p for layer in model.moe_layers() for p in layer.experts.parameters()]
    expert_ids = {id(p) for p in experts}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    optimizer = ZeRO1([{"params": dense}, {"params": experts, "process_group": expert_dp[rank % 2]}], lr=1e-3)
    tokens = torch.randint(0, config.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(rank))
    model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    optimizer.step()
    return sum(p.numel() for p in dense), sum(p.numel() for p in experts), optimizer.state_bytes()["total"]


def test_parameter_and_optimizer_bytes_per_rank_match_zero1():
    plan = make_plan(_tiny(), Machine(GPUS["h800"], GPUS_PER_NODE), timed=False).ranks[0]
    for dense, experts, optimizer in run_processes(_zero_worker, WORLD, timeout_s=180):
        assert (dense, experts) == (plan.dense_params, plan.expert_params)
        assert optimizer == pytest.approx(plan.states.optimizer, rel=0.01)
