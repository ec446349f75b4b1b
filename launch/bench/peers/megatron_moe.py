"""Megatron-Core's MoELayer (megatron.core.transformer.moe.moe_layer) at the spec's shape, timed by fwdbwd.

Run by `moe-bench layer` with Megatron-Core's own interpreter (Python >= 3.12; imports torch, megatron.core
and fwdbwd only). Routing as ours: softmax over the top-k logits (= softmax, top-k, renormalised), dropless,
no balance loss. Experts are its SequentialMLP (one SwiGLU MLP per local expert: grouped GEMMs need
Transformer Engine on a GPU) behind its all-to-all token dispatcher (EP over gloo). Megatron-Core calls
torch.cuda (side streams, events, current_device) while building and running the layer; on a machine
without CUDA those calls are redirected to no-op streams and the cpu device, which runs the same math.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from importlib import metadata
from typing import Any

import torch
import torch.nn.functional as F

from fwdbwd import peer_main


class _NoStream:
    """Stands in for a CUDA stream or event on a machine without CUDA: every wait and record is a no-op."""

    def wait_stream(self, other: Any) -> None:
        """No-op."""

    def wait_event(self, event: Any) -> None:
        """No-op."""

    def record_event(self, event: Any = None) -> _NoStream:
        """No-op; returns an event stand-in."""
        return self

    def record(self, stream: Any = None) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""


def redirect_cuda() -> None:
    """Point the torch.cuda calls Megatron-Core makes at no-op streams and the cpu device (CPU machines only)."""
    none = _NoStream()
    torch.cuda.Stream = lambda *args, **kwargs: none
    torch.cuda.Event = lambda *args, **kwargs: none
    torch.cuda.current_stream = lambda *args, **kwargs: none
    torch.cuda.stream = lambda stream: nullcontext()
    torch.cuda.current_device = lambda: torch.device("cpu")


def host_splits_as_on_gpu(dispatcher_module: Any) -> None:
    """Its all-to-all dispatcher moves split sizes to the host as numpy arrays, but only from a CUDA tensor;
    on CPU they stay tensors, which gloo's all_to_all_single refuses: convert them as the GPU path does."""
    move = dispatcher_module.maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)
    dispatcher_module.maybe_move_tensor_to_cpu = to_host


def load(layer: torch.nn.Module, weights: dict[str, torch.Tensor], rank: int) -> None:
    """Our layout's weights into the layer: the router's, and this rank's experts' fc1 (gate rows first, as its
    gated linear unit splits them) and fc2."""
    local = layer.experts.local_experts
    first = rank * len(local)
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        for i, mlp in enumerate(local):
            mlp.linear_fc1.weight.copy_(weights["w_gate_up"][first + i])
            mlp.linear_fc2.weight.copy_(weights["w_down"][first + i])


def build(spec: dict[str, Any], rank: int, world: int, weights: dict[str, torch.Tensor]):
    """(module, forward, info): the MoELayer holding `weights`, its forward on [batch, seq, hidden], what it runs."""
    cpu = not torch.cuda.is_available()
    if cpu:
        redirect_cuda()
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if cpu:
        host_splits_as_on_gpu(token_dispatcher)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    dtype = getattr(torch, spec["dtype"])
    cfg = TransformerConfig(
        num_layers=1, hidden_size=spec["hidden"], num_attention_heads=1, ffn_hidden_size=spec["ffn"],
        num_moe_experts=spec["experts"], moe_router_topk=spec["top_k"], moe_ffn_hidden_size=spec["ffn"],
        moe_router_score_function="softmax", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=world, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, init_method_std=0.02)
    layer = get_moe_module_spec(use_te=False, num_experts=spec["experts"], moe_grouped_gemm=False)(config=cfg)
    layer.to(dtype)
    load(layer, weights, rank)

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = layer(x.transpose(0, 1).contiguous())  # its activations are [seq, batch, hidden] (one copy of x)
        return (out[0] if isinstance(out, tuple) else out).transpose(0, 1)

    info = {"local_experts": len(layer.experts.local_experts),
            "library": f"megatron-core {metadata.version('megatron-core')}",
            "dispatcher": "all-to-all (MoEAlltoAllTokenDispatcher)", "experts": "SequentialMLP, one MLP per expert"}
    return layer, forward, info


if __name__ == "__main__":
    raise SystemExit(peer_main(build, "megatron"))
