"""Initial values of the single-process model's tensors, each drawn from a seed derived from its name.

A tensor's values depend only on the run's seed, its single-process name and (for routed experts) its
global expert id, so a rank of any layout can draw exactly the pieces it holds, without building the
rest of the model, and every layout starts from the single-process weights. The rules are those of the
modules' own constructors: normal(init_std) for input projections (GQA's qkv, MLA's down- and
up-projections, MTP's eh_proj), embeddings, routers and the LM head, normal(init_std / sqrt(2 * num_layers)) for the
projections back into the residual stream, ones for RMSNorm weights (MLA's latent norms too) and zeros
for the routers' expert biases.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor

from moe.config import ModelConfig

ONES = ("norm.weight",)
ZEROS = ("router.expert_bias",)
NONE = ("replica_placement",)  # redundant experts' placement (moe.replicas): every spare slot empty (-1)
RESIDUAL_OUT = ("attn.out.weight", "ffn.down.weight", "shared.down.weight", "experts.w_down")
INPUT_SIDE = ("embed.weight", "attn.qkv.weight", "attn.q.weight", "attn.q_a.weight", "attn.q_b.weight",
              "attn.kv_a.weight", "attn.kv_b.weight", "gate_up.weight", "router.weight", "experts.w_gate_up",
              "lm_head.weight", "eh_proj.weight")


def init_rule(cfg: ModelConfig, name: str) -> tuple[str, float]:
    """("normal", std), ("ones", 1), ("zeros", 0) or ("full", -1) for the single-process tensor name (no expert
    suffix)."""
    if name.endswith(NONE):
        return "full", -1.0
    if name.endswith(ONES):
        return "ones", 1.0
    if name.endswith(ZEROS):
        return "zeros", 0.0
    if name.endswith(RESIDUAL_OUT):
        return "normal", cfg.init_std / math.sqrt(2 * cfg.num_layers)
    if name.endswith(INPUT_SIDE):
        return "normal", cfg.init_std
    raise ValueError(f"no initialisation rule for model tensor {name!r}: add one to moe.init")


def tensor_seed(seed: int, key: str) -> int:
    """A 63-bit seed for the tensor key (its single-process name, '.E' appended for expert E) of run seed."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(cfg: ModelConfig, name: str, key: str, shape: tuple[int, ...], seed: int,
                  device: torch.device) -> Tensor:
    """Float32 initial value of tensor key (rule of name: key without an expert id) drawn on device.

    Draws on one device type give the same values in any layout; CPU and CUDA draws differ."""
    kind, std = init_rule(cfg, name)
    if kind == "ones":
        return torch.ones(shape, device=device)
    if kind == "zeros":
        return torch.zeros(shape, device=device)
    if kind == "full":
        return torch.full(shape, std, device=device)
    generator = torch.Generator(device=device).manual_seed(tensor_seed(seed, key))
    return torch.randn(shape, generator=generator, device=device).mul_(std)
