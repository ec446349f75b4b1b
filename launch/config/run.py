"""TOML run configs: RunConfig holds the sections ([model], [train], [data], [parallel], [ops], [optim]), read from
a file (and its base) with overrides, validated before any work starts."""

from __future__ import annotations

import tomllib
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from launch.config.checks import check_sections
from launch.config.ops import OpsSettings
from launch.config.sections import DataSettings, OptimSettings, ParallelSettings, TrainSettings
from launch.parallel.mesh import Layout
from moe.config import ModelConfig


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
        check_sections(self.model, self.train, self.data, self.parallel, self.ops, self.optim)

    @property
    def layout(self) -> Layout:
        """The rank layout of [parallel] for [model] (no communication)."""
        return self.parallel.layout(self.model)

    @property
    def chunks_per_step(self) -> int:
        """Micro-batches one DP rank runs in one pipeline step."""
        return self.parallel.chunks_per_step(self.train.grad_accum_steps)


SECTIONS = {"model": ModelConfig, "train": TrainSettings, "data": DataSettings, "parallel": ParallelSettings,
            "ops": OpsSettings, "optim": OptimSettings}
RENAMED = {"parallel": {"overlap": "overlap_fb_pairs", "split_bw": "defer_weight_grads",
                        "merge_w": "chunks_per_weight_grad"}}
"""Keys renamed since configs and checkpoints were written with them: section -> {old name: new name}. An old name
is still read (a config file's with a warning naming the new key)."""


def current_names(section: str, values: dict) -> dict:
    """values (one section's keys) with each old key name (RENAMED) replaced by its new one; ValueError when one key is
    given under both names."""
    renamed = RENAMED.get(section, {})
    for old, new in renamed.items():
        if old in values and new in values:
            raise ValueError(f"{section}.{old} and {section}.{new} are both given: {old} is the old name of {new}; "
                             f"give {section}.{new} only")
    return {renamed.get(key, key): value for key, value in values.items()}


def _current_document(raw: dict) -> dict:
    """raw (a parsed TOML document) with each section's keys under their current names, warning once for each old
    name used."""
    for section, values in raw.items():
        for key in values if isinstance(values, dict) else ():
            if key in RENAMED.get(section, {}):
                note = f"{section}.{key} is renamed {section}.{RENAMED[section][key]}; the old name is read for now"
                warnings.warn(note, FutureWarning)
    return {section: current_names(section, values) if isinstance(values, dict) else values
            for section, values in raw.items()}


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
    """Validate a parsed TOML document (old key names read as their new ones: RENAMED) and build the RunConfig (errors
    name the field)."""
    raw = _current_document(raw)
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
    """A TOML config as a dict, keys under their current names (RENAMED); a top-level `base = "other.toml"` (relative
    to this file) is read first and this file's keys override its keys section by section."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    if path.resolve() in seen:
        raise ValueError(f"config file {str(path)!r} names itself as a base (through {', '.join(map(str, seen))})")
    with path.open("rb") as handle:
        try:
            document = tomllib.load(handle)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {error}") from None
    raw = _current_document(document)
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
        raw.setdefault(section, {}).update(_current_document({section: {key: value}})[section])
    return build_config(raw)
