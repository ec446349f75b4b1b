"""Per-step metrics (schema in launch/dashboard/SCHEMA.md): expert load, traffic, throughput, per-rank figures; JSONL and TensorBoard writers."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from moe.config import ModelConfig

SCHEMA_VERSION = 2
"""Version of the record layout written by step_record (1: the flat expert_load_summary keys, no "schema")."""

PEAK_FLOPS = {
    "H100": {"bfloat16": 989e12, "fp8": 1979e12},
    "H800": {"bfloat16": 989e12, "fp8": 1979e12},
    "H200": {"bfloat16": 989e12, "fp8": 1979e12},
    "A100": {"bfloat16": 312e12},
    "A800": {"bfloat16": 312e12},
}
"""Dense peak FLOP/s per GPU by device-name fragment and math precision (vendor datasheets, SXM parts)."""


def expert_load_summary(tokens_per_expert: list[Tensor]) -> dict[str, list]:
    """Schema 1 per-layer keys: max/mean and min/mean load, dead experts, normalised load entropy."""
    stats = [load_statistics(load.detach().cpu().numpy()) for load in tokens_per_expert]
    return {"expert_load_max_over_mean": [s["max_over_mean"] for s in stats],
            "expert_load_min_over_mean": [s["min_over_mean"] for s in stats],
            "dead_experts": [s["dead"] for s in stats],
            "expert_load_entropy": [s["entropy"] for s in stats]}


def load_statistics(load: np.ndarray) -> dict[str, float | int]:
    """Imbalance figures of one layer's per-expert token counts [E] (rounded to 4 digits)."""
    load = np.asarray(load, dtype=np.float64)
    total = load.sum()
    mean = max(load.mean(), 1e-12)
    share = load / max(total, 1e-12)
    nonzero = share[share > 0]
    entropy = float(-(nonzero * np.log(nonzero)).sum() / math.log(load.size)) if load.size > 1 else 1.0
    return {"max_over_mean": round(float(load.max() / mean), 4), "min_over_mean": round(float(load.min() / mean), 4),
            "cv": round(float(load.std() / mean), 4), "dead": int((load == 0).sum()), "entropy": round(entropy, 4)}


def encode_array(values: np.ndarray | Tensor) -> dict:
    """A compact JSON form of an array: little-endian bytes in base64 with dtype and shape."""
    array = values.detach().cpu().numpy() if isinstance(values, Tensor) else np.asarray(values)
    if array.dtype.kind in "iub":
        array = array.astype(np.int32 if np.abs(array).max(initial=0) < 2**31 else np.int64)
    else:
        array = array.astype(np.float32)
    array = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"))
    return {"dtype": array.dtype.name, "shape": list(array.shape), "base64": base64.b64encode(array.tobytes()).decode()}


def decode_array(encoded: dict) -> np.ndarray:
    """Inverse of encode_array."""
    dtype = np.dtype(encoded["dtype"]).newbyteorder("<")
    return np.frombuffer(base64.b64decode(encoded["base64"]), dtype=dtype).reshape(encoded["shape"])


def moe_layer_metrics(loads: Sequence[Tensor], biases: Sequence[Tensor], dropped: Sequence[int],
                      losses_by_kind: Sequence[dict[str, float]]) -> dict:
    """The "moe" section: per MoE layer the full expert counts (summed over ranks), their statistics,
    dropped slots, the expert-bias vector and the unweighted balance losses by kind."""
    if not len(loads) == len(biases) == len(dropped) == len(losses_by_kind):
        raise ValueError(f"one entry per MoE layer expected: {len(loads)} loads, {len(biases)} biases, "
                         f"{len(dropped)} dropped counts, {len(losses_by_kind)} loss dicts")
    counts = torch.stack([load.detach().cpu().to(torch.int64) for load in loads])
    stats = [load_statistics(row) for row in counts.numpy()]
    kinds = sorted({kind for losses in losses_by_kind for kind in losses})
    return {"moe": {
        "num_experts": counts.shape[1],
        "load": encode_array(counts),
        **{name: [s[name] for s in stats] for name in ("max_over_mean", "min_over_mean", "cv", "dead", "entropy")},
        "dropped": [int(d) for d in dropped],
        "bias": encode_array(torch.stack([b.detach().cpu().float() for b in biases])),
        "losses": {kind: [_loss_value(losses.get(kind)) for losses in losses_by_kind] for kind in kinds},
    }}


def _loss_value(value: float | Tensor | None) -> float | None:
    return None if value is None else float(value)


def peer_bytes_row(group_ranks: Sequence[int], bytes_to_group_peer: Sequence[int], world_size: int) -> list[int]:
    """One rank's bytes sent to each global rank, from its per-peer counts inside its EP group."""
    if len(group_ranks) != len(bytes_to_group_peer):
        raise ValueError(f"group_ranks has {len(group_ranks)} ranks but {len(bytes_to_group_peer)} byte counts")
    row = [0] * world_size
    for rank, nbytes in zip(group_ranks, bytes_to_group_peer):
        row[rank] += int(nbytes)
    return row


