"""Sharded, atomic, reshardable checkpoints through torch.distributed.checkpoint (DCP): each rank writes its pieces.

Format. A checkpoint is one folder RUN_DIR/checkpoint/stepNNNNNNNN written by DCP. Every tensor has the
single-process key and full shape, experts one key each ("model/blocks.3.ffn.experts.w_down.5" is expert 5
of layer 3 wherever it lived): model/KEY (params and buffers), optim/KEY/KIND (optimizer state: AdamW's
exp_avg, exp_avg_sq in optim.moment_dtype, step; master only where it is not the param itself, e.g. bf16 params;
ema, the weight EMA, when optim.ema_decay keeps one), data/, sched/, meta/, guard/ (the spike guard's history),
window/ (the redundant experts' load window), rng/rankNNNNN. A tensor is stored as rectangles (DCP chunks),
each written by the one rank that holds it: ZeRO-1 hands out, per param, the runs of its flattened
elements its shard holds (ZeroOptimizer.pieces: views, no gather); launch.parallel.placement maps a run to at
most 2 * ndim - 1 rectangles of the keys (a TP shard's rows split where they jump, e.g. fused qkv; an expert block split per
expert). Replicated rectangles (TP replicas, buffers) are identical and written once (DCP deduplicates).
Any layout (pp, dp, ep, tp, process count) reads what its own pieces overlap, then ZeRO-1 all-gathers the
params from the loaded masters. The unit is "a rectangle of a single-process tensor", not a rank's flat
shard: ZeRO-2/3 (params sharded too) or state offloaded to the host hand out the same pieces, so the
format holds them unchanged. A save copies nothing (DCP clones a view for its write; at most this rank's
pieces, one shard); an asynchronous one copies the pieces to reused host buffers on the training thread
(HostStager) and DCP plans and writes on its own thread.

Publication is atomic: DCP writes into .stepNNNNNNNN.tmp, each rank checksums the files it wrote, rank 0
gathers the tables, writes manifest.json last and renames the folder into place; the newest folder whose
manifest matches its files is the latest (a crash or a corrupted file leaves the previous one in charge).
On load each rank checks the CRCs of only the files it will read and the ranks agree (one all-reduce) on
the newest folder that passed everywhere. Only the newest `keep` folders stay.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from launch.checkpoint.chunks import Chunks, HostStager, LoadPlanner, Reader, SavePlanner, Writer, files_read
from launch.faults.guard import StepGuard
from launch.parallel.placement import EXPERT_KEY, Placement, placements
from launch.parallel.spawn import RankRefusal
from launch.checkpoint.manifest import MANIFEST, STEP_DIR, file_table, latest_valid, publish, published, verify
from launch.errors import DiskFull, cli, disk_full, free_bytes
from optim.ema import EMA_KEY
from optim.shard import MASTER_KEY, Piece
from optim.zero import ZeroOptimizer


WEIGHTS = ("model", EMA_KEY)  # what consolidate and `moe-train export --weights` write: the weights or their EMA


def _add(flat: dict[str, object], fqn: str, place: Placement, start: int, data: Tensor, bind: bool = True) -> list[str]:
    """Put the rectangles of data (a run of a stage tensor's elements from start) under fqn.format(key) as Chunks
    (the views themselves, or only their geometry when not bind); returns the keys touched, in order."""
    keys = []
    for key, offsets, view in place.boxes(start, data):
        name = fqn.format(key)
        if name not in flat:
            flat[name] = Chunks(place.full_shape, view.dtype)
        flat[name].add(offsets, tuple(view.shape), view if bind else None)
        keys.append(key)
    return keys


@dataclass
class TrainState:
    """What one rank checkpoints: its stages, its ZeRO-1 optimizer, the LR scheduler, the data sampler, the
    spike guard."""

    stages: list[nn.Module]
    optimizer: ZeroOptimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data: object  # launch.data.feed.DataFeed (state_dict / load_state_dict of its integer position; it refuses others)
    guard: StepGuard | None = None
    window: object | None = None  # launch.train.step.ReplicaWindow: the redundant experts' load window

    def small_states(self) -> dict[str, object]:
        """The small stateful parts saved under their own prefix (state_dict / load_state_dict of whole tensors,
        the same on every rank): guard/ (the spike guard's history), window/ (the redundant experts' load window).
        A checkpoint without a part's keys restores that part to its state as it is."""
        return {name: part for name, part in (("guard", self.guard), ("window", self.window)) if part is not None}

    @functools.cached_property
    def places(self) -> dict[str, Placement]:
        """Stage-local name -> where its elements sit among the single-process keys."""
        return placements(self.stages)

    @functools.cached_property
    def names(self) -> dict[int, str]:
        """id(param) -> stage-local name."""
        return {id(p): name for stage in self.stages for name, p in stage.named_parameters()}

    def loose(self) -> list[tuple[str, Tensor]]:
        """Stage tensors ZeRO-1 does not hold (buffers such as router biases): saved and loaded whole."""
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        return [(name, t.detach()) for stage in self.stages for name, t in stage.state_dict(keep_vars=True).items()
                if id(t) not in held]

    def to_flat(self, step: int, config: dict) -> dict[str, object]:
        """This rank's DCP state dict: its ZeRO-1 pieces of every param (views of the live tensors: no copy,
        no collective), its buffers and the small state (sampler, schedule, step, config, guard, RNG)."""
        flat: dict[str, object] = {}
        for piece in self.optimizer.pieces():
            place = self.places[self.names[id(piece.param)]]
            keys = _add(flat, "model/{}", place, piece.start, _param_values(piece))
            for kind, view in piece.state.items():
                if kind != MASTER_KEY or view.dtype != piece.param.dtype:  # an fp32 param is its own master
                    _add(flat, f"optim/{{}}/{kind}", place, piece.start, view)
            for kind, value in piece.scalars.items():
                flat.update({f"optim/{key}/{kind}": value for key in keys})
        for name, tensor in self.loose():
            _add(flat, "model/{}", self.places[name], 0, tensor.view(-1))
        for key, value in self.data.state_dict().items():
            flat[f"data/{key}"] = torch.tensor(value, dtype=torch.int64)
        flat["sched/last_epoch"] = torch.tensor(self.scheduler.last_epoch)
        flat["meta/step"] = torch.tensor(step)
        flat["meta/config"] = config
        for prefix, part in self.small_states().items():
            flat.update({f"{prefix}/{k}": v for k, v in part.state_dict().items()})
        flat[f"rng/rank{dist.get_rank():05d}"] = torch.get_rng_state()
        return flat

    def read_request(self, metadata: Metadata, restore_data: bool, bind: bool) -> tuple[dict[str, object], list[Piece]]:
        """(what this rank reads from a checkpoint, its pieces): the rectangles of its pieces and buffers and
        the small state. With bind, the optimizer's state is first reset to the checkpoint's entries and the
        rectangles are views of the live tensors DCP reads into; without, only their geometry (for planning)."""
        saved = metadata.state_dict_metadata
        pieces = self.optimizer.pieces()
        elementwise, scalars = _saved_kinds(saved, self.places, self.names, pieces)
        ema = EMA_KEY in elementwise and self.optimizer.ema is not None  # else the EMA restarts from the masters
        elementwise = [kind for kind in elementwise if kind != EMA_KEY]  # not the inner optimizers' state
        if bind:
            self.optimizer.reset_state(elementwise, {k: torch.zeros(m.size, dtype=m.properties.dtype)
                                                     for k, m in scalars.items()})
            pieces = self.optimizer.pieces()
            _warn_converted(saved, self.places, self.names, pieces, elementwise)
        wanted: dict[str, object] = {}
        for piece in pieces:
            place = self.places[self.names[id(piece.param)]]
            master = piece.state[MASTER_KEY]
            own = master.dtype == piece.param.dtype
            first = _add(wanted, "model/{}" if own else f"optim/{{}}/{MASTER_KEY}", place, piece.start, master,
                         bind)[0]
            for kind in elementwise + [EMA_KEY] * ema:
                _add(wanted, f"optim/{{}}/{kind}", place, piece.start, piece.state[kind] if bind else master, bind)
            for kind, meta in scalars.items():
                wanted[f"optim/{first}/{kind}"] = torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, tensor in self.loose():
            _add(wanted, "model/{}", self.places[name], 0, tensor.view(-1), bind)
        if "data/generator" in saved and restore_data:
            raise ValueError("the checkpoint holds the sampler state of an older version (a shuffled order, "
                             "not an epoch and cursor): this version cannot continue its data order")
        keys = [*(f"data/{key}" for key in self.data.state_dict() if restore_data), "sched/last_epoch", "meta/step",
                f"rng/rank{dist.get_rank():05d}"]
        for key in keys:
            if key in saved:
                wanted[key] = torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
        for prefix, part in self.small_states().items():
            wanted.update({f"{prefix}/{k}": v for k, v in part.state_dict().items() if f"{prefix}/{k}" in saved})
        for key, value in wanted.items():
            meta = saved.get(key)
            if key.startswith(("model/", "optim/")) and (not isinstance(meta, TensorStorageMetadata)
                                                        or meta.size != value.size()):
                raise ValueError(f"the checkpoint has no tensor {key!r} of shape {tuple(value.size())}: it was "
                                 f"saved from another model ([model] section) than this run's")
        return wanted, pieces

    def restore(self, wanted: dict[str, object], pieces: list[Piece], restore_data: bool) -> int:
        """After DCP read `wanted` (bound): the optimizer's scalars, the params gathered from the masters (a
        collective), the schedule, sampler, guard and RNG; returns the checkpoint's step."""
        for piece in pieces:
            first = _first_key(self.places[self.names[id(piece.param)]], piece)
            for kind, value in piece.scalars.items():
                value.copy_(wanted[f"optim/{first}/{kind}"])
        self.optimizer.gather_params()
        if self.optimizer.ema is not None and not any(key.endswith(f"/{EMA_KEY}") for key in wanted):
            warnings.warn("the checkpoint holds no weight EMA (saved with optim.ema_decay = 0.0): the EMA starts from "
                          "the loaded weights", stacklevel=2)
            self.optimizer.ema.reset()
        epoch = int(wanted["sched/last_epoch"])
        self.scheduler.last_epoch = epoch
        for group, base, rule in zip(self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            group["lr"] = base * rule(epoch)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if restore_data:
            self.data.load_state_dict({key[5:]: int(value) for key, value in wanted.items() if key.startswith("data/")})
        for prefix, part in self.small_states().items():
            part.load_state_dict({k: wanted.get(f"{prefix}/{k}", v) for k, v in part.state_dict().items()})
        rng = wanted.get(f"rng/rank{dist.get_rank():05d}")
        if rng is not None:
            torch.set_rng_state(rng)
        return int(wanted["meta/step"])


def _param_values(piece: Piece) -> Tensor:
    """A piece's run of its param's values: the master where it has the param's dtype (the param itself, or under
    ZeRO-3 its copy while the param is freed), else the param's own elements (a bf16 param freed by ZeRO-3: a
    cast of the master)."""
    master = piece.state[MASTER_KEY]
    if master.dtype == piece.param.dtype:
        return master
    if piece.param.untyped_storage().nbytes() == 0:
        return master.to(piece.param.dtype)
    return piece.param.detach().view(-1)[piece.start:piece.start + piece.length]


def _warn_converted(saved: dict, places: dict[str, Placement], names: dict[int, str], pieces: list[Piece],
                    elementwise: list[str]) -> None:
    """One warning when the checkpoint stores optimizer-state kinds in another dtype than this run keeps them (AdamW's
    moments saved under another optim.moment_dtype): they are converted as they are read."""
    if not pieces:
        return
    prefix = f"optim/{_first_key(places[names[id(pieces[0].param)]], pieces[0])}/"
    converted = {kind: saved[prefix + kind].properties.dtype for kind in elementwise
                 if saved[prefix + kind].properties.dtype != pieces[0].state[kind].dtype}
    if converted:
        kinds = ", ".join(sorted(converted))
        warnings.warn(f"the checkpoint stores {kinds} in {next(iter(converted.values()))}, this run keeps them in "
                      f"{pieces[0].state[next(iter(converted))].dtype} (optim.moment_dtype): converted on load",
                      stacklevel=3)


def _first_key(place: Placement, piece: Piece) -> str:
    """The first single-process key a piece has elements of."""
    return next(place.boxes(piece.start, piece.state[MASTER_KEY]))[0]


def _saved_kinds(saved: dict, places: dict[str, Placement], names: dict[int, str], pieces: list[Piece]
                 ) -> tuple[list[str], dict[str, TensorStorageMetadata]]:
    """(elementwise optimizer-state kinds, scalar kinds -> their metadata) the checkpoint holds for these pieces'
    params (those of the first piece's key: one optimizer class for all); none for a checkpoint without state."""
    if not pieces:
        return [], {}
    place = places[names[id(pieces[0].param)]]
    prefix = f"optim/{_first_key(place, pieces[0])}/"
    elementwise, scalars = [], {}
    for key, meta in saved.items():
        if key.startswith(prefix) and key.count("/") == prefix.count("/"):
            kind = key[len(prefix):]
            if kind == MASTER_KEY:
                continue
            if tuple(meta.size) == place.full_shape:
                elementwise.append(kind)
            else:
                scalars[kind] = meta
    return sorted(elementwise), scalars


class CheckpointRefused(RankRefusal):
    """No checkpoint can be loaded (a required resume), or the checkpoint is of another model: the message names
    each candidate and why."""


class Checkpointer:
    """Saves and loads one run's sharded checkpoints under root; create it on every rank at once."""

    def __init__(self, root: str | Path, keep: int = 3, asynchronous: bool = False, run_id: str | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep = {keep} must be >= 1 (checkpoints kept on disk)")
        self.root = Path(root)
        self.keep = keep
        self.asynchronous = asynchronous
        self.run_id = run_id  # recorded in each manifest; retention deletes only this run's checkpoints (rank 0's)
        self.group = dist.new_group(backend="gloo")  # DCP's planning collectives, off the training groups
        self.stager = HostStager() if asynchronous else None
        self._pending: tuple[Future, Writer, Path, int, dict, int] | None = None

    def save(self, state: TrainState, step: int, config: dict) -> None:
        """Write step's checkpoint (every rank); returns once it is published, or, when asynchronous, once this
        rank's pieces are copied to host buffers (DCP writes them on its thread; published at the next save or
        at finish())."""
        self.finish()
        flat = state.to_flat(step, config)
        tmp = self.root / f".step{step:08d}.tmp"
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(self.group)
        writer = Writer(str(tmp), lambda files: file_table(tmp, files))
        needed = sum(v.nbytes for v in flat.values() if isinstance(v, Tensor | Chunks))
        if self.asynchronous:
            with _space_for(tmp, step, needed):
                future = dcp.async_save(flat, storage_writer=writer, planner=SavePlanner(), process_group=self.group,
                                        async_stager=self.stager)
            self.stager.saving = future  # it reads the stager's buffers until done
            self._pending = (future, writer, tmp, step, config, needed)
        else:
            with _space_for(tmp, step, needed):
                dcp.save(flat, storage_writer=writer, planner=SavePlanner(), process_group=self.group)
            self._publish(tmp, step, writer.result, config)

    def finish(self) -> None:
        """Wait for an asynchronous save in flight and publish it (every rank)."""
        if self._pending is not None:
            future, writer, tmp, step, config, needed = self._pending
            self._pending = None
            with _space_for(tmp, step, needed):
                future.result()
            self._publish(tmp, step, writer.result, config)

    def _publish(self, tmp: Path, step: int, table: dict[str, list[int]], config: dict) -> None:
        """Gather every rank's file table (bytes, CRC-32 of the files it wrote) on rank 0, which publishes the
        folder (launch.checkpoint.manifest.publish); one gather and one barrier per rank."""
        tables = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(table, tables, dst=0, group=self.group)
        if tables is not None:
            publish(tmp, self.root, step, {k: v for t in tables for k, v in t.items()}, self.keep, self.run_id, config)
        dist.barrier(self.group)

    def load(self, state: TrainState, restore_data: bool = True, required: bool = False) -> int:
        """Restore state from the newest checkpoint every rank finds valid (any layout); returns its step, 0 when
        none (required: CheckpointRefused naming each candidate and why it was refused). Each rank checks only the
        files it reads; one all-reduce per candidate folder agrees on it."""
        self.finish()
        reasons: dict[str, str | None] = {}
        for step, folder in published(self.root):
            reader = Reader(str(folder))
            reason, fatal = self._check(folder, reader, state, restore_data)
            if self._agree(step, folder, reason, fatal):
                wanted, pieces = state.read_request(reader.read_metadata(), restore_data, bind=True)
                dcp.load(wanted, storage_reader=reader, planner=LoadPlanner(), process_group=self.group)
                return state.restore(wanted, pieces, restore_data)
            reasons[str(folder)] = reason
        self._agree(-1, None, None, False)  # every rank is out of candidates at once
        if required:
            raise CheckpointRefused(self._no_checkpoint(reasons))
        return 0

    def _no_checkpoint(self, reasons: dict[str, str | None]) -> str:
        """The refusal of a required load: each candidate with the first reason any rank gave (one all-gather)."""
        tables: list[dict[str, str | None]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(tables, reasons, group=self.group)
        if not reasons:
            where = "none was published" if self.root.is_dir() else "the folder does not exist"
            return f"--resume: no checkpoint under {self.root} ({where})"
        why = {folder: next((t[folder] for t in tables if t.get(folder)), "refused") for folder in reasons}
        return (f"--resume: no valid checkpoint under {self.root}; each candidate was refused: "
                + "; ".join(f"{folder}: {reason}" for folder, reason in why.items()))

    @staticmethod
    def _check(folder: Path, reader: Reader, state: TrainState, restore_data: bool) -> tuple[str | None, bool]:
        """(why this rank cannot load folder: its manifest, .metadata or a file it would read is bad, or None;
        whether the checkpoint is of another model, which stops the run instead of falling back)."""
        reason = verify(folder, [".metadata"])
        if reason is not None:
            return reason, False
        metadata = reader.read_metadata()
        try:
            wanted, _ = state.read_request(metadata, restore_data, bind=False)
        except ValueError as error:
            return str(error), True
        return verify(folder, files_read(wanted, metadata)), False

    def _agree(self, step: int, folder: Path | None, reason: str | None, fatal: bool) -> bool:
        """Whether every rank can load this candidate (one all-reduce); refusals are reported by the ranks that
        found them, a checkpoint of another model raises everywhere."""
        if reason is not None:
            print(f"checkpoint {folder} refused by rank {dist.get_rank()}: {reason}; trying the previous one",
                  file=sys.stderr, flush=True)
        verdict = torch.tensor([reason is not None, fatal, step, -step], dtype=torch.int64)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=self.group)
        bad, fatal_anywhere, newest, oldest = verdict.tolist()
        if newest != -oldest:
            raise RuntimeError(f"ranks see different checkpoints under {self.root} (steps {-oldest}..{newest} "
                               f"at the same position): is the folder shared by every rank?")
        if fatal_anywhere:
            raise CheckpointRefused(reason if fatal else f"checkpoint {folder} does not fit this model (see the rank "
                                                  f"that refused it)")
        return not bad


@contextlib.contextmanager
def _space_for(tmp: Path, step: int, needed: int) -> Iterator[None]:
    """A save that runs out of disk space ends as a DiskFull naming the step folder and about the bytes this rank
    needed; the unpublished folder is removed (the latest published checkpoint stays the one a resume continues).
    Out of space: ENOSPC (also inside DCP's CheckpointException), or any failure while the folder's filesystem has
    fewer than needed bytes free (torch.save's writer reports a short write as "unexpected pos")."""
    try:
        yield
    except BaseException as error:
        if not (disk_full(error) or (isinstance(error, Exception | CheckpointException)
                                     and (free_bytes(tmp) or needed) < needed)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        latest = next(iter(published(tmp.parent)), None)
        took = sum(f.stat().st_size for f in latest[1].iterdir()) if latest else 0
        raise DiskFull(tmp, needed, f"saving checkpoint step {step} into", " by this rank's tensors" + (
            f" (the latest checkpoint, {latest[1]}, takes {took:,} bytes in all)" if latest else "")) from None


def checkpoint_folder(path: str | Path) -> Path:
    """The step folder path names, checked as a resume checks it (manifest, every file's size and CRC-32): path
    itself, or a run's checkpoint root's latest valid one. ValueError naming the file that fails."""
    path = Path(path)
    if (path / MANIFEST).is_file() or (path / ".metadata").is_file() or STEP_DIR.match(path.name):
        reason = verify(path)
        if reason is not None:
            raise ValueError(f"checkpoint {path} cannot be read: {reason}")
        return path
    folder = latest_valid(path)
    if folder is None:
        raise ValueError(f"no valid checkpoint under {path}")
    return folder


def consolidate(path: str | Path, weights: str = "model") -> dict[str, Tensor]:
    """The single-process MoETransformer state dict of a checkpoint (a step folder, or a run's checkpoint
    root: its latest valid one), experts stacked back in id order; no process group needed. weights "ema": each
    parameter's weight EMA (optim/KEY/ema, kept by optim.ema_decay) in the parameter's dtype instead of its value
    (buffers, which have none, as saved)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights = {weights!r} is not allowed; choose one of {', '.join(map(repr, WEIGHTS))}")
    folder = checkpoint_folder(path)
    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    models = {k: m for k, m in metadata.items() if k.startswith("model/") and isinstance(m, TensorStorageMetadata)}
    source = {k: k for k in models}
    if weights == EMA_KEY:
        source = {k: f"optim/{k.removeprefix('model/')}/{EMA_KEY}" for k in models}
        source = {k: e if e in metadata else k for k, e in source.items()}
        if source == {k: k for k in models}:
            raise ValueError(f"{folder} holds no weight EMA: it was saved by a run with optim.ema_decay = 0.0")
    wanted = {source[k]: torch.empty(metadata[source[k]].size, dtype=metadata[source[k]].properties.dtype)
              for k in models}
    dcp.load(wanted, checkpoint_id=str(folder), no_dist=True)
    wanted = {k: wanted[source[k]].to(m.properties.dtype) for k, m in models.items()}
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


def export(path: str | Path, out: str | Path, weights: str = "model") -> Path:
    """Write consolidate(path, weights) as one torch.save file that MoETransformer.load_state_dict takes. With
    model.vocab_multiple, embed.weight and lm_head.weight hold the padded vocab's rows (moe.vocab): a model of the same
    config loads them; an unpadded one takes their first model.vocab_size rows."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    torch.save(consolidate(path, weights), tmp)
    os.replace(tmp, out)
    return out


@cli("moe-train export")
def export_main(argv: list[str]) -> int:
    """`moe-train export CHECKPOINT OUT [--format torch|hf] [--weights model|ema]`: CHECKPOINT is a step folder or a run's checkpoint root."""
    import argparse

    parser = argparse.ArgumentParser(prog="moe-train export", description=export_main.__doc__)
    parser.add_argument("checkpoint", help="RUN_DIR/checkpoint (its latest valid step) or one stepNNNNNNNN folder")
    parser.add_argument("out", help="torch: file for the consolidated MoETransformer state dict (torch.save); "
                                    "hf: a new folder for a Hugging Face DeepSeek-V3 model (safetensors shards)")
    parser.add_argument("--format", choices=("torch", "hf"), default="torch", help="what to write (default torch)")
    parser.add_argument("--max-shard-bytes", type=int, help="hf: largest safetensors shard (default 5 GiB)")
    parser.add_argument("--weights", choices=WEIGHTS, default="model",
                        help="torch: the trained weights (default) or their EMA (saved by runs with optim.ema_decay)")
    args = parser.parse_args(argv)
    if args.max_shard_bytes is not None and (args.max_shard_bytes < 1 or args.format != "hf"):
        parser.error(f"--max-shard-bytes {args.max_shard_bytes}: allowed only with --format hf, as a positive number "
                     f"of bytes")
    if args.format == "hf" and args.weights != "model":
        raise ValueError("--weights ema writes --format torch only (allowed with hf: --weights model)")
    if args.format == "hf":
        from launch.checkpoint.hf.export import MAX_SHARD_BYTES, export_hub
        path = export_hub(checkpoint_folder(args.checkpoint), args.out, args.max_shard_bytes or MAX_SHARD_BYTES)
    else:
        path = export(args.checkpoint, args.out, args.weights)
    print(f"wrote {path}")
    return 0
