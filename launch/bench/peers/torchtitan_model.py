"""torchtitan's own Qwen3 MoE model (torchtitan.models.qwen3.Qwen3Model) at a config's shape, trained by a minimal
loop as torchtitan's trainer would run it on one GPU without FSDP: the peer of `moe-bench gpu`'s trainer rows.

torchtitan's own trainer does not run on an offline GPU node (its dataloader needs torchdata, datasets and more), so
its MODEL is built here and trained by `train`, a loop doing what its train_step does at world 1: fp32 parameters,
forward under torch.autocast(bf16) (torchtitan's mixed precision without FSDP), cross-entropy on next-token labels,
backward, grad-norm clip (cfg.train.grad_clip), AdamW (fused on CUDA, foreach elsewhere), zero_grad(set_to_none).
No torch.compile, no activation checkpointing (configs/gpu-1x.toml: train.recompute "none", eager).

Usage (one GPU, torchtitan 0.3.0 installed beside this project):

    from launch.bench.peers.torchtitan_model import measure
    result = measure(load_config("configs/gpu-1x.toml"), torch.device("cuda", 0), warmup=3, timed=5)
    result["tokens_per_s"], result["mfu"], result["peak_memory_gib"], result["params"], result["settings"]

What is built (build): the layers torchtitan's Qwen3-30B-A3B flavour builds (torchtitan.models.qwen3's own layer
builder and init: normal std 0.02, residual outputs 0.02 / sqrt(2 x layers), RMSNorm eps 1e-6, fused wqkv, untied
embedding and LM head) at cfg.model's shape. Attention: torchtitan 0.3.0's language-model backends are flex and
varlen, which take block-causal masks built from its dataloader's document positions ("sdpa" is refused by its
get_attention_config); its ScaledDotProductAttention module (F.scaled_dot_product_attention, is_causal=True, no mask)
is put in their place, so attention is plain causal over each sequence, as ours. MoE: softmax router, top-k weights
renormalised, dropless, no shared experts, experts as torch._grouped_mm in bf16 with device-side offsets (at world 1
its LocalTokenDispatcher: argsort, gather, scatter_add; no per-expert Python loop and no host sync).

Differences from our model, kept as torchtitan has them: Qwen3's QK-norm (an RMSNorm of head_dim
weights on the queries and one on the keys in every layer: 2 x head_dim x layers parameters ours lacks); router
losses: ours adds those cfg.model enables (gpu-1x: the Switch balance loss, aux_loss_coeff 0.001), torchtitan's Qwen3
adds none (its balancing is the aux-loss-free expert bias of MoE.load_balance_coeff, switched off here as ours is
with model.bias_update_rate = 0); ours keeps bf16 parameters with fp32 masters in its optimizer (train.dtype
bfloat16), this loop fp32 parameters under bf16 autocast; AdamW here decays every parameter (torchtitan's
default_adamw), ours only the matrices. Shapes our model has and torchtitan's Qwen3 cannot express (dense layers,
shared experts, sigmoid or group-limited routing, capacity, MTP, FP8, a padded vocab) are refused (check_shape).

Tokens: launch.plan.rehearse.RandomFeed(cfg, device), the very micro-batches the trainer rows train on (seed 0,
the same every step). MFU: launch.metrics.records.throughput_metrics with launch.metrics.flops.model_flops_per_token
(causal attention) over launch.metrics.records.mfu_peak, the functions our trainer's records use.

Memory at configs/gpu-1x.toml (estimated, not measured on a GPU): 3,114,814,464 parameters (ours 3,114,813,440 +
1,024 QK-norm weights; 2.42 G in the experts, 0.31 G each in the embedding and the LM head) make 11.6 GiB of fp32
weights, 11.6 of grads and 23.2 of AdamW moments (46.4 GiB); what one layer keeps for backward at 4096 tokens under
bf16 autocast, counted by saved-tensor hooks on the CPU, is about 1.07 GiB plus its weights' bf16 copies (1.13 GiB
at 128 experts), 4 layers about 9 GiB; the head about 3 GiB (bf16 LM-head copy and the fp32 log-softmax of 4096 x
151936 logits) and about 6 GiB transient in its backward: a peak of 55-65 GiB, inside an 80 GB GPU.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

import torch
import torch.nn.functional as F

from launch.bench.breakdown import profile_call
from launch.config.run import RunConfig
from launch.metrics.flops import model_flops_per_token
from launch.metrics.records import mfu_peak, throughput_metrics
from launch.plan.params import count_params
from launch.plan.rehearse import RandomFeed
from moe.config import ModelConfig

TITAN_NORM_EPS = 1e-6  # torchtitan.models.qwen3's RMSNorm epsilon, fixed by its layer builder
ADAMW_EPS = 1e-8  # torchtitan's default_adamw
SETTINGS = ("torch.compile off, activation checkpointing off, fp32 params + bf16 autocast, {adamw} AdamW, grad-norm "
            "clip, constant lr, plain causal SDPA")
# model keys torchtitan's Qwen3 MoE builder fixes: (key, the value it needs, what it builds)
FIXED_KEYS = (
    ("attention", "gqa", "grouped-query attention"),
    ("first_k_dense", 0, "an MoE FFN in every layer"),
    ("num_shared_experts", 0, "no shared experts"),
    ("score_func", "softmax", "a softmax router"),
    ("norm_topk", True, "top-k weights renormalised"),
    ("route_scale", 1.0, "unscaled combine weights"),
    ("num_groups", 1, "no group-limited routing"),
    ("capacity_factor", None, "dropless experts"),
    ("force_balance", False, "the router's own choice"),
    ("bias_update_rate", 0.0, "no aux-loss-free bias here (its optimizer hook is the trainer's)"),
    ("mtp_depth", 0, "no multi-token prediction"),
    ("expert_precision", "native", "bf16 experts"),
    ("linear_precision", "native", "bf16 linears"),
    ("activation_cache", "native", "autograd's own activations"),
    ("vocab_multiple", 1, "an unpadded vocab"),
    ("norm_eps", TITAN_NORM_EPS, "RMSNorm eps 1e-6"),
)


def check_shape(model: ModelConfig) -> None:
    """Raise ValueError naming the first model key whose value torchtitan's Qwen3 MoE cannot build."""
    for key, needed, what in FIXED_KEYS:
        if getattr(model, key) != needed:
            raise ValueError(f"model.{key} = {getattr(model, key)!r}: torchtitan's Qwen3 MoE builds {what}; "
                             f"allowed: {needed!r}")