def traffic_metrics(sent_bytes: Sequence[Sequence[int]], gpus_per_node: int = 0) -> dict:
    """The "traffic" section from each rank's bytes sent to every rank (row r: rank r's counters, world x world):
    rank-to-rank and node-to-node matrices and the intra/inter-node totals (self-sends excluded)."""
    matrix = np.asarray(sent_bytes, dtype=np.int64)
    world = matrix.shape[0] if matrix.ndim == 2 else 0
    if matrix.shape != (world, world) or world == 0:
        raise ValueError(f"sent_bytes must be a square world x world table, got shape {list(matrix.shape)}")
    per_node = gpus_per_node or world
    if world % per_node:
        raise ValueError(f"gpus_per_node = {gpus_per_node} must divide the world size {world}")
    np.fill_diagonal(matrix, 0)
    nodes = world // per_node
    node_matrix = matrix.reshape(nodes, per_node, nodes, per_node).sum(axis=(1, 3))
    inter = int(node_matrix.sum() - np.trace(node_matrix))
    return {"traffic": {"gpus_per_node": per_node, "rank_bytes": encode_array(matrix),
                        "node_bytes": node_matrix.tolist(), "intra_node_bytes": int(matrix.sum()) - inter,
                        "inter_node_bytes": inter}}


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active matmul weights (routed experts: top_k of them; embedding lookup
    free) + 12 x layers x hidden x seq_len for attention scores and values (PaLM's convention)."""
    hidden, head = cfg.hidden_size, cfg.hidden_size // cfg.num_heads
    attention = hidden * (cfg.num_heads + 2 * cfg.num_kv_heads) * head + hidden * hidden
    dense_ffn = 3 * hidden * cfg.dense_ffn_size
    moe_ffn = (hidden * cfg.num_experts + 3 * hidden * cfg.expert_ffn_size * (cfg.top_k + cfg.num_shared_experts))
    active = (cfg.num_layers * attention + cfg.first_k_dense * dense_ffn + cfg.num_moe_layers * moe_ffn
              + hidden * cfg.vocab_size)
    return 6.0 * active + 12.0 * cfg.num_layers * hidden * seq_len


def peak_flops_for_device(device_name: str, precision: str = "bfloat16") -> float | None:
    """Dense peak FLOP/s of one GPU from PEAK_FLOPS by its name (torch.cuda.get_device_name), None if unknown."""
    for fragment, peaks in PEAK_FLOPS.items():
        if fragment in device_name.upper():
            return peaks.get(precision)
    return None


def throughput_metrics(tokens: int, seconds: float, flops_per_token: float, peak_flops: float | None) -> dict:
    """tokens/s and MFU (achieved model FLOP/s over peak_flops, the peak of all GPUs together; None: no MFU)."""
    if seconds <= 0:
        raise ValueError(f"seconds = {seconds!r} must be > 0")
    rate = tokens / seconds
    return {"tokens_per_s": rate, "model_flops_per_token": flops_per_token,
            "mfu": rate * flops_per_token / peak_flops if peak_flops else None}


def rank_metrics(peak_memory_bytes: Sequence[int], pipeline_idle_fraction: Sequence[float] | None = None) -> dict:
    """The "ranks" section: each rank's peak memory and the fraction of the step its pipeline waited."""
    section: dict[str, list] = {"peak_memory_bytes": [int(m) for m in peak_memory_bytes]}
    if pipeline_idle_fraction is not None:
        if len(pipeline_idle_fraction) != len(peak_memory_bytes):
            raise ValueError(f"{len(pipeline_idle_fraction)} idle fractions for {len(peak_memory_bytes)} ranks")
        section["pipeline_idle_fraction"] = [round(float(f), 4) for f in pipeline_idle_fraction]
    return {"ranks": section}


def step_record(step: int, *sections: dict) -> dict:
    """One schema-versioned record: the step, the trainer's scalars and the metric sections, merged."""
    record: dict = {"schema": SCHEMA_VERSION, "step": step}
    for section in sections:
        record.update(section)
    return record


class JsonlWriter:
    """Appends one JSON object per line, flushed at every record so a crash loses nothing written."""

    def __init__(self, path: str | Path, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if append else "w")

    def write(self, record: dict) -> None:
        """Write one record."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


class TensorBoardWriter:
    """Writes the scalars of each record (per layer under moe/<figure>/layer_<i>) and per-layer load histograms."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir))

    def write(self, record: dict) -> None:
        """Log one record at its step."""
        step = record["step"]
        for name, value in record.items():
            if name not in ("step", "schema") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"train/{name}", value, step)
        moe = record.get("moe", {})
        for name in ("max_over_mean", "min_over_mean", "cv", "dead", "entropy", "dropped"):
            for layer, value in enumerate(moe.get(name, [])):
                self._writer.add_scalar(f"moe/{name}/layer_{layer}", value, step)
        for kind, values in moe.get("losses", {}).items():
            for layer, value in enumerate(values):
                if value is not None:
                    self._writer.add_scalar(f"moe/loss_{kind}/layer_{layer}", value, step)
        if "load" in moe:
            for layer, counts in enumerate(decode_array(moe["load"])):
                self._writer.add_histogram(f"moe/load/layer_{layer}", counts, step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a JSONL file."""
    with Path(path).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]
