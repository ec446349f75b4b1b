"""TOML run configs: [model], [train], [data] and [parallel] sections, validated before any work starts."""

from __future__ import annotations

import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dispatch.choices import allowed_values, check_choice
from dispatch.dispatcher import Payload
from dispatch.routes import DispatchBackend
from launch.parallel.device import CommBackend, Device
from launch.config.ops import OpsSettings
from kernels.quant_ref import ALIGN as FP8_ALIGN
from launch.parallel.mesh import Layout
from moe.config import ModelConfig, check_positive
from moe.cp import CpMethod
from moe.recompute import Recompute
from optim.zero1 import ZeroStage
from pipeline.schedules import ScheduleName, min_chunks
from moe.tp import check_tp_shapes

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
    split_bw: bool = True
    merge_w: int = 1
    overlap: bool = True
    overlap_grad_reduce: bool = True
    dispatch_backend: DispatchBackend = "flat"
    dispatch_payload: Payload = "bf16"
    dispatch_chunks: int = 1
    comm_backend: CommBackend = "auto"

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "ep", "cp", "merge_w", "dispatch_chunks"):
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


def _check_optim(cfg: "RunConfig") -> None:
    """Layouts the ZeRO stages do not run: ZeRO-2 frees each full grad bucket once reduced over DP, so it needs the
    reduction inside the backward and no TP-partial grads still to be summed over TP after it; ZeRO-3's gathers
    and reductions share the DP group, so a pipeline must not run a backward beside a forward (parallel.overlap)."""
    optim, par = cfg.optim, cfg.parallel
    if optim.zero_stage >= 2 and not par.overlap_grad_reduce:
        raise ValueError(f"optim.zero_stage = {optim.zero_stage} reduce-scatters grads during every backward: "
                         f"parallel.overlap_grad_reduce must be true (allowed with false: optim.zero_stage = 1)")
    if optim.zero_stage >= 2 and par.tp > 1:
        raise ValueError(f"optim.zero_stage = {optim.zero_stage} does not run with parallel.tp = {par.tp} (TP-partial "
                         f"grads are summed over TP after the backward): allowed optim.zero_stage = 1, or parallel.tp = 1")
    if optim.offload != "none" and optim.zero_stage == 3:
        raise ValueError(f"optim.offload = {optim.offload!r} does not run with optim.zero_stage = 3 (its params are "
                         f"gathered from device masters): allowed optim.zero_stage = 1 or 2, or optim.offload = 'none'")
    if optim.zero_stage == 3 and par.pp > 1 and par.overlap:
        raise ValueError("optim.zero_stage = 3 with parallel.pp > 1 gathers params in the forward and the backward on "
                         "one group: parallel.overlap must be false (allowed with overlap: optim.zero_stage = 1 or 2)")