def extra_params(model: ModelConfig) -> dict[str, int]:
    """Parameters torchtitan's Qwen3 has beyond ours at the same shape, by what holds them."""
    return {"qk_norm": 2 * model.attention_head_dim * model.num_layers}


def router_losses(model: ModelConfig) -> str:
    """The router losses each side adds to its loss (the module doc's differences)."""
    ours = [f"{name} {getattr(model, key):g}" for key, name in (
        ("aux_loss_coeff", "Switch balance"), ("seq_aux_loss_coeff", "sequence-wise balance"),
        ("z_loss_coeff", "z-loss")) if getattr(model, key)]
    return f"ours: {', '.join(ours) or 'none'}; torchtitan's Qwen3: none"


def model_config(cfg: RunConfig):
    """torchtitan's Qwen3Model.Config at cfg.model's shape, plain causal SDPA attention, no load-balance bias."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _EMBEDDING_INIT, _LINEAR_INIT, _qwen3_norm

    m = cfg.model
    check_shape(m)
    head = m.attention_head_dim
    layers = _build_qwen3_moe_layers(
        n_layers=m.num_layers, dim=m.hidden_size, n_heads=m.num_heads, n_kv_heads=m.num_kv_heads, head_dim=head,
        moe_hidden_dim=m.expert_ffn_size, num_experts=m.num_experts, top_k=m.top_k, fuse_qkv=True,
        attn_backend="flex", moe_comm_backend="standard",  # flex replaced below; "standard" is local at world 1
        rope=CosSinRoPE.Config(dim=head, max_seq_len=m.max_seq_len, theta=m.rope_theta))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.moe.load_balance_coeff = None
    return Qwen3Model.Config(
        vocab_size=m.vocab_size, dim=m.hidden_size, norm=_qwen3_norm(m.hidden_size), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=m.vocab_size, embedding_dim=m.hidden_size,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=m.hidden_size, out_features=m.vocab_size, param_init=_LINEAR_INIT))


def build(cfg: RunConfig, device: torch.device, seed: int) -> torch.nn.Module:
    """torchtitan's Qwen3 MoE at cfg.model's shape on device, fp32, initialised by its own init from seed (built on
    meta, then materialised and initialised on device, as its trainer does); the global RNG is left as it was."""
    config = model_config(cfg)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights(buffer_device=device)
    return model.train()


def step_timer(device: torch.device) -> tuple[Callable[[], Any], Callable[[list[tuple[Any, Any]]], list[float]]]:
    """(mark, seconds): mark() waits for the device and reads time.perf_counter, so each step is timed as our
    trainer times its steps (wall time to a step's end, where its one statistics copy waits for the device: the
    same clock for both contenders); seconds(pairs) the seconds between each (start, end) pair."""
    def mark() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return mark, lambda pairs: [end - start for start, end in pairs]


def param_counts(model: torch.nn.Module, cfg: RunConfig) -> dict[str, Any]:
    """Both models' parameter counts at cfg.model's shape: torchtitan's built model, ours by the planner
    (launch.plan.params.count_params), and torchtitan's extra parameters by what holds them."""
    return {"torchtitan": sum(p.numel() for p in model.parameters()),
            "ours": count_params(cfg.model).total.total, "torchtitan_extra": extra_params(cfg.model)}


