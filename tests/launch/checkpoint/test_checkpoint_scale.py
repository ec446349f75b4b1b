"""A rank's checkpoint work (save, publish, load-verify) is constant in the world size: counted at 4, 64, 2048.

DCP's own I/O cannot run under the fake process group, so this harness runs the checkpoint code of one rank
of a fake world (torch's `fake` backend) with DCP's save and load replaced by stubs at their call sites: the
save stub runs DCP's local planning on the rank's state dict and writes the one file DCP would; the load
stub stops where DCP would start reading. It counts what the rank does: the rectangles and bytes it hands to
DCP, the files it opens, stat and directory-listing calls, the collectives it issues and the bytes it sends.
(DCP adds its own planning collectives, a gather to rank 0 and a scatter back, and one file per rank.)
Run with -s for the table.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import zlib
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.testing._internal.distributed.fake_pg import FakeStore

import launch.checkpoint.checkpointer as checkpoint
from launch.checkpoint.checkpointer import Checkpointer, TrainState
from launch.config.ops import OpsSettings
from launch.faults.guard import StepGuard
from optim import ZeroOptimizer

WORLDS = (4, 64, 2048)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
               "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
               "recv", "isend", "irecv")
COUNTS = ("rectangles", "dcp_bytes", "files", "stats", "listings", "collectives", "sent_bytes")


class Feed:
    """The sampler's checkpointed position (a stand-in for launch.data.feed.DataFeed)."""

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "cursor": 3}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class Stop(Exception):
    """Raised by the load stub where DCP would start reading."""


class Recorder:
    """Counts, per phase, the files opened, stats, listings and collectives (bytes sent) of this process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.phase = "setup"
        self.counts: dict[str, Counter] = {}
        self.opened: dict[str, set[str]] = {}
        original_open = Path.open

        def opened(path, *args, **kwargs):
            self.opened.setdefault(self.phase, set()).add(str(path))
            return original_open(path, *args, **kwargs)
        monkeypatch.setattr(Path, "open", opened)
        for module, name, kind in ((os, "stat", "stats"), (os, "listdir", "listings"), (os, "scandir", "listings")):
            monkeypatch.setattr(module, name, self._counting(getattr(module, name), kind))
        for name in COLLECTIVES:
            monkeypatch.setattr(dist, name, self._collective(getattr(dist, name)))

    def add(self, kind: str, n: int = 1) -> None:
        self.counts.setdefault(self.phase, Counter())[kind] += n

    def _counting(self, function, kind: str):
        def counted(*args, **kwargs):
            self.add(kind)
            return function(*args, **kwargs)
        return counted

    def _collective(self, function):
        def counted(*args, **kwargs):
            self.add("collectives")
            sent = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(sent, torch.Tensor):
                self.add("sent_bytes", sent.nbytes)
            elif sent is not None:
                self.add("sent_bytes", len(pickle.dumps(sent)))
            return function(*args, **kwargs)
        return counted

    def row(self, phase: str) -> dict[str, int]:
        counts = self.counts.get(phase, Counter())
        return {**{k: counts[k] for k in COUNTS}, "files": len(self.opened.get(phase, ()))}


def build_state() -> TrainState:
    """A 2-layer model under ZeRO-1 over the whole (fake) world, with AdamW state and a guard history."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256, bias=False))
    optimizer = ZeroOptimizer(list(stage.parameters()), torch.optim.AdamW, lr=1e-3)
    optimizer.reset_state(["exp_avg", "exp_avg_sq"], {"step": torch.tensor(7.0)})
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    guard = StepGuard(OpsSettings())
    guard.history.extend([5.0, 4.9, 4.8])
    return TrainState([stage], optimizer, scheduler, Feed(), guard)


