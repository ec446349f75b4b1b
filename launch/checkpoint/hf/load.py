"""`model.init_from = HF_FOLDER`: a run starts from a Hugging Face DeepSeek-V3 folder (continued pretraining).

check_init_from (before any process starts) refuses a folder whose config.json is not the run's model or asks for
what the model cannot compute, or that lacks a tensor. fill_from_hub (per rank, in place of launch.train.materialize's
seeded values) reads, for every rectangle of a single-process key the rank holds (its stages, TP shards, experts:
launch.parallel.placement), just that rectangle from the safetensors shards (safe_open's get_slice), never the whole model. MTP
depths the folder has no weights for (transformers' save_pretrained writes none) start from the seeded values.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from launch.checkpoint.hf.config import check_hub_config
from launch.checkpoint.hf.export import INDEX, model_keys
from launch.checkpoint.hf.names import Part, hub_names, hub_parts
from launch.parallel.placement import placement
from moe.config import ModelConfig
from moe.init import initial_value

SINGLE = "model.safetensors"


def weight_map(folder: Path) -> dict[str, str]:
    """Hub tensor name -> the safetensors file holding it (model.safetensors.index.json, or one model.safetensors)."""
    if (folder / INDEX).is_file():
        return json.loads((folder / INDEX).read_text())["weight_map"]
    if (folder / SINGLE).is_file():
        with safe_open(str(folder / SINGLE), framework="pt") as handle:
            return {name: SINGLE for name in handle.keys()}
    raise ValueError(f"model.init_from = {str(folder)!r} holds neither {INDEX} nor {SINGLE}")


def check_init_from(cfg: ModelConfig) -> None:
    """Raise ValueError naming the field unless cfg.init_from is a DeepSeek-V3 folder of exactly cfg's model."""
    folder = Path(cfg.init_from)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model.init_from = {cfg.init_from!r}: no config.json there (allowed: a Hugging Face "
                         f"DeepSeek-V3 folder, e.g. one `moe-train export ... --format hf` wrote)")
    check_hub_config(cfg, json.loads((folder / "config.json").read_text()), cfg.init_from)
    held = weight_map(folder)
    for key in model_keys(cfg):
        if key.startswith("mtp."):
            continue
        for name in hub_names(cfg, key):
            if name not in held:
                raise ValueError(f"model.init_from = {cfg.init_from!r} lacks tensor {name!r} (model tensor {key!r})")


def _read_into(view: Tensor, offsets: tuple[int, ...], parts: list[Part], files: dict[str, str],
               opened: dict[str, object]) -> None:
    """Fill view, the rectangle at offsets of our key's full tensor, from the Hub tensors parts name."""
    for part in parts:
        lo, hi = offsets[part.dim], offsets[part.dim] + view.shape[part.dim]
        stop = hi if part.length is None else min(hi, part.start + part.length)
        first = max(lo, part.start)
        if first >= stop:
            continue
        box = [slice(o, o + n) for o, n in zip(offsets, view.shape)]
        box[part.dim] = slice(part.hub_start + first - part.start, part.hub_start + stop - part.start)
        piece = opened[files[part.name]].get_slice(part.name)[tuple(box)]
        view.narrow(part.dim, first - lo, stop - first).copy_(piece)


@torch.no_grad()
def fill_from_hub(stage: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Set every param and buffer of stage to its pieces of cfg.init_from's weights (MTP tensors the folder lacks:
    their seeded initial values)."""
    folder = Path(cfg.init_from)
    files = weight_map(folder)
    with contextlib.ExitStack() as stack:
        opened = {file: stack.enter_context(safe_open(str(folder / file), framework="pt"))
                  for file in sorted(set(files.values()))}
        for name, tensor in stage.state_dict(keep_vars=True).items():
            place = placement(stage, name, tensor)
            for key, offsets, view in place.boxes(0, tensor.detach().view(-1)):
                parts = hub_parts(cfg, key, place.full_shape[0])
                if all(part.name in files for part in parts):
                    view.zero_()  # rows no Hub tensor holds (a padded vocab's, moe.vocab) start at zero
                    _read_into(view, offsets, parts, files, opened)
                    continue
                if not key.startswith("mtp."):
                    raise ValueError(f"model.init_from = {cfg.init_from!r} lacks the weights of model tensor {key!r}")
                drawn = initial_value(cfg, place.key, key, place.full_shape, seed, tensor.device)
                view.copy_(drawn[tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))])