@dataclass
class RunConfig:
    """A whole run: model shape, training loop, data, layout and operations (checkpoints, faults)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainSettings = field(default_factory=TrainSettings)
    data: DataSettings = field(default_factory=DataSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    ops: OpsSettings = field(default_factory=OpsSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)

    def __post_init__(self) -> None:
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len = {self.train.seq_len} must be <= model.max_seq_len = "
                             f"{self.model.max_seq_len}")
        par, model = self.parallel, self.model
        if model.num_experts % par.ep:
            allowed = [d for d in range(1, par.stage_ranks + 1) if par.stage_ranks % d == 0 and model.num_experts % d == 0]
            raise ValueError(f"parallel.ep = {par.ep} must divide model.num_experts = {model.num_experts} "
                             f"(allowed with dp x cp x tp = {par.stage_ranks}: {', '.join(map(str, allowed))})")
        if par.cp > 1 and self.train.seq_len % (2 * par.cp):
            raise ValueError(f"train.seq_len = {self.train.seq_len} must be divisible by 2 x parallel.cp = {2 * par.cp} "
                             f"(each sequence is cut into 2 x cp zig-zag chunks)")
        if model.num_layers < par.num_stages:
            raise ValueError(f"model.num_layers = {model.num_layers} is fewer than the {par.num_stages} pipeline "
                             f"stages of parallel.pp = {par.pp} with schedule {par.schedule!r} (allowed: "
                             f"model.num_layers >= {par.num_stages}, or a smaller parallel.pp)")
        if self.train.grad_accum_steps % par.dp:
            raise ValueError(f"train.grad_accum_steps = {self.train.grad_accum_steps} (micro-batches per step, "
                             f"global) must be a multiple of parallel.dp = {par.dp}")
        per_rank = self.train.grad_accum_steps // par.dp
        chunks = par.num_chunks or per_rank
        if per_rank % chunks:
            raise ValueError(f"parallel.num_chunks = {chunks} must divide the {per_rank} micro-batches each DP rank "
                             f"runs per step (train.grad_accum_steps / parallel.dp)")
        minimum = 1 if par.schedule == "none" else min_chunks(par.schedule, par.pp)
        if chunks < minimum or (par.schedule == "dualpipe" and chunks % 2):
            even = " and even" if par.schedule == "dualpipe" else ""
            raise ValueError(f"parallel.num_chunks = {chunks} is too small for schedule {par.schedule!r} with pp = "
                             f"{par.pp}: it needs >= {minimum}{even} chunks per pipeline step (raise "
                             f"train.grad_accum_steps or parallel.num_chunks)")

        hang = self.ops.inject_hang
        if hang and hang["rank"] >= par.world_size:
            raise ValueError(f"ops.inject_hang.rank = {hang['rank']} must be < the world size parallel.pp x dp x cp x tp = "
                             f"{par.world_size}")
        if self.train.recompute == "full" and (par.tp > 1 or par.cp > 1):
            raise ValueError(f"train.recompute = 'full' reruns attention in backward, which under parallel.tp = "
                             f"{par.tp} and parallel.cp = {par.cp} would issue its collectives again: with tp or cp > 1 "
                             f"use 'none' or 'selective'")
        check_tp_shapes(model, self.train.seq_len, par.tp, par.sequence_parallel, par.cp)
        _check_mtp(model, par)
        _check_document_mask(self.data, model, par)
        _check_optim(self)
        _check_fp8_sizes(model, par)
        layout = self.layout
        nodes = layout.ep_nodes()
        if nodes > 1 and layout.ep_gpus_per_node() and model.topk_groups < model.num_groups and model.num_groups % nodes:
            raise ValueError(f"model.num_groups = {model.num_groups} with model.topk_groups = {model.topk_groups}: the EP "
                             f"group spans {nodes} nodes, so node-limited routing needs each expert group inside one "
                             f"node: num_groups must be a multiple of {nodes} (e.g. {nodes}, one group per node)")

    @property
    def layout(self) -> Layout:
        """The rank layout of [parallel] (no communication)."""
        par = self.parallel
        return Layout(par.pp, par.dp, par.tp, par.ep, par.gpus_per_node, mirrored=par.schedule == "dualpipe",
                      cp=par.cp, hop_groups=par.dispatch_backend == "hierarchical" and par.ep > 1,
                      embed_copy=self.model.mtp_depth > 0 and par.pp > 1 and par.schedule not in ENDS_TOGETHER)

    @property
    def chunks_per_step(self) -> int:
        """Micro-batches one DP rank runs in one pipeline step."""
        return self.parallel.num_chunks or self.train.grad_accum_steps // self.parallel.dp


def _check_mtp(model: ModelConfig, par: ParallelSettings) -> None:
    """Multi-token prediction runs without CP, and its embedding copy (first and last stage on different pipeline
    ranks) is sharded by ZeRO-1 over a group of 2 x dp x cp ranks, which must divide the world."""
    if model.mtp_depth and par.cp > 1:
        raise ValueError(f"model.mtp_depth = {model.mtp_depth} does not run with parallel.cp = {par.cp}: "
                         f"set parallel.cp = 1 or model.mtp_depth = 0")
    if model.mtp_depth and par.schedule not in ENDS_TOGETHER and par.pp > 1 and par.pp % 2:
        raise ValueError(f"model.mtp_depth = {model.mtp_depth} with parallel.schedule = {par.schedule!r} needs an "
                         f"even parallel.pp (got {par.pp}): the last rank's embedding copy shares ZeRO-1 shards with "
                         f"the first's; choose an even pp or schedule 'dualpipev'")


def _check_document_mask(data: DataSettings, model: ModelConfig, par: ParallelSettings) -> None:
    """Document masking runs without context parallelism and without multi-token prediction."""
    if data.document_mask and par.cp > 1:
        raise ValueError(f"data.document_mask = true does not run with parallel.cp = {par.cp}: set parallel.cp = 1 "
                         f"or data.document_mask = false")
    if data.document_mask and model.mtp_depth:
        raise ValueError(f"data.document_mask = true does not run with model.mtp_depth = {model.mtp_depth}: set "
                         f"model.mtp_depth = 0 or data.document_mask = false")


def _check_fp8_sizes(model: ModelConfig, par: ParallelSettings) -> None:
    """FP8 payload rows and FP8 expert GEMM operands are e4m3 rows the GPU kernels read 16 bytes at a time
    (kernels.quant_ref.ALIGN): fp8 payload or fp8 experts need hidden_size, fp8 experts also expert_ffn_size,
    to be multiples of it."""
    fields = {"model.hidden_size": model.hidden_size} if "fp8" in (par.dispatch_payload, model.expert_precision) else {}
    if model.expert_precision == "fp8":
        fields["model.expert_ffn_size"] = model.expert_ffn_size
    for name, size in fields.items():
        if size % FP8_ALIGN:
            low = size // FP8_ALIGN * FP8_ALIGN
            raise ValueError(f"{name} = {size} must be a multiple of {FP8_ALIGN} with parallel.dispatch_payload = "
                             f"{par.dispatch_payload!r} and model.expert_precision = {model.expert_precision!r} "
                             f"(FP8 rows are read {FP8_ALIGN} bytes at a time; allowed e.g. {low or FP8_ALIGN}, "
                             f"{low + FP8_ALIGN}, or 'bf16' / 'native')")


SECTIONS = {"model": ModelConfig, "train": TrainSettings, "data": DataSettings, "parallel": ParallelSettings,
            "ops": OpsSettings, "optim": OptimSettings}


def _accepted_types(hint: object) -> tuple[type, ...]:
    """The Python types a TOML value of a field typed hint may have: a Literal's values' types, each member of a
    union, a generic's container (list for list[int]), and int where float is accepted."""
    if typing.get_origin(hint) is Literal:
        return tuple(dict.fromkeys(type(value) for value in typing.get_args(hint)))
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    args = tuple(typing.get_origin(arg) or arg for arg in args)
    return args + ((int,) if float in args else ())


