"""Per-step metrics (schema in launch/metrics/dashboard/SCHEMA.md): expert load, traffic, throughput, per-rank figures; JSONL and TensorBoard writers."""

from __future__ import annotations

import base64
import errno
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from launch.errors import DiskFull
from launch.metrics.flops import mixed_peak
from launch.metrics.flops import model_flops_per_token  # noqa: F401 (the trainer's MFU numerator, re-exported)
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
    stats = load_statistics(torch.stack([load.detach().cpu() for load in tokens_per_expert]).numpy())
    return {"expert_load_max_over_mean": stats["max_over_mean"], "expert_load_min_over_mean": stats["min_over_mean"],
            "dead_experts": stats["dead"], "expert_load_entropy": stats["entropy"]}


def load_statistics(loads: np.ndarray) -> dict[str, list]:
    """Per layer of token counts [layers, experts]: max/mean, min/mean, CV (population std / mean), dead
    experts and the load entropy normalised by log(experts) (1 = uniform); figures rounded to 4 digits."""
    loads = np.asarray(loads, dtype=np.float64)
    experts = loads.shape[1]
    mean = np.maximum(loads.mean(axis=1), 1e-12)
    share = loads / np.maximum(loads.sum(axis=1, keepdims=True), 1e-12)
    plogp = np.where(share > 0, share * np.log(np.where(share > 0, share, 1.0)), 0.0)
    entropy = -plogp.sum(axis=1) / math.log(experts) if experts > 1 else np.ones(len(loads))
    figures = {"max_over_mean": loads.max(axis=1) / mean, "min_over_mean": loads.min(axis=1) / mean,
               "cv": loads.std(axis=1) / mean, "entropy": entropy}
    return {**{name: np.round(values, 4).tolist() for name, values in figures.items()},
            "dead": (loads == 0).sum(axis=1).tolist()}


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


def moe_layer_metrics(loads: Sequence[Tensor] | np.ndarray, biases: Sequence[Tensor] | np.ndarray,
                      dropped: Sequence[int], losses_by_kind: Sequence[dict[str, float]]) -> dict:
    """The "moe" section: per MoE layer the full expert counts (summed over ranks), their statistics,
    dropped slots, the expert-bias vector and the unweighted balance losses by kind."""
    counts, bias = _stack(loads).astype(np.int64), _stack(biases).astype(np.float32)
    if not len(counts) == len(bias) == len(dropped) == len(losses_by_kind):
        raise ValueError(f"one entry per MoE layer expected: {len(counts)} loads, {len(bias)} biases, "
                         f"{len(dropped)} dropped counts, {len(losses_by_kind)} loss dicts")
    kinds = sorted({kind for losses in losses_by_kind for kind in losses})
    return {"moe": {
        "num_experts": counts.shape[1],
        "load": encode_array(counts),
        **load_statistics(counts),
        "dropped": [int(d) for d in dropped],
        "bias": encode_array(bias),
        "losses": {kind: [_loss_value(losses.get(kind)) for losses in losses_by_kind] for kind in kinds},
    }}


def _stack(rows: Sequence[Tensor] | np.ndarray) -> np.ndarray:
    if isinstance(rows, np.ndarray):
        return rows
    return np.stack([row.detach().cpu().numpy() if isinstance(row, Tensor) else np.asarray(row) for row in rows])


def _loss_value(value: float | Tensor | None) -> float | None:
    return None if value is None else float(value)


def traffic_metrics(sent_bytes: Sequence[Sequence[int]], gpus_per_node: int = 0) -> dict:
    """The "traffic" section: rank-to-rank and node-to-node byte matrices and intra/inter-node totals.

    sent_bytes[r][p]: bytes EP-group rank r sent to EP peer p this step (its dispatch counters per peer),
    summed over all EP groups by position (each rank adds its row at its EP index, then one all-reduce),
    so the record's size does not grow with pipeline stages or replicas; gpus_per_node: EP ranks per
    node (0: one node). Self-sends count zero."""
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


def peak_flops_for_device(device_name: str, precision: str = "bfloat16") -> float | None:
    """Dense peak FLOP/s of one GPU from PEAK_FLOPS by its name (torch.cuda.get_device_name), None if unknown."""
    for fragment, peaks in PEAK_FLOPS.items():
        if fragment in device_name.upper():
            return peaks.get(precision)
    return None


def mfu_peak(cfg: ModelConfig, seq_len: int, device: torch.device,
             peak_tflops_override: float = 0.0) -> float | None:
    """The peak FLOP/s of one GPU that MFU divides by (times the world size), for the rank's device.

    peak_tflops_override > 0 (train.peak_tflops_per_gpu): that figure, as given, whatever the precision.
    Otherwise from the device's name (PEAK_FLOPS): the dense BF16 peak, and when cfg.expert_precision is
    "fp8" the time-weighted mix launch.metrics.flops.mixed_peak of the BF16 peak for the BF16 FLOPs and the FP8 peak
    for the routed experts' GEMMs (their forward, dgrad and wgrad run in FP8): F / (F_bf16 / bf16 + F_fp8 /
    fp8). None (no MFU) on a CPU or meta device, or a GPU without the needed peaks in PEAK_FLOPS."""
    if peak_tflops_override:
        return peak_tflops_override * 1e12
    if device.type != "cuda":
        return None
    return gpu_mfu_peak(cfg, seq_len, torch.cuda.get_device_name(device))


