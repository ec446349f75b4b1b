"""Bytes per rank on each link class: EP dispatch/combine (from dispatch.predict), PP p2p, DP, TP and CP collectives."""

from __future__ import annotations

import functools
from dataclasses import astuple, dataclass

import torch
from torch import Tensor

from dispatch import Topology, Traffic, make_topology
from dispatch.layout import expert_owner, lookup, membership
from dispatch.predict import inter_node_copies, payload_row_bytes, predict_traffic
from dispatch.synthetic import synthetic_routing
from launch.metrics.flops import AttentionShape
from moe.config import ModelConfig

WEIGHT_GRAD_BYTES = 4  # dispatch's backward returns one fp32 routing-weight grad per slot and row


def _rows(traffic: Traffic, row_bytes: int) -> tuple[int, int]:
    """(intra-node, inter-node) rows a payload count stands for."""
    return traffic.intra_payload // row_bytes, traffic.inter_payload // row_bytes


def moe_layer_traffic(indices_per_rank: list[Tensor], num_experts: int, topology: Topology, hidden: int,
                      backend: str = "flat", payload: str = "bf16", dtype: torch.dtype = torch.bfloat16,
                      weights_grad: bool = True, chunks: int = 1) -> list[dict[str, Traffic]]:
    """Per rank, what EPDispatcher counts for one MoE layer's forward and backward on this routing:
    "dispatch", "combine", "combine_backward" (grads out along the dispatch route, in dtype) and
    "dispatch_backward" (grads back along the combine route, plus fp32 routing-weight grads);
    chunks: the dispatch's (parallel.dispatch_chunks)."""
    top_k = indices_per_rank[0].shape[1]
    forward = predict_traffic(indices_per_rank, num_experts, topology, hidden, backend, payload, dtype, chunks)
    row = hidden * dtype.itemsize
    out = []
    for rank in forward:
        intra, inter = _rows(rank["combine"], row)
        back_row = row + (top_k * WEIGHT_GRAD_BYTES if weights_grad else 0)
        sent_intra, sent_inter = _rows(rank["dispatch"], payload_row_bytes(hidden, payload, dtype))
        out.append({**rank,
                    "combine_backward": Traffic(intra_payload=sent_intra * row, inter_payload=sent_inter * row),
                    "dispatch_backward": Traffic(intra_payload=intra * back_row, inter_payload=inter * back_row)})
    return out


def total(traffic: dict[str, Traffic]) -> Traffic:
    """Sum of the kinds of one rank's traffic."""
    return sum(traffic.values(), Traffic())


def synthetic_indices(cfg: ModelConfig, tokens: int, seed: int = 0) -> Tensor:
    """A [tokens, top_k] routing following cfg's group limit (uniform affinities otherwise)."""
    kind = "node-limited" if cfg.num_groups > 1 else "uniform"
    return synthetic_routing(tokens, cfg.num_experts, cfg.top_k, kind, num_groups=cfg.num_groups,
                             topk_groups=cfg.topk_groups, generator=torch.Generator().manual_seed(seed))[0]


def _summed(traffic: list[dict[str, Traffic]]) -> dict[str, Traffic]:
    return {kind: sum((rank[kind] for rank in traffic), Traffic()) for kind in traffic[0]}


def _scaled(traffic: Traffic, factor: float) -> Traffic:
    return Traffic(*(round(v * factor) for v in (traffic.intra_payload, traffic.inter_payload,
                                                  traffic.intra_meta, traffic.inter_meta)))


def expected_layer_traffic(indices: Tensor, num_experts: int, topology: Topology, hidden: int, tokens: int,
                           backend: str, payload: str, dtype: torch.dtype) -> dict[str, Traffic]:
    """One rank's traffic for one MoE layer when every rank routes like `indices` (scaled to `tokens`):
    all the bytes rank 0's rows cause on every rank (relays included), plus one rank's count exchange.
    Only rank 0 gets tokens, so dispatch.predict runs in time linear in the sample."""
    idle = [indices[:0]] * topology.world_size
    counts = moe_layer_traffic(idle, num_experts, topology, hidden, backend, payload, dtype)
    caused = _summed(moe_layer_traffic([indices] + idle[1:], num_experts, topology, hidden, backend, payload,
                                       dtype))
    base = _summed(counts)
    factor = tokens / indices.shape[0]
    return {kind: _scaled(Traffic(*(a - b for a, b in zip(astuple(caused[kind]), astuple(base[kind])))), factor)
            + counts[0][kind] for kind in caused}


