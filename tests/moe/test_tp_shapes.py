"""check_tp_shapes: every shape TP/SP must split is refused with the field and the allowed values."""

from __future__ import annotations

import pytest

from moe.config import ModelConfig
from moe.tp import check_tp_shapes

BASE = dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, dense_ffn_size=48,
            num_experts=4, num_shared_experts=1, expert_ffn_size=16)

ACCEPTED = [  # (config overrides, seq_len, tp, sequence_parallel)
    ({}, 32, 1, False),
    ({}, 32, 2, True),
    ({}, 32, 4, True),                        # 2 KV heads replicated over 4 ranks
    ({}, 32, 8, True),
    ({"first_k_dense": 2}, 31, 2, False),     # dense only, no SP: any sequence length
    ({}, None, 4, True),                      # sequence not known yet
]

REFUSED = [  # (config overrides, seq_len, tp, sp, words the message must hold)
    ({}, 32, 3, False, ["model.num_heads = 8", "parallel.tp = 3", "[1, 2, 4, 8]"]),
    ({"num_kv_heads": 4, "num_heads": 12, "hidden_size": 96}, 32, 6,
     False, ["model.num_kv_heads = 4", "parallel.tp = 6", "[1, 2, 4]", "multiple of 4"]),
    ({"vocab_size": 66}, 32, 4, False, ["model.vocab_size = 66", "parallel.tp = 4", "[1, 2, 3, 6, 11, 22, 33, 66]"]),
    ({"dense_ffn_size": 50}, 32, 4, False, ["model.dense_ffn_size = 50", "[1, 2, 5, 10, 25, 50]"]),
    ({"expert_ffn_size": 18}, 32, 4, False, ["num_shared_experts * model.expert_ffn_size = 18"]),
    ({"first_k_dense": 2}, 30, 4, True, ["train.seq_len = 30", "parallel.tp = 4", "sequence_parallel"]),
    ({}, 30, 4, False, ["train.seq_len = 30", "MoE layers"]),
    ({}, 32, 0, False, ["parallel.tp = 0", ">= 1"]),
]


@pytest.mark.parametrize("overrides, seq_len, tp, sp", ACCEPTED)
def test_shapes_that_split_are_accepted(overrides, seq_len, tp, sp):
    check_tp_shapes(ModelConfig(**(BASE | overrides)), seq_len, tp, sp)


@pytest.mark.parametrize("overrides, seq_len, tp, sp, words", REFUSED)
def test_shapes_that_do_not_split_name_the_field_and_allowed_values(overrides, seq_len, tp, sp, words):
    with pytest.raises(ValueError) as err:
        check_tp_shapes(ModelConfig(**(BASE | overrides)), seq_len, tp, sp)
    for word in words:
        assert word in str(err.value)


def test_dense_ffn_width_is_not_checked_without_dense_layers():
    check_tp_shapes(ModelConfig(**(BASE | {"first_k_dense": 0, "dense_ffn_size": 50})), 32, 4, True)
