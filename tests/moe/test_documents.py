"""Document masking: ids, positions, mask and loss labels by hand; a packed row equals its documents run alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe.config import ModelConfig
from moe.documents import document_attention_mask, document_ids, document_labels, document_positions
from moe.model import MoETransformer
from moe.mtp import IGNORE

EOS = 0


def test_ids_positions_labels_by_hand():
    tokens = torch.tensor([[5, 6, 0, 7, 0, 0, 8, 9], [0, 3, 4, 5, 6, 7, 8, 0]])
    ids = document_ids(tokens, EOS)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    labels = torch.arange(1, 17).view(2, 8)
    assert document_labels(labels, tokens, EOS).tolist() == [
        [1, 2, IGNORE, 4, IGNORE, IGNORE, 7, 8], [IGNORE, 10, 11, 12, 13, 14, 15, IGNORE]]


def test_attention_mask_by_hand():
    mask = document_attention_mask(torch.tensor([[0, 0, 1, 1, 2]]))
    expected = [[1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [0, 0, 1, 0, 0],
                [0, 0, 1, 1, 0],
                [0, 0, 0, 0, 1]]
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == expected


def model_of(attention: str) -> MoETransformer:
    """A float64 two-layer model (one dense, one dropless MoE layer) of GQA or MLA attention."""
    torch.manual_seed(0)
    widths = (dict(attention="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                   v_head_dim=8) if attention == "mla" else {})
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, max_seq_len=16,
                      dense_ffn_size=48, num_experts=4, expert_ffn_size=16, top_k=2, score_func="sigmoid", **widths)
    return MoETransformer(cfg).double()


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_packed_documents_equal_documents_alone(attention):
    """Document A (5 tokens and its EOS) and document B (6 tokens) packed in one row of 12: every logit equals the
    logit of the document run alone (positions restart at B), and the loss is the two documents' token-weighted
    mean without the term predicting B's first token from A's EOS."""
    model = model_of(attention)
    stream = torch.randint(1, 64, (1, 13), generator=torch.Generator().manual_seed(3))
    stream[0, 5] = EOS
    tokens, labels = stream[:, :12], stream[:, 1:]
    ids = document_ids(tokens, EOS)
    packed = model(tokens, document_labels(labels, tokens, EOS), documents=ids)
    alone_a, alone_b = model(stream[:, :6]).logits, model(stream[:, 6:12]).logits
    torch.testing.assert_close(packed.logits[:, :6], alone_a, rtol=0, atol=1e-12)
    torch.testing.assert_close(packed.logits[:, 6:], alone_b, rtol=0, atol=1e-12)
    loss_a = F.cross_entropy(alone_a[0, :5], stream[0, 1:6])
    loss_b = F.cross_entropy(alone_b[0], stream[0, 7:13])
    torch.testing.assert_close(packed.lm_loss, (5 * loss_a + 6 * loss_b) / 11, rtol=0, atol=1e-12)
    unmasked = model(tokens, labels).logits
    assert (unmasked[:, 6:] - alone_b).abs().max() > 1e-3  # the mask matters: without it B sees A


def test_mtp_refused_with_documents():
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                       max_seq_len=16, dense_ffn_size=48, num_experts=4, expert_ffn_size=16,
                                       mtp_depth=1))
    tokens = torch.ones(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="mtp_depth"):
        model(tokens, tokens, documents=document_ids(tokens, EOS))
