"""Per-rank materialisation: a rank's stages, cut from a model built on the meta device, get storage on the
rank's own device and the single-process initial values of exactly the pieces they hold.

A stage tensor stands for one or more single-process keys (launch.checkpoint's naming): its own name; its
TP source's name when it holds rows of a larger tensor (TPSpec); one key per routed expert it holds
(`...experts.w_down.5`, global expert id). Each key's value is drawn from its own seed (moe.init), so
the rank draws only what it holds: one expert or one TP source tensor at a time, never the whole model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.config import ModelConfig
from moe.init import initial_value
from moe.tp.layout import TPSpec, full_name


def expert_offset(stage: nn.Module, name: str, count: int) -> int:
    """Global id of the first expert in stage tensor name (a block of count experts): its EP rank times count."""
    layer = stage.get_submodule(name.split(".experts.")[0])
    return getattr(layer.dispatcher, "rank", 0) * count


def sharded_spec(tensor: Tensor) -> TPSpec | None:
    """The TPSpec of a tensor holding rows of a larger single-process tensor (None: it is whole)."""
    spec = getattr(tensor, "tp_spec", None)
    return spec if spec is not None and spec.indices is not None else None


def move_empty(module: nn.Module, device: torch.device) -> None:
    """Give every param and buffer of module uninitialised storage on device, keeping each param's
    attributes (its TPSpec) and sharing (nn.Module.to_empty would drop both)."""
    moved: dict[int, Tensor] = {}
    for owner in module.modules():
        for slots in (owner._parameters, owner._buffers):
            for name, tensor in slots.items():
                if tensor is None or tensor.device == device:
                    continue
                if id(tensor) not in moved:
                    empty = torch.empty_like(tensor, device=device)
                    if isinstance(tensor, nn.Parameter):
                        empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
                        empty.__dict__.update(tensor.__dict__)
                    moved[id(tensor)] = empty
                slots[name] = moved[id(tensor)]


@torch.no_grad()
def fill_initial(stage: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Set every param and buffer of stage to its piece of the single-process initial values."""
    tp_rank = stage.tp.rank if getattr(stage, "tp", None) is not None else 0
    for name, tensor in stage.state_dict(keep_vars=True).items():
        spec = sharded_spec(tensor)
        if spec is not None:
            full = list(tensor.shape)
            full[spec.dim] = spec.full_size
            source = full_name(name, spec)
            value = initial_value(cfg, source, source, tuple(full), seed, tensor.device)
            tensor.copy_(value.index_select(spec.dim, spec.indices[tp_rank].to(tensor.device)))
        elif ".experts." in name:
            first = expert_offset(stage, name, tensor.shape[0])
            for j in range(tensor.shape[0]):
                tensor[j].copy_(initial_value(cfg, name, f"{name}.{first + j}", tuple(tensor.shape[1:]), seed,
                                              tensor.device))
        else:
            tensor.copy_(initial_value(cfg, name, name, tuple(tensor.shape), seed, tensor.device))


def materialize(stages: list[nn.Module], cfg: ModelConfig, seed: int, device: torch.device) -> None:
    """Move stages built on meta to device with their initial values (on meta: storage-free, no values)."""
    for stage in stages:
        move_empty(stage, device)
        if device.type != "meta":
            fill_initial(stage, cfg, seed)
