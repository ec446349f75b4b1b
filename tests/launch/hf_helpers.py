"""Helpers of the Hugging Face tests: a small V3-shaped model config, ours and transformers' logits and routing."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from launch.config.run import RunConfig, build_config
from launch.checkpoint.hf.load import fill_from_hub
from launch.train.loop import train
from moe.config import ModelConfig
from moe.model import MoETransformer
from moe.router import TopKRouter
from tests.launch.train.test_equivalence import ATTENTION, raw_config

# MLA, 1 dense + 3 MoE layers, 2 expert groups of 4 (1 chosen), a shared expert, routed_scaling_factor 2.5
MODEL = {"vocab_size": 256, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "max_seq_len": 16, "first_k_dense": 1,
         "dense_ffn_size": 48, "num_experts": 8, "expert_ffn_size": 16, "top_k": 2, "num_shared_experts": 1,
         "score_func": "sigmoid", "num_groups": 2, "topk_groups": 1, "route_scale": 2.5, **ATTENTION["mla"]}


class Float64Torch:
    """torch, except that torch.float32 is float64: in transformers' DeepSeek-V3 module its float32 upcasts
    (RMSNorm, router, attention softmax) then compute in float64. Its RoPE tables stay float32 (`.float()`), as ours."""

    float32 = torch.float64

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


def hub_in_float64(monkeypatch) -> None:
    """Patch transformers' DeepSeek-V3 to compute in float64 where it upcasts to float32; its combine weights are
    rounded to float32 as our dispatchers carry them (moe.router)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

    monkeypatch.setattr(modeling, "torch", Float64Torch())
    route = modeling.DeepseekV3TopkRouter.forward

    def rounded(self, hidden_states):
        logits, weights, indices = route(self, hidden_states)
        return logits, weights.float().to(weights.dtype), indices

    monkeypatch.setattr(modeling.DeepseekV3TopkRouter, "forward", rounded)


def tokens(cfg: ModelConfig, seed: int = 0) -> Tensor:
    """Two random sequences of max_seq_len token ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(cfg.vocab_size, (2, cfg.max_seq_len), generator=generator)


def _record_choices(model: nn.Module, kind: type, pick) -> list[Tensor]:
    """Hooks appending each call's sorted top-k expert ids (pick(output)) of every `kind` module of model."""
    choices: list[Tensor] = []
    for module in model.modules():
        if isinstance(module, kind):
            module.register_forward_hook(lambda m, args, out: choices.append(pick(out).sort(-1).values))
    return choices


@torch.no_grad()
def our_logits(model: MoETransformer, ids: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Our logits [B, S, vocab] and each MoE layer's top-k choices [B*S, k] (sorted)."""
    choices = _record_choices(model, TopKRouter, lambda out: out.indices)
    return model(ids).logits, choices


@torch.no_grad()
def hub_logits(model: nn.Module, ids: Tensor) -> tuple[Tensor, list[Tensor]]:
    """transformers' logits and each MoE layer's top-k choices, as our_logits."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    choices = _record_choices(model, DeepseekV3TopkRouter, lambda out: out[2])
    return model(ids).logits, choices


def load_hub(folder: Path, dtype: torch.dtype) -> nn.Module:
    """transformers' DeepseekV3ForCausalLM from folder, eager attention and experts (the reference loops), in dtype."""
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM.from_pretrained(str(folder), attn_implementation="eager",
                                                 experts_implementation="eager", dtype=dtype).eval()


def ours_from_hub(cfg: ModelConfig, folder: Path, dtype: torch.dtype) -> MoETransformer:
    """Our single-process model with model.init_from = folder's weights, in dtype."""
    cfg = ModelConfig(**{**cfg.__dict__, "init_from": str(folder)})
    with torch.device("meta"):
        model = MoETransformer(cfg).to(dtype)
    model.to_empty(device="cpu")
    fill_from_hub(model, cfg, seed=0)
    return model.eval()


def trained_run(tmp: Path, attention: str = "mla", steps: int = 1, **model) -> tuple[RunConfig, Path]:
    """A float64 run of the V3-shaped MODEL (attention "mla"; "gqa": raw_config's GQA model) with MTP depth 1 and
    model overrides, trained `steps` steps with a checkpoint at the last; (config, its checkpoint root)."""
    corpus = tmp / "text.txt"
    corpus.write_text("".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(800)))
    raw = raw_config(str(tmp / "run"), str(corpus), {}, None, attention, mtp_depth=1)
    if attention == "mla":
        raw["model"].update(MODEL)
    raw["model"].update(model)
    raw["train"].update(steps=steps, checkpoint_every=steps, grad_accum_steps=1)
    cfg = build_config(raw)
    train(cfg, progress=False)
    return cfg, tmp / "run" / "checkpoint"
