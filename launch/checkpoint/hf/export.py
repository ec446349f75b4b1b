"""`moe-train export CHECKPOINT OUT --format hf`: a DCP checkpoint as a Hugging Face DeepSeek-V3 folder, streamed.

The checkpoint is read one single-process key at a time (a routed expert is one key) and its Hub tensors go to
the current safetensors shard, which is written out once the next tensor would take it past max_shard_bytes:
memory stays about one shard plus one tensor, never the whole model. The folder (config.json, the shards,
model.safetensors.index.json, the run's tokenizer files) is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import Tensor

from launch.checkpoint.chunks import Reader
from launch.checkpoint.hf.config import hub_config
from launch.checkpoint.hf.names import Part, export_parts
from launch.config.run import current_names
from launch.data.tokenizer import load_tokenizer
from moe.config import ModelConfig
from moe.model import MoETransformer

MAX_SHARD_BYTES = 5 * 2**30  # the Hub's usual shard size
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def read_tensor(reader: Reader, key: str) -> Tensor:
    """The whole checkpoint tensor model/key, read alone (no process group)."""
    meta = reader.read_metadata().state_dict_metadata[f"model/{key}"]
    out = {f"model/{key}": torch.empty(meta.size, dtype=meta.properties.dtype)}
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out[f"model/{key}"]


def saved_config(reader: Reader) -> dict[str, dict]:
    """The run config (dataclasses.asdict of launch.config.run.RunConfig, by section) a checkpoint was saved with, its
    keys under their current names (a checkpoint saved before a key was renamed holds the old one)."""
    prefix = "meta/config."
    out: dict[str, object] = {k: None for k in reader.read_metadata().state_dict_metadata if k.startswith(prefix)}
    dcp.load(out, storage_reader=reader, no_dist=True)  # DCP flattened the nested dict: one entry per field
    config: dict[str, dict] = {}
    for key, value in out.items():
        section, _, field = key.removeprefix(prefix).partition(".")
        config.setdefault(section, {})[field] = value
    return {section: current_names(section, values) for section, values in config.items()}


def model_keys(cfg: ModelConfig) -> list[str]:
    """Every single-process key of cfg's model in state-dict order, one per routed expert."""
    with torch.device("meta"):
        model = MoETransformer(cfg)
    keys = []
    for name, tensor in model.state_dict().items():
        keys += [f"{name}.{e}" for e in range(tensor.shape[0])] if ".experts." in name else [name]
    return keys


def hub_tensors(cfg: ModelConfig, key: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
    """The Hub tensors our key's tensor makes (views where a Part is a row block, copies where it repeats)."""
    by_name: dict[str, list[Part]] = {}
    for part in export_parts(cfg, key, tensor.shape[0]):
        by_name.setdefault(part.name, []).append(part)
    out, used = [], False
    for name, parts in by_name.items():
        if len(parts) == 1 and parts[0].length is None:
            out.append((name, tensor.clone() if used else tensor))  # a second whole copy (MTP layers' embed, head)
            used = True
            continue
        pieces = sorted(parts, key=lambda p: p.hub_start)
        blocks = [tensor.narrow(p.dim, p.start, p.length) for p in pieces]
        if len(blocks) == 1:  # one row block (a padded vocab's first rows): a copy after its first use, as above
            out.append((name, blocks[0].clone() if used else blocks[0]))
            used = True
            continue
        out.append((name, torch.cat(blocks, dim=pieces[0].dim)))
    return out


class ShardWriter:
    """Collects named tensors and writes a safetensors shard whenever the next one would pass max_bytes."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: dict[str, Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # (temporary file name, its tensor names)
        self.total = 0

    def add(self, name: str, tensor: Tensor) -> None:
        """Queue one tensor (the pending shard is written first when this one would not fit)."""
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        """Write the pending tensors as the next shard and let go of them."""
        if not self.pending:
            return
        file = f"shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.folder / file), metadata={"format": "pt"})
        self.files.append((file, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> dict:
        """Write the last shard, give the shards the Hub's names; returns the index (model.safetensors.index.json)."""
        self.flush()
        weight_map = {}
        count = len(self.files)
        for i, (file, names) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / file, self.folder / final)
            weight_map.update({name: final for name in names})
        return {"metadata": {"total_size": self.total}, "weight_map": weight_map}


def eos_id(spec: str) -> int | None:
    """The end-of-document id of data.tokenizer, None when it no longer loads."""
    try:
        return load_tokenizer(spec).eos_id
    except ValueError:
        return None


def copy_tokenizer(spec: str, folder: Path) -> list[str]:
    """Copy data.tokenizer's files (a tokenizer.json, or a model folder's tokenizer files) into folder; their names."""
    if spec == "bytes":
        return []
    path = Path(spec)
    sources = [path / n for n in TOKENIZER_FILES if (path / n).is_file()] if path.is_dir() else [path]
    if not sources or not sources[0].is_file():
        print(f"moe-train export: data.tokenizer = {spec!r} is gone: the export has no tokenizer files",
              file=sys.stderr)
        return []
    for source in sources:
        shutil.copyfile(source, folder / (source.name if path.is_dir() else "tokenizer.json"))
    return [s.name for s in sources]


def export_hub(folder: Path, out: str | Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write checkpoint step folder `folder` as a Hugging Face DeepSeek-V3 folder `out` (see the module docstring)."""
    out = Path(out)
    if out.exists():
        raise ValueError(f"{out} exists: give a new folder for the export")
    reader = Reader(str(folder))
    config = saved_config(reader)
    cfg = ModelConfig(**config["model"])
    keys = model_keys(cfg)
    dtype = reader.read_metadata().state_dict_metadata[f"model/{keys[0]}"].properties.dtype
    hub = hub_config(cfg, str(dtype).removeprefix("torch."), eos_id(config["data"]["tokenizer"]))
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        writer = ShardWriter(tmp, max_shard_bytes)
        for key in keys:
            for name, tensor in hub_tensors(cfg, key, read_tensor(reader, key)):
                writer.add(name, tensor)
        (tmp / INDEX).write_text(json.dumps(writer.finish(), indent=2))
        (tmp / "config.json").write_text(json.dumps(hub, indent=2))
        copy_tokenizer(config["data"]["tokenizer"], tmp)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
