"""[train], [data], [parallel] and [optim]: the run's sections beside [model] (moe.config) and [ops]
(launch.config.ops), each checked on its own (checks across sections: launch.config.checks)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dispatch.choices import allowed_values, check_choice
from dispatch.dispatcher import Payload
from dispatch.topology import DispatchBackend
from launch.parallel.device import CommBackend, Device
from launch.parallel.mesh import Layout
from moe.config import ModelConfig, check_positive
from moe.cp import CpMethod
from moe.recompute import Recompute
from optim.zero1 import ZeroStage
from pipeline.schedules import ScheduleName

Dtype = Literal["float32", "bfloat16", "float64"]


@dataclass
class TrainSettings:
    """Optimisation and loop settings."""

    steps: int = 200
    micro_batch_size: int = 16
    grad_accum_steps: int = 1
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    dtype: Dtype = "float32"
    device: Device = "auto"  # "auto": CUDA when available (cuda:LOCAL_RANK per rank), else the CPU; "cuda"; "cpu"
    run_dir: str = "runs/default"
    checkpoint_every: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    peak_tflops_per_gpu: float = 0.0  # for MFU; 0: from the GPU's name (none on CPU)
    tensorboard: bool = False  # also write TensorBoard events to run_dir/tensorboard
    rank_metrics_every: int = 10  # steps between the records' per-rank sections (gathered to rank 0), and the last
    recompute: Recompute = "none"  # activation recomputation (moe.recompute): "none", "selective" (V3's) or "full"

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "grad_accum_steps", "seq_len", "rank_metrics_every"):
            check_positive(name, getattr(self, name))
        for name in ("warmup_steps", "checkpoint_every", "seed", "eval_every", "eval_batches"):
            check_positive(name, getattr(self, name), minimum=0)
        for name in ("lr", "grad_clip"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} = {getattr(self, name)!r} must be > 0")
        if self.peak_tflops_per_gpu < 0:
            raise ValueError(f"train.peak_tflops_per_gpu = {self.peak_tflops_per_gpu!r} must be >= 0 (0: from the GPU)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio = {self.min_lr_ratio!r} must be in [0, 1]")
        check_choice("train.dtype", self.dtype, Dtype)
        check_choice("train.device", self.device, Device)
        check_choice("train.recompute", self.recompute, Recompute)


@dataclass
class DataSettings:
    """Where the training tokens come from: data.sources (datasets `moe-data prepare` made, blended by weight), or
    data.corpus ("stdlib" = Python's own sources, or a text file/folder) prepared into the run directory."""

    corpus: str = "stdlib"
    max_bytes: int = 4_000_000  # the corpus's tokens are cut here (bytes, with the byte tokenizer)
    eval_fraction: float = 0.02  # the corpus's held-out tail
    # A compact block: the prepared-data path (launch.data.feed, launch.data.shards). Paths written in a config file are
    # relative to that file.
    tokenizer: str = "bytes"  # "bytes", a tokenizer.json, or a Hugging Face model folder holding one
    sources: list = field(default_factory=list)  # [{path = PREPARED_FOLDER, weight = W}, ...]; replaces corpus
    eval_sources: list = field(default_factory=list)  # [{path = PREPARED_FOLDER}, ...]: held-out data of sources
    prefetch_steps: int = 1  # steps whose rows a background thread reads ahead (0: read when first used)
    # Attention, RoPE positions and the loss stay inside each document: rows split after every EOS of data.tokenizer
    # (moe.documents; Megatron's reset_attention_mask + reset_position_ids + eod_mask_loss)
    document_mask: bool = False

    def __post_init__(self) -> None:
        check_positive("data.max_bytes", self.max_bytes)
        check_positive("data.prefetch_steps", self.prefetch_steps, minimum=0)
        if not 0 <= self.eval_fraction < 0.5:
            raise ValueError(f"data.eval_fraction = {self.eval_fraction!r} must be in [0, 0.5)")
        if self.corpus != "stdlib" and not Path(self.corpus).exists():
            raise ValueError(f"data.corpus = {self.corpus!r}: no such file or folder "
                             f"(give a path to text files, or \"stdlib\" for the shipped default)")
        train = [_check_source("data.sources", i, s, ("path", "weight")) for i, s in enumerate(self.sources)]
        held = [_check_source("data.eval_sources", i, s, ("path",)) for i, s in enumerate(self.eval_sources)]
        if self.eval_sources and not self.sources:
            raise ValueError("data.eval_sources needs data.sources (the corpus holds out data.eval_fraction itself)")
        for i, path in enumerate(held):
            if path in train:
                raise ValueError(f"data.eval_sources[{i}].path = {self.eval_sources[i]['path']!r} is also a training "
                                 f"source (data.sources[{train.index(path)}]): held-out data must differ")

    @property
    def has_held_out(self) -> bool:
        """Whether the run has held-out data: data.eval_sources, or the corpus's data.eval_fraction."""
        return bool(self.eval_sources) if self.sources else self.eval_fraction > 0


def _check_source(field_name: str, index: int, source: object, keys: tuple[str, ...]) -> Path:
    """A source table {path, weight}: its keys, a path to an existing folder, a finite weight > 0; its resolved path."""
    name = f"{field_name}[{index}]"
    if not isinstance(source, dict):
        raise ValueError(f"{name} = {source!r} must be a table {{{', '.join(f'{k} = ...' for k in keys)}}}")
    for key in keys:
        if key not in source:
            raise ValueError(f"{name}.{key} is missing (each entry gives {', '.join(keys)})")
    for key in source:
        if key not in keys:
            raise ValueError(f"unknown key {name}.{key}; allowed: {', '.join(keys)}")
    if not isinstance(source["path"], str) or not Path(source["path"]).is_dir():
        raise ValueError(f"{name}.path = {source['path']!r}: no such folder (a dataset `moe-data prepare` made)")
    weight = source.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{name}.weight = {weight!r} must be a finite number > 0")
    return Path(source["path"]).resolve()


Schedule = Literal["none", ScheduleName]  # "none": no pipeline (parallel.pp = 1)
ENDS_TOGETHER = ("dualpipev", "dualpipe")  # schedules placing the first and the last stage on one rank


@dataclass
class ParallelSettings:
    """The layout: world = pp x dp x cp x tp ranks (TP innermost, then CP, DP, PP); EP folded over a stage's
    dp x cp x tp ranks.

    gpus_per_node 0 puts every rank on one node; num_chunks 0 runs all of a DP rank's
    micro-batches in one pipeline step. Experts are replicated over dp * cp * tp / ep ranks. cp splits each
    sequence over cp ranks in zig-zag chunks (moe.cp; cp_method "ring" or "allgather"); CP ranks are data
    replicas for gradient sums.
    dispatch_chunks > 1 pipelines the hierarchical dispatch's two hops in that many chunks of tokens.
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    cp_method: CpMethod = "ring"
    sequence_parallel: bool = False
    gpus_per_node: int = 0
    schedule: Schedule = "none"
    num_chunks: int = 0
    defer_weight_grads: bool = True
    chunks_per_weight_grad: int = 1
    overlap_fb_pairs: bool = True
    overlap_grad_reduce: bool = True
    dispatch_backend: DispatchBackend = "flat"
    dispatch_payload: Payload = "bf16"
    dispatch_chunks: int = 1
    comm_backend: CommBackend = "auto"

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "ep", "cp", "chunks_per_weight_grad", "dispatch_chunks"):
            check_positive(f"parallel.{name}", getattr(self, name))
        check_choice("parallel.cp_method", self.cp_method, CpMethod)
        for name in ("gpus_per_node", "num_chunks"):
            check_positive(f"parallel.{name}", getattr(self, name), minimum=0)
        check_choice("parallel.schedule", self.schedule, Schedule)
        check_choice("parallel.dispatch_backend", self.dispatch_backend, DispatchBackend)
        check_choice("parallel.dispatch_payload", self.dispatch_payload, Payload)
        check_choice("parallel.comm_backend", self.comm_backend, CommBackend)
        if self.dispatch_chunks > 1 and self.dispatch_backend != "hierarchical":
            raise ValueError(f"parallel.dispatch_chunks = {self.dispatch_chunks} pipelines the two hops of "
                             f"parallel.dispatch_backend = 'hierarchical'; with {self.dispatch_backend!r} allowed: 1")
        if (self.pp == 1) != (self.schedule == "none"):
            allowed = "'none'" if self.pp == 1 else ", ".join(map(repr, allowed_values(ScheduleName)))
            raise ValueError(f"parallel.schedule = {self.schedule!r} with parallel.pp = {self.pp}: allowed {allowed}")
        if self.schedule == "dualpipe" and self.pp % 2:
            raise ValueError(f"parallel.pp = {self.pp}: schedule 'dualpipe' needs an even pp (allowed: 2, 4, 6, ...)")
        if self.stage_ranks % self.ep:
            allowed = [d for d in range(1, self.stage_ranks + 1) if self.stage_ranks % d == 0]
            raise ValueError(f"parallel.ep = {self.ep} must divide dp x cp x tp = {self.stage_ranks} "
                             f"(allowed: {', '.join(map(str, allowed))})")
        if self.gpus_per_node and self.world_size % self.gpus_per_node:
            allowed = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise ValueError(f"parallel.gpus_per_node = {self.gpus_per_node} must divide the world size "
                             f"pp x dp x cp x tp = {self.world_size} (allowed: 0, {', '.join(map(str, allowed))})")

    @property
    def stage_ranks(self) -> int:
        """Ranks holding one pipeline stage (dp x cp x tp): the EP groups fold over them."""
        return self.dp * self.cp * self.tp

    @property
    def world_size(self) -> int:
        """Ranks the layout needs."""
        return self.pp * self.stage_ranks

    @property
    def num_stages(self) -> int:
        """Pipeline stages the model is split into (DualPipeV: two per rank)."""
        return 2 * self.pp if self.schedule == "dualpipev" else self.pp

    def chunks_per_step(self, grad_accum_steps: int) -> int:
        """Micro-batches one DP rank runs in one pipeline step, of train.grad_accum_steps over all DP ranks."""
        return self.num_chunks or grad_accum_steps // self.dp

    def layout(self, model: ModelConfig) -> Layout:
        """The rank layout of these settings for model (its MTP modules may need an embedding copy on the last
        stage's rank; no communication)."""
        return Layout(self.pp, self.dp, self.tp, self.ep, self.gpus_per_node, mirrored=self.schedule == "dualpipe",
                      cp=self.cp, hop_groups=self.dispatch_backend == "hierarchical" and self.ep > 1,
                      embed_copy=model.mtp_depth > 0 and self.pp > 1 and self.schedule not in ENDS_TOGETHER)


Offload = Literal["none", "optimizer"]


@dataclass
class OptimSettings:
    """The distributed optimizer: zero_stage 1 shards the fp32 masters and AdamW moments over each param's
    replicas, 2 also the grads (reduce-scattered during every backward, full grads freed; optim.ZeRO1), 3 also the
    dense params (each module's gathered around its forward and backward, per micro-batch; optim.zero3).
    offload "optimizer" (ZeRO-Offload, stage 1 or 2) keeps the fp32 masters and AdamW moments in host memory and
    updates them there."""

    zero_stage: ZeroStage = 1
    offload: Offload = "none"

    def __post_init__(self) -> None:
        check_choice("optim.zero_stage", self.zero_stage, ZeroStage)
        check_choice("optim.offload", self.offload, Offload)

