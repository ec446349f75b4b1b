"""MLA (moe.mla) against Hugging Face transformers' DeepseekV3Attention with the same random weights.

Both run in float64 on the same input; HF's float32 upcasts (its RMSNorm and the eager softmax) are patched
to compute in the input's dtype, so outputs, input grads and weight grads agree to float64 rounding. Both
build RoPE tables in float32 (HF's rotary embedding and moe.rope alike) and cast them to float64, so those
are equal unpatched. HF's rope_interleave=True is DeepSeek's layout: a model with the other layout must
differ, which shows the comparison sees the convention.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # the `test` extra pins transformers

from moe.config import ModelConfig
from moe.mla import MLA
from moe.rope import rope_tables

BATCH, SEQ, HIDDEN, HEADS = 2, 12, 32, 4
DIMS = dict(kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
HF_NAMES = {"q_proj": "q", "q_a_proj": "q_a", "q_a_layernorm": "q_a_norm", "q_b_proj": "q_b",
            "kv_a_proj_with_mqa": "kv_a", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "kv_b", "o_proj": "out"}


def ours(q_lora_rank: int) -> MLA:
    """Our MLA in float64 with O(1) random weights (norm scales too, so a misplaced one shows)."""
    cfg = ModelConfig(hidden_size=HIDDEN, num_heads=HEADS, max_seq_len=SEQ, attention="mla",
                      q_lora_rank=q_lora_rank, init_std=0.3, **DIMS)
    torch.manual_seed(0)
    attn = MLA(cfg, out_std=0.3).double()
    with torch.no_grad():
        for name, param in attn.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return attn


def theirs(attn: MLA, q_lora_rank: int, interleave: bool = True) -> torch.nn.Module:
    """HF's DeepseekV3Attention in float64 holding attn's weights (copied by name)."""
    config = hf.DeepseekV3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                 q_lora_rank=q_lora_rank or None, max_position_embeddings=SEQ,
                                 rope_interleave=interleave, **DIMS)
    config._attn_implementation = "eager"
    module = hf.DeepseekV3Attention(config, layer_idx=0).double()
    ours_by_name = dict(attn.named_parameters())
    with torch.no_grad():
        for name, param in module.named_parameters():
            mine = ours_by_name[f"{HF_NAMES[name.split('.')[0]]}.weight"]
            assert param.shape == mine.shape, name
            param.copy_(mine)
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in attn.parameters())
    return module


def hf_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF attention over causal x [B, S, H], its RoPE tables from its own rotary embedding."""
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    cos, sin = hf.DeepseekV3RotaryEmbedding(module.config)(x, positions)
    mask = torch.full((SEQ, SEQ), float("-inf"), dtype=x.dtype).triu(1).expand(BATCH, 1, SEQ, SEQ)
    return module(x, (cos, sin), mask)[0]


@pytest.fixture
def float64_hf(monkeypatch):
    """HF's RMSNorm and eager softmax computing in the input's dtype instead of float32."""
    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    softmax = torch.nn.functional.softmax

    def softmax_in_input_dtype(x, dim=None, dtype=None, **kwargs):
        return softmax(x, dim=dim, **kwargs)

    monkeypatch.setattr(hf.DeepseekV3RMSNorm, "forward", norm)
    monkeypatch.setattr(torch.nn.functional, "softmax", softmax_in_input_dtype)


def run_both(q_lora_rank: int, interleave: bool = True):
    """(our output, HF's, grads of ours by our names, HF's by our names, input grads)."""
    attn = ours(q_lora_rank)
    module = theirs(attn, q_lora_rank, interleave)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    cos, sin = rope_tables(SEQ, attn.rope_dim, 10000.0)
    out, ref = attn(xa, cos, sin), hf_forward(module, xb)
    weights = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    grads = {name: p.grad for name, p in attn.named_parameters()}
    ref_grads = {f"{HF_NAMES[name.split('.')[0]]}.weight": p.grad for name, p in module.named_parameters()}
    return out, ref, grads, ref_grads, (xa.grad, xb.grad)


@pytest.mark.parametrize("q_lora_rank", [16, 0], ids=["v3 query latent", "plain query (v2-lite)"])
def test_mla_equals_hf_deepseek_v3_attention_in_float64(float64_hf, q_lora_rank):
    out, ref, grads, ref_grads, (dx, ref_dx) = run_both(q_lora_rank)
    assert ref.abs().mean() > 0.1  # O(1) outputs: the comparison is not of near-zeros
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-10, atol=1e-12)
    assert set(grads) == set(ref_grads) and len(grads) == (7 if q_lora_rank else 5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_the_comparison_sees_the_rope_layout(float64_hf):
    out, ref, *_ = run_both(16, interleave=False)
    assert (out - ref).abs().max() > 1e-3


def test_unpatched_hf_agrees_to_float32_rounding():
    """HF as shipped (float32 RMSNorm and softmax inside a float64 model): equal to float32 rounding."""
    out, ref, *_ = run_both(16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