def _check_section(name: str, values: dict, cls: type) -> None:
    known = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"unknown key {name}.{key}; allowed keys in [{name}]: {', '.join(known)}")
        accepted = _accepted_types(known[key])
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
            names = " or ".join(t.__name__ for t in accepted if t is not type(None))
            raise ValueError(f"{name}.{key} = {value!r} must be of type {names}")


def build_config(raw: dict) -> RunConfig:
    """Validate a parsed TOML document and build the RunConfig (errors name the field)."""
    for section in raw:
        if section not in SECTIONS:
            raise ValueError(f"unknown section [{section}]; allowed sections: {', '.join(SECTIONS)}")
    parts = {}
    for section, cls in SECTIONS.items():
        values = raw.get(section, {})
        _check_section(section, values, cls)
        try:
            parts[section] = cls(**values)
        except ValueError as error:
            raise ValueError(f"[{section}] {error}") from None
    return RunConfig(**parts)


def parse_override(text: str) -> tuple[str, str, object]:
    """Parse "section.key=value" (value in TOML syntax, bare words taken as strings)."""
    target, sep, value = text.partition("=")
    section, dot, key = target.strip().partition(".")
    if not sep or not dot:
        raise ValueError(f"override {text!r} must look like section.key=value")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return section, key, parsed


def read_toml(path: str | Path, seen: tuple[Path, ...] = ()) -> dict:
    """A TOML config as a dict; a top-level `base = "other.toml"` (relative to this file) is read
    first and this file's keys override its keys section by section."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    if path.resolve() in seen:
        raise ValueError(f"config file {str(path)!r} names itself as a base (through {', '.join(map(str, seen))})")
    with path.open("rb") as handle:
        raw = tomllib.load(handle)
    _resolve_data_paths(raw.get("data"), path.parent)
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("init_from"), str) and model["init_from"]:
        model["init_from"] = str(path.parent / model["init_from"])  # relative to the config file, as data paths
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ValueError(f"base = {base!r} in {str(path)!r} must be a file name (string)")
    merged = read_toml(path.parent / base, (*seen, path.resolve()))
    for section, values in raw.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
        else:
            merged[section] = values
    return merged


def _resolve_data_paths(data: object, folder: Path) -> None:
    """data.tokenizer and the sources' paths written in a config file are relative to that file's folder."""
    if not isinstance(data, dict):
        return
    tokenizer = data.get("tokenizer")
    if isinstance(tokenizer, str) and tokenizer != "bytes":
        data["tokenizer"] = str(folder / tokenizer)
    for key in ("sources", "eval_sources"):
        for source in data.get(key, []) if isinstance(data.get(key), list) else []:
            if isinstance(source, dict) and isinstance(source.get("path"), str):
                source["path"] = str(folder / source["path"])


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML file (and its base), apply "section.key=value" overrides, validate and build the RunConfig."""
    raw = read_toml(path)
    for override in overrides:
        section, key, value = parse_override(override)
        raw.setdefault(section, {})[key] = value
    return build_config(raw)
