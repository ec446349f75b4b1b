"""Tensor and sequence parallelism: differentiable TP collectives, in-place shard conversion, vocab-parallel loss."""

from moe.tp.comm import TPRegion, gather_sequence, scatter_sequence
from moe.tp.convert import (TensorParallelRouter, concurrent_backward, parallelize_attention, parallelize_block,
                            parallelize_mla, parallelize_moe, parallelize_swiglu)
from moe.tp.layout import (TPSpec, check_tp_group, check_tp_shapes, full_state_dict, gather_full,
                          tp_replicated_params)
from moe.tp.vocab import (VocabParallelEmbedding, parallelize_embedding, parallelize_head,
                          vocab_parallel_cross_entropy)

__all__ = ["TPRegion", "TPSpec", "TensorParallelRouter", "VocabParallelEmbedding", "check_tp_group", "check_tp_shapes",
           "concurrent_backward", "full_state_dict", "gather_full", "gather_sequence", "parallelize_attention",
           "parallelize_block", "parallelize_embedding", "parallelize_head", "parallelize_mla", "parallelize_moe",
           "parallelize_swiglu", "scatter_sequence", "tp_replicated_params", "vocab_parallel_cross_entropy"]
