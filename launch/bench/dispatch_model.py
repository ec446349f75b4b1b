"""Byte summaries, the link model (projected times) and the DeepSeek-V3-scale prediction of `moe-bench dispatch`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dispatch.dispatcher import PAYLOADS
from dispatch.predict import inter_node_copies, predict_traffic, received_rows
from dispatch.synthetic import synthetic_routing
from dispatch.topology import BACKENDS, make_topology
from dispatch.traffic import Traffic

V3 = {"world": 64, "gpus_per_node": 8, "experts": 256, "top_k": 8, "num_groups": 8, "topk_groups": 4}
BYTE_PARTS = ("inter_payload", "inter_meta", "intra_payload", "intra_meta")


@dataclass(frozen=True)
class LinkModel:
    """Per-rank link speeds of a real cluster: inter-node (e.g. IB ~50 GB/s) and intra-node (NVLink ~160 GB/s)."""

    inter_gbps: float
    intra_gbps: float

    def rank_ms(self, traffic: Traffic, backend: str) -> float:
        """Link-only ms of one rank's sends: hierarchical hops in sequence, one all-to-all's two links at once."""
        inter = traffic.inter_node / (self.inter_gbps * 1e9)
        intra = traffic.intra_node / (self.intra_gbps * 1e9)
        return 1e3 * (inter + intra if backend == "hierarchical" else max(inter, intra))

    def ms(self, per_rank: list[Traffic], backend: str) -> float:
        """Projected ms of a call: its slowest rank."""
        return max(self.rank_ms(t, backend) for t in per_rank)


def summed(per_rank: list[Traffic]) -> Traffic:
    """Traffic of all ranks together."""
    return sum(per_rank, Traffic())


def byte_fields(per_rank: list[Traffic], tokens: int, prefix: str = "") -> dict[str, float]:
    """Summed node totals and parts of one call, and the same per token (tokens = all ranks' tokens)."""
    total = summed(per_rank).as_dict()
    fields = {f"{prefix}{part}_bytes": total[part] for part in ("inter_node", "intra_node", *BYTE_PARTS)}
    return {**fields, **{f"{name}_per_token": value / tokens for name, value in fields.items()}}


def moved_bytes(indices_per_rank: list[torch.Tensor], num_experts: int, hidden: int) -> float:
    """DeepEP's algbw numerator, averaged over ranks: received token rows x hidden x 2 bytes (BF16)."""
    rows = received_rows(indices_per_rank, num_experts, len(indices_per_rank))
    return sum(rows) * hidden * 2 / len(rows)


def projected_fields(per_kind: dict[str, list[Traffic]], backend: str, link: LinkModel | None,
                     moved_bytes: float) -> dict[str, float]:
    """projected_{dispatch,combine}_ms and projected_algbw_gbps under the link model (empty without one)."""
    if link is None:
        return {}
    out = {f"projected_{kind}_ms": link.ms(per_rank, backend) for kind, per_rank in per_kind.items()}
    out["projected_algbw_gbps"] = moved_bytes / 1e6 / out["projected_dispatch_ms"]
    return out


def predict_v3(tokens: int, hidden: int, link: LinkModel | None, seed: int = 0) -> list[dict[str, Any]]:
    """Predicted rows (no communication) at DeepSeek-V3 scale: 64 ranks on 8 nodes, 256 experts, top-8, 4 nodes."""
    topology = make_topology(V3["world"], V3["gpus_per_node"])
    indices = [synthetic_routing(tokens, V3["experts"], V3["top_k"], "node-limited", num_groups=V3["num_groups"],
                                 topk_groups=V3["topk_groups"], generator=torch.Generator().manual_seed(seed + r))[0]
               for r in range(V3["world"])]
    moved, rows = moved_bytes(indices, V3["experts"], hidden), []
    for backend in BACKENDS:
        copies = torch.cat([inter_node_copies(ids, r, V3["experts"], topology, backend)
                            for r, ids in enumerate(indices)])
        for payload in PAYLOADS:
            traffic = predict_traffic(indices, V3["experts"], topology, hidden, backend, payload)
            per_kind = {kind: [t[kind] for t in traffic] for kind in ("dispatch", "combine")}
            rows.append({"section": "predicted_v3", "backend": backend, "payload": payload, "tokens": tokens,
                         "hidden": hidden, **V3, **byte_fields(per_kind["dispatch"], tokens * V3["world"]),
                         "max_inter_node_copies": int(copies.max()),
                         "mean_inter_node_copies": float(copies.float().mean()),
                         **projected_fields(per_kind, backend, link, moved)})
    return rows
