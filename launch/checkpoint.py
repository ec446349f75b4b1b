"""Sharded, atomic, reshardable checkpoints through torch.distributed.checkpoint (DCP).

A checkpoint is one folder RUN_DIR/checkpoint/stepNNNNNNNN written by DCP: every tensor is keyed by
its global name, experts one by one ("model/blocks.3.ffn.experts.w_down.5" is expert 5 of layer 3
wherever it lived), so any layout (pp, dp, ep, process count) finds its pieces in any other's save.
Tensor-parallel shards (params and their optimizer state) are gathered into the single-process
tensors on save and sliced again on load (their TPSpec rows).
Keys held by several ranks (replicas) are written once (DCP's planner deduplicates them), so each
rank writes only a share of what it owns. Groups of keys: model/ (params and buffers such as router
biases), optim/NAME/KEY (ZeRO-1 master and AdamW state per parameter, per expert), data/ (sampler
position), sched/, meta/, rng/rankNNNNN. A master that is the param itself (fp32 params) is not written
twice: model/ holds it.

Publication is atomic: DCP writes into .stepNNNNNNNN.tmp, every rank checksums the files it wrote,
rank 0 writes manifest.json last and renames the folder into place; the newest folder whose manifest
matches its files is the latest (a crash or a corrupted file leaves the previous one in charge).
Only the newest `keep` folders stay. With async saves the write runs on a helper thread of DCP
(its own gloo group) and is published at the next save or at finish().
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from launch.materialize import expert_offset
from moe.tp.layout import TPSpec, full_name
from optim.zero1 import LAYOUT_KEYS

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step(\d{8})$")
EXPERT_KEY = re.compile(r"^(.*\.experts\.[^.]+)\.(\d+)$")
MASTER = "master"


def step_folder(root: Path, step: int) -> Path:
    """Published folder of step's checkpoint."""
    return Path(root) / f"step{step:08d}"


def expert_items(name: str, value: Tensor, first_expert: int) -> Iterator[tuple[str, Tensor]]:
    """(global key, tensor) pairs of one local tensor: a block of experts splits into one key per expert."""
    if ".experts." not in name:
        yield name, value
        return
    for j in range(value.shape[0]):
        yield f"{name}.{first_expert + j}", value[j]


def _tp_group(stages: list[nn.Module]) -> dist.ProcessGroup | None:
    """The stages' TP process group (None without TP)."""
    return next((s.tp.group for s in stages if getattr(s, "tp", None) is not None), None)


@torch.no_grad()
def _tp_full(name: str, value: Tensor, spec: TPSpec, group) -> tuple[str, Tensor]:
    """(single-process name, tensor) of a TP shard (a collective over group): every TP rank's rows put in
    place, zeros in rows no shard of this param holds (attn.kv's rows of attn.qkv.weight: add the two)."""
    shape = list(value.shape)
    shape[spec.dim] = spec.full_size
    full = value.new_zeros(shape)
    pieces = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, value.contiguous(), group=group)
    for rows, piece in zip(spec.indices, pieces):
        full.index_copy_(spec.dim, rows, piece)
    return full_name(name, spec), full


def _put(flat: dict[str, object], key: str, value: Tensor) -> None:
    """flat[key] = value, or added to the rows another TP param already put there (disjoint rows, zeros elsewhere)."""
    flat[key] = flat[key] + value if key in flat and value.dim() else value


