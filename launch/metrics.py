"""Per-step metrics: expert-load summaries and a JSONL writer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor


def expert_load_summary(tokens_per_expert: list[Tensor]) -> dict[str, list]:
    """Per MoE layer: max/mean and min/mean load, dead experts, normalised load entropy."""
    summary: dict[str, list] = {"expert_load_max_over_mean": [], "expert_load_min_over_mean": [],
                                "dead_experts": [], "expert_load_entropy": []}
    for load in tokens_per_expert:
        load = load.double()
        mean = load.mean().clamp_min(1e-12)
        share = load / load.sum().clamp_min(1e-12)
        entropy = -(share * share.clamp_min(1e-30).log()).sum() / torch.log(torch.tensor(float(load.numel())))
        summary["expert_load_max_over_mean"].append(round((load.max() / mean).item(), 4))
        summary["expert_load_min_over_mean"].append(round((load.min() / mean).item(), 4))
        summary["dead_experts"].append(int((load == 0).sum()))
        summary["expert_load_entropy"].append(round(entropy.item(), 4))
    return summary


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


def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a JSONL file."""
    with Path(path).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]