def gpu_mfu_peak(cfg: ModelConfig, seq_len: int, device_name: str) -> float | None:
    """mfu_peak of a GPU by its name (torch.cuda.get_device_name); None if PEAK_FLOPS lacks a needed peak."""
    bf16 = peak_flops_for_device(device_name, "bfloat16")
    fp8 = peak_flops_for_device(device_name, "fp8") if cfg.expert_precision == "fp8" else bf16
    return mixed_peak(cfg, seq_len, bf16, fp8) if bf16 and fp8 else None


def throughput_metrics(tokens: int, seconds: float, flops_per_token: float, peak_flops: float | None) -> dict:
    """tokens/s and MFU (achieved model FLOP/s over peak_flops, the peak of all GPUs together; None: no MFU)."""
    if seconds <= 0:
        raise ValueError(f"seconds = {seconds!r} must be > 0")
    rate = tokens / seconds
    return {"tokens_per_s": rate, "model_flops_per_token": flops_per_token,
            "mfu": rate * flops_per_token / peak_flops if peak_flops else None}


def rank_metrics(peak_memory_bytes: Sequence[int], pipeline_idle_fraction: Sequence[float] | None = None,
                 expert_rows: np.ndarray | None = None) -> dict:
    """The "ranks" section: each rank's peak memory, the fraction of the step its pipeline waited and the rows
    its experts received per MoE layer (expert_rows [ranks, layers], 0 for the layers a rank does not hold)."""
    section: dict = {"peak_memory_bytes": np.asarray(peak_memory_bytes, dtype=np.int64).tolist()}
    if pipeline_idle_fraction is not None:
        if len(pipeline_idle_fraction) != len(peak_memory_bytes):
            raise ValueError(f"{len(pipeline_idle_fraction)} idle fractions for {len(peak_memory_bytes)} ranks")
        section["pipeline_idle_fraction"] = np.round(np.asarray(pipeline_idle_fraction, dtype=np.float64), 4).tolist()
    if expert_rows is not None:
        if len(expert_rows) != len(peak_memory_bytes):
            raise ValueError(f"{len(expert_rows)} expert-row tables for {len(peak_memory_bytes)} ranks")
        section["expert_rows"] = encode_array(np.rint(expert_rows).astype(np.int64))
    return {"ranks": section}


def straggler_metrics(rows: np.ndarray, peak: np.ndarray, row_flops: float, flops_per_rank: float) -> dict:
    """The "stragglers" section: rows [layers, ep] each EP position's experts received this step (averaged over
    the EP group's copies), peak [layers] the busiest rank's largest rows over the balanced share in one exchange
    of the step (launch.train.step.position_rows), and the straggler share: the rows the busiest position
    received beyond the mean, at row_flops each, over the step's model FLOPs per rank (flops_per_rank), i.e. the
    time the busiest rank's experts take beyond the mean priced at the step's own achieved FLOP rate. The share
    counts each layer's busiest position over the whole step (exact when one position is the busiest in every
    exchange); peak keeps each exchange's own straggler."""
    rows = np.asarray(rows, dtype=np.float64)
    excess = float((rows.max(axis=1) - rows.mean(axis=1)).sum()) if rows.size else 0.0
    return {"stragglers": {
        "ep": rows.shape[1] if rows.ndim == 2 else 0,
        "busiest_over_mean": np.round(np.asarray(peak, dtype=np.float64), 4).tolist(),
        "rows": encode_array(np.rint(rows).astype(np.int64)),
        "share": round(excess * row_flops / flops_per_rank, 6) if flops_per_rank > 0 else None,
    }}


def step_record(step: int, *sections: dict) -> dict:
    """One schema-versioned record: the step, the trainer's scalars and the metric sections, merged."""
    record: dict = {"schema": SCHEMA_VERSION, "step": step}
    for section in sections:
        record.update(section)
    return record


class JsonlWriter:
    """Appends one JSON object per line, each record written whole or not at all: one unbuffered write per record
    (a crash loses nothing written), and a write that fails part-way (a full disk) is cut back off the file, so no
    partial line ever merges into the next record; the failure is raised (DiskFull names the path and the bytes)."""

    def __init__(self, path: str | Path, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab" if append else "wb", buffering=0)

    def write(self, record: dict) -> None:
        """Append one record (whole, or the file is left as it was)."""
        line = (json.dumps(record) + "\n").encode()
        start = self._file.seek(0, os.SEEK_END)
        try:
            done = 0
            while done < len(line):
                done += self._file.write(line[done:])
        except OSError as error:
            self._file.truncate(start)
            if error.errno == errno.ENOSPC:
                raise DiskFull(self.path, len(line), "appending a metrics record to") from None
            raise

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
