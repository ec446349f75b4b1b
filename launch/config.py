"""TOML run configs: [model], [train] and [data] sections, validated before any work starts."""

from __future__ import annotations

import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from moe.config import ModelConfig, check_choice, check_positive

DTYPES = ("float32", "bfloat16")


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
    dtype: str = "float32"
    run_dir: str = "runs/default"
    checkpoint_every: int = 0
    eval_every: int = 50
    eval_batches: int = 4

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "grad_accum_steps", "seq_len"):
            check_positive(name, getattr(self, name))
        for name in ("warmup_steps", "checkpoint_every", "seed", "eval_every", "eval_batches"):
            check_positive(name, getattr(self, name), minimum=0)
        for name in ("lr", "grad_clip"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} = {getattr(self, name)!r} must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio = {self.min_lr_ratio!r} must be in [0, 1]")
        check_choice("train.dtype", self.dtype, DTYPES)


@dataclass
class DataSettings:
    """Where the training text comes from: "stdlib" (Python's own sources) or a file/folder path."""

    corpus: str = "stdlib"
    max_bytes: int = 4_000_000
    eval_fraction: float = 0.02

    def __post_init__(self) -> None:
        check_positive("data.max_bytes", self.max_bytes)
        if not 0 <= self.eval_fraction < 0.5:
            raise ValueError(f"data.eval_fraction = {self.eval_fraction!r} must be in [0, 0.5)")
        if self.corpus != "stdlib" and not Path(self.corpus).exists():
            raise ValueError(f"data.corpus = {self.corpus!r}: no such file or folder "
                             f"(give a path to text files, or \"stdlib\" for the shipped default)")


@dataclass
class RunConfig:
    """A whole run: model shape, training loop and data."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainSettings = field(default_factory=TrainSettings)
    data: DataSettings = field(default_factory=DataSettings)

    def __post_init__(self) -> None:
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len = {self.train.seq_len} must be <= model.max_seq_len = "
                             f"{self.model.max_seq_len}")
        if self.model.ep_size != 1:
            raise ValueError(f"model.ep_size = {self.model.ep_size}: moe-train runs one process, so the allowed "
                             "value is 1 (expert parallelism runs under dispatch.EPDispatcher, not yet in moe-train)")


SECTIONS = {"model": ModelConfig, "train": TrainSettings, "data": DataSettings}


def _accepted_types(hint: object) -> tuple[type, ...]:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
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


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML file, apply "section.key=value" overrides, validate and build the RunConfig."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    with path.open("rb") as handle:
        raw = tomllib.load(handle)
    for override in overrides:
        section, key, value = parse_override(override)
        raw.setdefault(section, {})[key] = value
    return build_config(raw)
