"""Document masking for packed sequences (data.document_mask): attention, positions and loss stay inside documents.

Rows of packed data hold documents each followed by the tokenizer's EOS. As Megatron's reset_attention_mask,
reset_position_ids and eod_mask_loss together: an EOS closes its document (it attends to and is seen by that
document's tokens only), the token after it starts a new document at position 0, and the loss term at an EOS
input (whose label is the next document's first token) is dropped; the EOS itself stays a target, so the model
still learns where documents end. Everything is computed on the device from the micro-batch's tokens (no host sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe.mtp import IGNORE


def document_ids(tokens: Tensor, eos: int) -> Tensor:
    """tokens [B, S] -> document index of every position [B, S] int64: the EOS tokens strictly before it."""
    ends = (tokens == eos).long()
    return ends.cumsum(1) - ends


def document_labels(labels: Tensor, tokens: Tensor, eos: int) -> Tensor:
    """labels [B, S] with IGNORE where the input token is EOS (the label there begins another document)."""
    return labels.masked_fill(tokens == eos, IGNORE)


def document_positions(ids: Tensor) -> Tensor:
    """Position of every token inside its document [B, S] int64, from document_ids."""
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(1).values


def document_attention_mask(ids: Tensor) -> Tensor:
    """Block-diagonal causal mask [B, 1, S, S] bool from document_ids: query i attends key j when j <= i and both lie
    in one document (True: attend; scaled_dot_product_attention's boolean attn_mask)."""
    seq = ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
    return ((ids.unsqueeze(2) == ids.unsqueeze(1)) & causal).unsqueeze(1)