@dataclass(frozen=True)
class EPStats:
    """What one EP group does with a routing that follows the config's node limit."""

    ep: int
    nodes: int
    experts_per_gpu: int
    tokens_per_rank: int
    sampled_tokens: int
    nodes_per_token_max: int
    nodes_per_token_mean: float
    inter_copies_hierarchical: float  # mean inter-node copies of a token (once per other node)
    inter_copies_flat: float          # mean inter-node copies of a token (once per rank on another node)
    layer: dict[str, Traffic]         # one rank, one MoE layer forward + backward, by kind


@functools.lru_cache(maxsize=64)
def _ep_stats(num_experts: int, top_k: int, num_groups: int, topk_groups: int, hidden: int, ep: int, node: int,
              tokens: int, backend: str, payload: str, dtype: torch.dtype, sampled: int) -> EPStats:
    cfg = ModelConfig(num_experts=num_experts, top_k=top_k, num_groups=num_groups, topk_groups=topk_groups)
    topology = make_topology(ep, node)
    indices = synthetic_indices(cfg, sampled)
    layer = expected_layer_traffic(indices, num_experts, topology, hidden, tokens, backend, payload, dtype)
    owner_node = expert_owner(num_experts, ep) // node
    per_token = membership(lookup(indices, owner_node), topology.num_nodes).sum(1).float()
    copies = {b: inter_node_copies(indices, 0, num_experts, topology, b).float().mean().item()
              for b in ("hierarchical", "flat")}
    return EPStats(ep, topology.num_nodes, num_experts // ep, tokens, sampled, int(per_token.max()),
                   per_token.mean().item(), copies["hierarchical"], copies["flat"], layer)


def ep_stats(cfg: ModelConfig, ep: int, gpus_per_node: int, tokens: int, backend: str, payload: str,
             dtype: torch.dtype, sample_tokens: int = 1024) -> EPStats:
    """EP traffic and routing statistics of one MoE layer for `tokens` tokens per EP rank, from a
    routing of min(tokens, sample_tokens) tokens that follows cfg's node limit."""
    node = min(gpus_per_node or ep, ep)
    if ep % node:
        raise ValueError(f"parallel.ep = {ep} with {gpus_per_node} GPUs per node: an EP group must fill whole "
                         f"nodes or sit inside one (ep dividing gpus_per_node or a multiple of it)")
    return _ep_stats(cfg.num_experts, cfg.top_k, cfg.num_groups, cfg.topk_groups, cfg.hidden_size, ep, node,
                     tokens, backend, payload, dtype, min(tokens, sample_tokens))


def ring_bytes(numel: float, group: int, itemsize: float) -> float:
    """Bytes one rank sends in a ring reduce-scatter (or all-gather) of numel elements over group ranks."""
    return numel * itemsize * (group - 1) / group


def cp_kv_width(cfg: ModelConfig, attention: AttentionShape, tp: int) -> float:
    """K and V elements per token of one attention layer on one TP rank, as moe.cp holds and sends them: GQA's
    KV heads unexpanded (one per rank when they are fewer than the TP ranks), MLA's every head."""
    heads = attention.heads / tp if attention.kind == "mla" else max(cfg.num_kv_heads / tp, 1)
    return heads * (attention.qk_head_dim + attention.v_head_dim)


def cp_attention_bytes(kv_shard_bytes: float, cp: int, method: str) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends for one attention layer over a CP group of cp ranks, given its
    K/V shard's bytes (moe.cp's count): ring, cp - 1 K/V hops forward, cp - 1 K/V and cp dK/dV hops backward
    (3 cp - 2 shards); allgather (ring model), (cp - 1) shards each way."""
    if cp == 1:
        return 0.0, 0.0
    if method == "ring":
        return (cp - 1) * kv_shard_bytes, (2 * cp - 1) * kv_shard_bytes
    return (cp - 1) * kv_shard_bytes, (cp - 1) * kv_shard_bytes
