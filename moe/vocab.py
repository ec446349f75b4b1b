"""Vocab padding (model.vocab_multiple): the embedding and LM head hold ModelConfig.padded_vocab_size rows (vocab_size
rounded up to a multiple of vocab_multiple, whatever the layout), the padded logits are masked to -inf, so no padded id
is ever predicted and the loss equals the unpadded model's.

The padded rows are ordinary rows of `embed.weight` and `lm_head.weight` in checkpoints and consolidated state dicts
(their shape is [padded_vocab_size, hidden]); no token ever looks one up and its logits get no gradient, so an
export to a vocab_size-row model keeps the first vocab_size rows.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.tp import TPRegion


def mask_padded_vocab(logits: Tensor, vocab_size: int, tp: TPRegion | None = None) -> Tensor:
    """logits [..., V] over the padded vocab (under TP: this rank's block of V/tp ids) with ids >= vocab_size at -inf;
    logits without padded ids are returned as they are."""
    width = logits.shape[-1]
    start = 0 if tp is None else tp.rank * width
    if start + width <= vocab_size:
        return logits
    ids = torch.arange(start, start + width, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


def head_logits(lm_head: nn.Linear, h: Tensor, vocab_size: int, tp: TPRegion | None = None) -> Tensor:
    """The LM head on normed hidden states h (under TP first entered into the region: its vocab block of the whole
    sequence), padded ids masked (mask_padded_vocab)."""
    return mask_padded_vocab(lm_head(h if tp is None else tp.enter(h)), vocab_size, tp)
