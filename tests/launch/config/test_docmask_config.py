"""Run configs with data.document_mask (and model.vocab_multiple) that cannot run are refused by build_config, naming
the fields; those that can are accepted."""

from __future__ import annotations

import pytest

from launch.config.run import build_config


def raw(model: dict, parallel: dict, data: dict) -> dict:
    """A 4-layer model config with the given model, parallel and data fields."""
    return {"model": {"num_layers": 4, **model}, "train": {"grad_accum_steps": 8, "seq_len": 16},
            "parallel": parallel, "data": data}


@pytest.mark.parametrize("model, parallel, data, match", [
    ({}, {}, {"document_mask": "yes"}, r"data.document_mask = 'yes' must be of type bool"),
    ({}, {"cp": 2}, {"document_mask": True},
     r"data.document_mask = true does not run with parallel.cp = 2: set parallel.cp = 1 or data.document_mask = false"),
    ({"mtp_depth": 1}, {}, {"document_mask": True},
     r"data.document_mask = true does not run with model.mtp_depth = 1: set model.mtp_depth = 0"),
])
def test_bad_document_mask_configs_are_refused(model, parallel, data, match):
    with pytest.raises(ValueError, match=match):
        build_config(raw(model, parallel, data))


def test_document_mask_layouts_are_accepted():
    """Off by default; on with pipelines, TP and DP; CP and MTP each fine without it."""
    assert build_config(raw({}, {}, {})).data.document_mask is False
    for parallel in ({"pp": 2, "schedule": "dualpipev"}, {"tp": 2, "sequence_parallel": True}, {"dp": 2}):
        assert build_config(raw({}, parallel, {"document_mask": True})).data.document_mask
    build_config(raw({}, {"cp": 2}, {}))
    build_config(raw({"mtp_depth": 1}, {}, {}))


HEADS = {"num_heads": 6, "num_kv_heads": 3, "hidden_size": 96}  # heads that tp = 3 splits


@pytest.mark.parametrize("model, parallel, match", [
    ({"vocab_multiple": 0}, {}, r"\[model\] vocab_multiple = 0 must be an integer >= 1"),
    ({**HEADS, "vocab_size": 300, "vocab_multiple": 64}, {"tp": 3},
     r"model.vocab_size = 300 \(padded to 320 rows by model.vocab_multiple = 64\) is not divisible by parallel.tp = 3; "
     r"tp must be one of \[1, 2, 4, 5, 8, 10, 16, 20, 32, 40, 64, 80, 160, 320\], or set model.vocab_multiple to a "
     r"multiple of 3"),
])
def test_bad_vocab_padding_is_refused(model, parallel, match):
    with pytest.raises(ValueError, match=match):
        build_config(raw(model, parallel, {}))


def test_padded_vocab_decides_what_tp_divides():
    """301 ids do not split over tp = 2, padded to 320 they do; 300 ids padded to a multiple of 3 split over tp = 3."""
    with pytest.raises(ValueError, match=r"model.vocab_size = 301 is not divisible by parallel.tp = 2"):
        build_config(raw({"vocab_size": 301}, {"tp": 2}, {}))
    assert build_config(raw({"vocab_size": 301, "vocab_multiple": 64}, {"tp": 2}, {})).model.padded_vocab_size == 320
    three = raw({**HEADS, "vocab_size": 300, "vocab_multiple": 3, "dense_ffn_size": 96, "expert_ffn_size": 48},
                {"tp": 3}, {})
    three["train"]["seq_len"] = 24
    assert build_config(three).model.padded_vocab_size == 300
