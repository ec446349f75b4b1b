"""Per-rank materialisation: a rank's stages, cut from a model built on the meta device, get storage on the
rank's own device and the single-process initial values of exactly the pieces they hold.

A stage tensor stands for one or more single-process keys (launch.parallel.placement: its own name, its TP source's
name, one key per routed expert). Each key's value is drawn from its own seed (moe.init), so the rank
draws only what it holds: one expert or one TP source tensor at a time, never the whole model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from launch.checkpoint.hf.load import fill_from_hub
from launch.parallel.placement import placement
from moe.config import ModelConfig
from moe.init import initial_value


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
    for name, tensor in stage.state_dict(keep_vars=True).items():
        place = placement(stage, name, tensor)
        drawn: dict[str, Tensor] = {}
        for key, offsets, view in place.boxes(0, tensor.detach().view(-1)):
            if key not in drawn:  # one key's full tensor at a time
                drawn = {key: initial_value(cfg, place.key, key, place.full_shape, seed, tensor.device)}
            view.copy_(drawn[key][tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))])


def materialize(stages: list[nn.Module], cfg: ModelConfig, seed: int, device: torch.device) -> None:
    """Move stages built on meta to device with their initial values, or model.init_from's weights (launch.checkpoint.hf.load);
    on meta: storage-free, no values."""
    for stage in stages:
        move_empty(stage, device)
        if device.type == "meta":
            continue
        if cfg.init_from:
            fill_from_hub(stage, cfg, seed)
        else:
            fill_initial(stage, cfg, seed)