def count_rank(world: int, rank: int, root: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, int]]:
    """Counts of rank's save (to_flat, barrier, DCP's local plan), publish and load-verify in a fake world."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with monkeypatch.context() as patch:
            state = build_state()
            patch.setattr(dist, "new_group", lambda **_: None)  # the fake backend has no gloo sub-group
            checkpointer = Checkpointer(root, keep=2)
            recorder = Recorder(patch)
            own = f"__{rank}_0.distcp"
            plans = []

            def save_stub(flat, storage_writer, planner, process_group):
                planner.set_up_planner(flat, is_coordinator=rank == 0)
                plan = planner.create_local_plan()
                plans.append(plan)
                recorder.add("rectangles", len(plan.items))
                nbytes = sum(math.prod(i.tensor_data.chunk.sizes) * i.tensor_data.properties.dtype.itemsize
                             for i in plan.items if i.tensor_data is not None)
                recorder.add("dcp_bytes", nbytes)
                folder = Path(storage_writer.path)
                folder.mkdir(parents=True, exist_ok=True)  # as DCP's writer does
                (folder / own).write_bytes(bytes(nbytes))
                if rank == 0:
                    (folder / ".metadata").write_bytes(b"metadata")
                storage_writer.result = storage_writer.written([own])
                recorder.phase = "publish"

            def load_stub(*args, **kwargs):
                raise Stop

            patch.setattr(checkpoint.dcp, "save", save_stub)
            patch.setattr(checkpoint.dcp, "load", load_stub)
            recorder.phase = "save"
            checkpointer.save(state, 7, {"model": {}})
            recorder.phase = "setup"
            folder = publish_as_rank0(root, 7, world, rank, plans[0])
            recorder.phase = "load-verify"
            with pytest.raises(Stop):
                checkpointer.load(state)
            assert recorder.opened["load-verify"] == {str(folder / n) for n in ("manifest.json", ".metadata", own)}
            return {phase: recorder.row(phase) for phase in ("save", "publish", "load-verify")}
    finally:
        dist.destroy_process_group()


def publish_as_rank0(root: Path, step: int, world: int, rank: int, plan) -> Path:
    """The folder rank 0 would have published: a manifest of every rank's file, .metadata naming this rank's
    file for its chunks (a global plan of its local plan), and this rank's file (no other rank's)."""
    folder = root / f"step{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    own = f"__{rank}_0.distcp"
    data = (root / f".step{step:08d}.tmp" / own)
    data = data if data.is_file() else folder / own
    (folder / own).write_bytes(data.read_bytes())
    plans, metadata = create_default_global_save_plan([plan])
    metadata.storage_data = {item.index: SimpleNamespace(relative_path=own) for item in plans[0].items}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    files = {f"__{r}_0.distcp": [1, 0] for r in range(world)}
    for name in (own, ".metadata"):
        files[name] = [(folder / name).stat().st_size, zlib.crc32((folder / name).read_bytes())]
    (folder / "manifest.json").write_text(json.dumps({"step": step, "files": files}))
    return folder


def test_per_rank_checkpoint_work_is_constant_in_the_world_size(tmp_path, monkeypatch, capsys):
    rows = {(world, rank): count_rank(world, rank, tmp_path / f"w{world}r{rank}", monkeypatch)
            for world in WORLDS for rank in (0, 1)}
    with capsys.disabled():
        print(f"\n{'world':>6} {'rank':>4} {'phase':<12}" + "".join(f"{k:>12}" for k in COUNTS))
        for (world, rank), phases in rows.items():
            for phase, counts in phases.items():
                print(f"{world:>6} {rank:>4} {phase:<12}" + "".join(f"{counts[k]:>12}" for k in COUNTS))
    for rank in (0, 1):
        small, *larger = [rows[world, rank] for world in WORLDS]
        for big in larger:
            for phase in ("publish", "load-verify"):
                assert {**big[phase], "sent_bytes": 0} == {**small[phase], "sent_bytes": 0}, (rank, phase)
                assert abs(big[phase]["sent_bytes"] - small[phase]["sent_bytes"]) <= 8  # the table's digits
            for key in ("files", "stats", "listings", "collectives", "sent_bytes"):
                assert big["save"][key] == small["save"][key], (rank, key)
            assert big["save"]["rectangles"] <= small["save"]["rectangles"]
            assert big["save"]["dcp_bytes"] < small["save"]["dcp_bytes"]
    one = rows[2048, 1]
    assert one["publish"]["collectives"] == 2 and one["load-verify"]["collectives"] == 1  # gather + barrier; agree
    assert one["save"]["files"] == 1 and one["publish"]["files"] == 0  # writes and checksums its own file only
    assert one["load-verify"]["files"] == 3 and one["publish"]["listings"] == 0