def train(model: torch.nn.Module, cfg: RunConfig, device: torch.device, warmup: int, timed: int,
          feed: RandomFeed | None = None, profiled: bool = False) -> dict[str, Any]:
    """Train model for warmup + timed steps on feed's micro-batches (default RandomFeed(cfg, device), the trainer
    rows' tokens) and return the timed steps' figures: tokens/s and step time (medians), the steps' spread, MFU by our
    trainer's formula, peak memory (CUDA), the losses and both models' parameter counts. A step: for each micro-batch,
    forward under bf16 autocast and backward of its cross-entropy over the micro-batch count; grad-norm clip; AdamW
    at cfg.train.lr (constant); zero_grad(set_to_none). Each step ends waiting for the device (step_timer), as ours
    does at its statistics copy.
    profiled: one more step after them under torch.profiler, its time by kind of work (launch.bench.breakdown)."""
    if warmup < 0 or timed < 1:
        raise ValueError(f"warmup = {warmup} must be >= 0 and timed = {timed} >= 1")
    batches = (feed or RandomFeed(cfg, device)).next_step()
    tokens = sum(batch.inputs.numel() for batch in batches)
    train_cfg = cfg.train
    adamw = "fused" if device.type == "cuda" else "foreach"
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2),
                                  eps=ADAMW_EPS, weight_decay=train_cfg.weight_decay, **{adamw: True})
    mark, seconds = step_timer(device)
    pairs, losses = [], []

    def step() -> torch.Tensor:
        loss = torch.zeros((), device=device)
        for batch in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(batch.inputs)
            part = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten()) / len(batches)
            del logits  # as torchtitan's trainer: the bf16 logits are not held through backward
            part.backward()
            loss += part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup + timed):
        start = mark()
        losses.append(step())
        pairs.append((start, mark()))
    breakdown = profile_call(step, device) if profiled else None
    steps = seconds(pairs)[warmup:]
    median = statistics.median(steps)
    seq_len = batches[0].inputs.shape[1]
    peak = mfu_peak(cfg.model, seq_len, device, train_cfg.peak_tflops_per_gpu)
    figures = throughput_metrics(tokens, median, model_flops_per_token(cfg.model, seq_len), peak)
    losses = torch.stack(losses).tolist()
    return {**figures, "step_ms": 1e3 * median, "step_ms_spread": (max(steps) - min(steps)) / median,
            "repeats": len(steps), "tokens_per_step": tokens,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None,
            "losses": losses, "last_loss": losses[-1], "params": param_counts(model, cfg),
            "settings": SETTINGS.format(adamw=adamw), "breakdown": breakdown}


def measure(cfg: RunConfig, device: torch.device, warmup: int, timed: int) -> dict[str, Any]:
    """Build torchtitan's Qwen3 MoE at cfg's shape (seed cfg.train.seed) and train it (train, one more step
    profiled): the trainer-torchtitan row's figures, with what it runs and how it differs from ours."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build(cfg, device, cfg.train.seed)
    result = train(model, cfg, device, warmup, timed, profiled=True)
    if not all(math.isfinite(loss) for loss in result["losses"]):
        raise RuntimeError(f"torchtitan's Qwen3 MoE diverged: losses {result['losses']}")
    return {**result, "library": f"torchtitan {metadata.version('torchtitan')}",
            "model": "torchtitan.models.qwen3.Qwen3Model (its Qwen3-30B-A3B layer builder at cfg.model's shape)",
            "attention": "torchtitan's ScaledDotProductAttention, is_causal=True, no mask (plain causal)",
            "experts": "GroupedExperts, torch._grouped_mm in bf16, LocalTokenDispatcher (dropless)",
            "router_losses": router_losses(cfg.model)}