@dataclass
class TrainState:
    """What one rank checkpoints: its stages, its ZeRO-1 optimizer, the LR scheduler, the data sampler."""

    stages: list[nn.Module]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data: object  # launch.data.DataFeed (state_dict / load_state_dict of its integer position)

    def param_names(self) -> list[str]:
        """Stage-local names of the optimizer's params, in its state_dict order."""
        names = {id(p): n for s in self.stages for n, p in s.named_parameters()}
        return [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def expert_offsets(self) -> dict[str, int]:
        """Global id of the first expert held here, per stage tensor name holding experts."""
        out = {}
        for stage in self.stages:
            for name, value in stage.state_dict().items():
                if ".experts." in name:
                    out[name] = expert_offset(stage, name, value.shape[0])
        return out

    def to_flat(self, step: int, config: dict) -> dict[str, object]:
        """The DCP state dict of this rank (a collective: ZeRO-1 gathers each param's full state)."""
        offsets = self.expert_offsets()
        flat: dict[str, object] = {}
        specs, group = self.tp_specs, _tp_group(self.stages)
        for stage in self.stages:
            for name, value in stage.state_dict().items():
                if name in specs:
                    name, value = _tp_full(name, value, specs[name], group)
                for key, piece in expert_items(name, value, offsets.get(name, 0)):
                    _put(flat, f"model/{key}", piece)
        full = self.optimizer.state_dict()
        param_dtypes = {n: p.dtype for s in self.stages for n, p in s.named_parameters()}
        for index, name in enumerate(self.param_names()):
            entry, first = full["state"][index], offsets.get(name, 0)
            for kind, value in entry.items():
                value = torch.as_tensor(value)
                if kind == MASTER and value.dtype == param_dtypes[name]:  # the param itself: model/ holds it
                    continue
                if name in specs:
                    key, value = (_tp_full(name, value, specs[name], group) if value.dim()
                                  else (full_name(name, specs[name]), value.clone()))
                    items = [(key, value)]
                elif value.shape == entry[MASTER].shape:
                    items = expert_items(name, value, first)
                else:  # a scalar (AdamW's step) shared by the block: one copy per expert key
                    items = ((key, value.clone()) for key, _ in expert_items(name, entry[MASTER], first))
                for key, piece in items:
                    _put(flat, f"optim/{key}/{kind}", piece)
        for key, value in self.data.state_dict().items():
            flat[f"data/{key}"] = torch.tensor(value, dtype=torch.int64)
        flat["sched/last_epoch"] = torch.tensor(self.scheduler.last_epoch)
        flat["meta/step"] = torch.tensor(step)
        flat["meta/config"] = config
        flat[f"rng/rank{dist.get_rank():05d}"] = torch.get_rng_state()
        return {k: v.detach() if isinstance(v, Tensor) else v for k, v in flat.items()}

    def load_flat(self, folder: Path, restore_data: bool = True) -> int:
        """Read this rank's pieces from a checkpoint of any layout into the stages, the optimizer, the
        scheduler and (unless restore_data is false) the sampler; returns the checkpoint's step."""
        metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        offsets = self.expert_offsets()
        wanted: dict[str, Tensor] = {}

        def want(key: str) -> Tensor:
            meta = metadata.get(key)
            if not isinstance(meta, TensorStorageMetadata):
                raise ValueError(f"checkpoint {folder} has no tensor {key!r}: it was saved from another model "
                                 f"([model] section) than this run's")
            return wanted.setdefault(key, torch.empty(meta.size, dtype=meta.properties.dtype))

        model_keys = {}
        for stage in self.stages:
            for name, value in stage.state_dict().items():
                model_keys[name] = [want(f"model/{k}") for k in self._keys(name, value, offsets)]
        names = self.param_names()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        kinds = {}
        for name, param in zip(names, params):
            keys = self._keys(name, param, offsets)
            kinds[name] = sorted(k.rsplit("/", 1)[1] for k in metadata if k.startswith(f"optim/{keys[0]}/"))
            for kind in kinds[name]:
                for key in keys:
                    want(f"optim/{key}/{kind}")
        data_keys = [f"data/{key}" for key in self.data.state_dict()] if restore_data else []
        if "data/generator" in metadata and restore_data:
            raise ValueError(f"checkpoint {folder} holds the sampler state of an older version (a shuffled order, "
                             f"not an epoch and cursor): this version cannot continue its data order")
        for key in (*data_keys, "sched/last_epoch", "meta/step"):
            want(key)
        rng = f"rng/rank{dist.get_rank():05d}"
        if rng in metadata:
            want(rng)
        dcp.load(wanted, checkpoint_id=str(folder))

        for stage in self.stages:
            stage.load_state_dict({name: self._local(name, pieces) for name, pieces in model_keys.items()
                                   if name in stage.state_dict()})
        self._load_optimizer(wanted, names, kinds, offsets)
        epoch = int(wanted["sched/last_epoch"])
        self.scheduler.last_epoch = epoch
        for group, base, rule in zip(self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            group["lr"] = base * rule(epoch)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if restore_data:
            self.data.load_state_dict({key.split("/", 1)[1]: int(wanted[key]) for key in data_keys})
        if rng in wanted:
            torch.set_rng_state(wanted[rng])
        return int(wanted["meta/step"])

    @functools.cached_property
    def tp_specs(self) -> dict[str, TPSpec]:
        """Stage-local name -> TPSpec of every param holding rows of a larger single-process tensor."""
        return {name: p.tp_spec for s in self.stages for name, p in s.named_parameters()
                if getattr(p, "tp_spec", None) is not None and p.tp_spec.indices is not None}

    def _keys(self, name: str, value: Tensor, offsets: dict[str, int]) -> list[str]:
        """Checkpoint keys of a stage tensor: its single-process name under TP, else one per expert it holds."""
        spec = self.tp_specs.get(name)
        if spec is not None:
            return [full_name(name, spec)]
        return [k for k, _ in expert_items(name, value, offsets.get(name, 0))]

    def _local(self, name: str, pieces: list[Tensor]) -> Tensor:
        """This rank's stage tensor from its checkpoint pieces: experts stacked, TP rows sliced out."""
        spec = self.tp_specs.get(name)
        if spec is None:
            return _join(name, pieces)
        rank = next(s.tp.rank for s in self.stages if getattr(s, "tp", None) is not None)
        return pieces[0].index_select(spec.dim, spec.indices[rank])

    def _load_optimizer(self, wanted: dict[str, Tensor], names: list[str], kinds: dict[str, list[str]],
                        offsets: dict[str, int]) -> None:
        """Hand ZeRO-1 its full per-param state rebuilt from the per-expert pieces (it re-slices its shards)."""
        state, elementwise, index = {}, [], 0
        for group in self.optimizer.param_groups:
            found = set()
            for p in group["params"]:
                name = names[index]
                keys = self._keys(name, p, offsets)
                pieces = {kind: [wanted[f"optim/{k}/{kind}"] for k in keys] for kind in kinds[name]}
                pieces.setdefault(MASTER, [wanted[f"model/{k}"] for k in keys])  # saved as the param itself
                entry = {}
                for kind, parts in pieces.items():
                    if parts[0].shape == pieces[MASTER][0].shape:
                        entry[kind] = self._local(name, parts)
                        found.add(kind)
                    else:
                        entry[kind] = parts[0]
                state[index] = entry
                index += 1
            elementwise.append(sorted(found - {MASTER}))
        first, groups = 0, []
        for group in self.optimizer.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params" and k not in LAYOUT_KEYS})
            groups[-1]["params"] = list(range(first, first + len(group["params"])))
            first += len(group["params"])
        self.optimizer.load_state_dict({"state": state, "param_groups": groups, "elementwise_keys": elementwise})


def _join(name: str, pieces: list[Tensor]) -> Tensor:
    """A stage tensor from its global pieces (experts stacked back into their block)."""
    return torch.stack(pieces) if ".experts." in name else pieces[0]


def _crc(path: Path) -> int:
    """CRC-32 of a file, read in 16 MiB blocks."""
    value = 0
    with path.open("rb") as handle:
        while block := handle.read(1 << 24):
            value = zlib.crc32(block, value)
    return value


def _file_table(folder: Path, names: list[str]) -> dict[str, list[int]]:
    """{file name: [bytes, crc32]} of files in folder."""
    return {n: [(folder / n).stat().st_size, _crc(folder / n)] for n in names}


def verify(folder: Path) -> str | None:
    """Why a published checkpoint folder cannot be used (missing manifest, missing, truncated or
    corrupted file), or None when every file matches its manifest entry."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing (the save did not finish)"
    try:
        table = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as error:
        return f"{manifest} is unreadable ({error})"
    for name, (size, crc) in table.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)"
        if _crc(path) != crc:
            return f"{path} fails its CRC-32 check (corrupted)"
    return None


def published(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every published checkpoint under root, newest first (unverified)."""
    root = Path(root)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))] if root.is_dir() else []
    return sorted(found, reverse=True)


