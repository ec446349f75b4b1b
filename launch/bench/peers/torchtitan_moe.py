"""torchtitan's MoE module (torchtitan.models.common.moe.MoE) at the spec's shape, timed by fwdbwd.

Run by `moe-bench layer` with torchtitan's own interpreter (imports torch, torchtitan and fwdbwd only); `moe-bench
gpu` imports build() into its own process (one GPU: world 1), where torchtitan is installed beside this project.
Routing as ours: softmax scores, top-k, weights renormalised over the k, dropless, no balance loss or
expert bias. torchtitan's grouped experts compute in bf16 whatever the input dtype. EP > 1 runs its
all-to-all token dispatcher over gloo: parallel dims on the cpu device type, the partial-DTensor SPMD backend.
"""

from __future__ import annotations

from functools import partial
from importlib import metadata
from typing import Any

import torch


def load(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Our layout's weights into the MoE (w1 = gate, w3 = up, w2 = down), before any sharding."""
    experts = module.routed_experts.inner_experts
    gate, up = weights["w_gate_up"].chunk(2, dim=1)
    with torch.no_grad():
        for param, value in ((module.router.gate.weight, weights["router"]), (experts.w1_EFD, gate),
                             (experts.w3_EFD, up), (experts.w2_EDF, weights["w_down"])):
            param.copy_(value)


def build(spec: dict[str, Any], rank: int, world: int, weights: dict[str, torch.Tensor]):
    """(module, forward, info): the MoE holding `weights`, its forward on [batch, seq, hidden], what it runs."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import spmd_types as spmd  # torchtitan's own dependency
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.config_utils import make_routed_experts_config, make_router_config
    from torchtitan.models.common.moe import MoE
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    init = partial(torch.nn.init.normal_, std=0.02)
    experts = make_routed_experts_config(
        dim=spec["hidden"], hidden_dim=spec["ffn"], num_experts=spec["experts"], top_k=spec["top_k"],
        param_init={"w1_EFD": init, "w2_EDF": init, "w3_EFD": init}, comm_backend="standard")
    router = make_router_config(dim=spec["hidden"], num_experts=spec["experts"], gate_param_init={"weight": init},
                                top_k=spec["top_k"], score_func="softmax", route_norm=True)
    cfg = MoE.Config(num_experts=spec["experts"], routed_experts=experts, router=router, load_balance_coeff=None)
    if world > 1:
        parallel_dims.device_type = "cpu"  # torchtitan picks "cuda" when no accelerator is found
        set_spmd_backend("partial_dtensor")
        set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False, expert_param_layout={
            "w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)})  # its TP placements; EP shards dim 0
    module = cfg.build().to(getattr(torch, spec["dtype"]))
    module.init_states(buffer_device=torch.device("cpu"))
    load(module, weights)
    if world > 1:
        dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world,
                                          world_size=world, spmd_backend="partial_dtensor")
        module.parallelize(dims)
    w1 = module.routed_experts.inner_experts.w1_EFD
    local = w1.to_local() if hasattr(w1, "to_local") else w1
    info = {"local_experts": local.shape[0], "expert_dtype": "bfloat16",
            "library": f"torchtitan {metadata.version('torchtitan')}",
            "dispatcher": "all-to-all (AllToAllTokenDispatcher)" if world > 1 else "local (LocalTokenDispatcher)",
            "experts": "GroupedExperts, torch._grouped_mm in bf16"}
    return module, module, info


if __name__ == "__main__":
    from fwdbwd import peer_main  # a sibling script when run as one

    raise SystemExit(peer_main(build, "torchtitan"))