def latest_valid(root: Path) -> Path | None:
    """The newest published checkpoint that passes verify(); each refused one is reported on stderr with its reason."""
    for _, folder in published(root):
        reason = verify(folder)
        if reason is None:
            return folder
        print(f"checkpoint {folder} refused: {reason}; trying the previous one", file=sys.stderr, flush=True)
    return None


class Checkpointer:
    """Saves and loads one run's sharded checkpoints under root; create it on every rank at once."""

    def __init__(self, root: str | Path, keep: int = 3, asynchronous: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"keep = {keep} must be >= 1 (checkpoints kept on disk)")
        self.root = Path(root)
        self.keep = keep
        self.asynchronous = asynchronous
        self.group = dist.new_group(backend="gloo")  # DCP's planning collectives, off the training groups
        self._pending: tuple[Future, Path, int] | None = None

    def save(self, state: TrainState, step: int, config: dict) -> None:
        """Write step's checkpoint (every rank); returns once it is published, or at once when asynchronous."""
        self.finish()
        flat = state.to_flat(step, config)
        tmp = self.root / f".step{step:08d}.tmp"
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(self.group)
        if self.asynchronous:
            self._pending = (dcp.async_save(flat, checkpoint_id=str(tmp), process_group=self.group), tmp, step)
        else:
            dcp.save(flat, checkpoint_id=str(tmp), process_group=self.group)
            self._publish(tmp, step)

    def finish(self) -> None:
        """Wait for an asynchronous save in flight and publish it (every rank)."""
        if self._pending is not None:
            future, tmp, step = self._pending
            self._pending = None
            future.result()
            self._publish(tmp, step)

    def _publish(self, tmp: Path, step: int) -> None:
        """Checksum each rank's files, then rank 0 writes the manifest, renames the folder into place and
        drops checkpoints beyond the newest keep."""
        mine = sorted(p.name for p in tmp.glob(f"__{dist.get_rank()}_*.distcp"))
        tables = [None] * dist.get_world_size()
        dist.all_gather_object(tables, _file_table(tmp, mine), group=self.group)
        if dist.get_rank() == 0:
            files = {k: v for t in tables for k, v in t.items()} | _file_table(tmp, [".metadata"])
            _write_synced(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))
            final = step_folder(self.root, step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _sync_dir(self.root)
            for _, old in published(self.root)[self.keep:]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier(self.group)

    def load(self, state: TrainState, restore_data: bool = True) -> int:
        """Restore state from the latest valid checkpoint (any layout); returns its step, 0 when none."""
        self.finish()
        choice = [str(latest_valid(self.root)) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(choice, src=0, group=self.group)
        if choice[0] == "None":
            return 0
        return state.load_flat(Path(choice[0]), restore_data)


def _write_synced(path: Path, text: str) -> None:
    """Write text and fsync it."""
    with path.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _sync_dir(folder: Path) -> None:
    """fsync a folder so a rename inside it is durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def consolidate(path: str | Path) -> dict[str, Tensor]:
    """The single-process MoETransformer state dict of a checkpoint (a step folder, or a run's checkpoint
    root: its latest valid one), experts stacked back in id order; no process group needed."""
    path = Path(path)
    folder = path if (path / MANIFEST).is_file() else latest_valid(path)
    if folder is None:
        raise ValueError(f"no valid checkpoint under {path}")
    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    wanted = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()
              if k.startswith("model/") and isinstance(m, TensorStorageMetadata)}
    dcp.load(wanted, checkpoint_id=str(folder), no_dist=True)
    full: dict[str, Tensor] = {}
    experts: dict[str, dict[int, Tensor]] = {}
    for key, value in wanted.items():
        name = key.removeprefix("model/")
        match = EXPERT_KEY.match(name)
        if match:
            experts.setdefault(match.group(1), {})[int(match.group(2))] = value
        else:
            full[name] = value
    for name, pieces in experts.items():
        full[name] = torch.stack([pieces[e] for e in sorted(pieces)])
    return full


def export(path: str | Path, out: str | Path) -> Path:
    """Write consolidate(path) as one torch.save file that MoETransformer.load_state_dict takes."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    torch.save(consolidate(path), tmp)
    os.replace(tmp, out)
    return out


def export_main(argv: list[str]) -> int:
    """`moe-train export CHECKPOINT OUT.pt`: CHECKPOINT is a step folder or a run's checkpoint root."""
    import argparse

    parser = argparse.ArgumentParser(prog="moe-train export", description=export_main.__doc__)
    parser.add_argument("checkpoint", help="RUN_DIR/checkpoint (its latest valid step) or one stepNNNNNNNN folder")
    parser.add_argument("out", help="file for the consolidated MoETransformer state dict (torch.save)")
    args = parser.parse_args(argv)
    try:
        path = export(args.checkpoint, args.out)
    except (ValueError, FileNotFoundError) as error:
        print(f"moe-train export: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
