"""Input validation for the FP8 kernels: clear ValueErrors naming the argument, raised before any launch."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.quant_ref import FP8_DTYPE, TILE, num_tiles

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, t: Tensor, dims: int | tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    """t must be a Tensor with `dims` dimensions (or one of several counts) and one of `dtypes`."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = dims if isinstance(dims, tuple) else (dims,)
    if t.dim() not in allowed:
        counts = " or ".join(map(str, allowed))
        raise ValueError(f"{name} must have {counts} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; allowed: {_names(dtypes)}")


def check_float(name: str, t: Tensor, dims: int | tuple[int, ...]) -> None:
    """t must be a floating-point (fp32/bf16/fp16) tensor with `dims` dimensions."""
    check_tensor(name, t, dims, FLOAT_DTYPES)


def check_fp8(name: str, t: Tensor, dims: int) -> None:
    """t must be an e4m3 (torch.float8_e4m3fn) tensor with `dims` dimensions."""
    check_tensor(name, t, dims, (FP8_DTYPE,))


def check_scale(name: str, scale: Tensor, shape: tuple[int, ...]) -> None:
    """scale must be fp32 of exactly `shape`."""
    check_tensor(name, scale, len(shape), (torch.float32,))
    if tuple(scale.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(scale.shape)}")


def check_same_size(what: str, left: tuple[str, int], right: tuple[str, int]) -> None:
    """Two named sizes of the same dimension must agree."""
    if left[1] != right[1]:
        raise ValueError(f"{what} mismatch: {left[0]} is {left[1]} but {right[0]} is {right[1]}")


def check_same_device(**tensors: Tensor) -> None:
    """All tensors live on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def check_offs(offs: Tensor, rows: int | None, groups: int | None = None) -> None:
    """offs: int32 [G] non-decreasing cumulative group ends, starting >= 0 and ending at most at `rows` (when given;
    rows from offs[-1] on are padding, in no group: a padded exchange's). Values are checked on the CPU only, on the
    device (torch._assert_async, which raises at once there: no host read while they are fine; the ValueError then
    names them); meta offs hold none, and a GPU's would cost a kernel per GEMM: there only their dtype and size are
    checked."""
    check_tensor("offs", offs, 1, (torch.int32,))
    if offs.numel() == 0:
        raise ValueError("offs must name at least one group, got an empty tensor")
    if groups is not None and offs.numel() != groups:
        raise ValueError(f"offs has {offs.numel()} entries but the weights have {groups} groups")
    if offs.device.type != "cpu":
        return
    fine = (offs[:1] >= 0).all() & (offs[1:] >= offs[:-1]).all()
    if rows is not None:
        fine &= (offs[-1:] <= rows).all()
    try:
        torch._assert_async(fine, "offs must be non-negative, non-decreasing cumulative group ends")
    except RuntimeError:
        _offs_error(offs.tolist(), rows)


def _offs_error(ends: list[int], rows: int | None) -> None:
    """The ValueError naming what is wrong with the group ends `ends` (read once they failed check_offs)."""
    if ends[0] < 0:
        raise ValueError(f"offs must be non-negative, got offs[0] = {ends[0]}")
    drops = [i for i in range(1, len(ends)) if ends[i] < ends[i - 1]]
    if drops:
        i = drops[0]
        raise ValueError(f"offs must be non-decreasing (cumulative group ends), got offs[{i - 1}] = "
                         f"{ends[i - 1]} > offs[{i}] = {ends[i]}")
    raise ValueError(f"offs must end at most at the number of rows M = {rows} (rows past offs[-1] are padding), got "
                     f"offs[-1] = {ends[-1]}")


def check_kgrouped(name: str, q_t: Tensor, scale: Tensor, groups: int, columns: int | None = None) -> None:
    """A k-grouped operand of groups groups: e4m3 [D, 128*T] with fp32 scales [D, T], T >= groups tile columns
    (ceil(M/128) + G for M rows, which only the offsets' values give), T = columns when given (another operand's)."""
    check_fp8(name, q_t, 2)
    have = q_t.shape[1] // TILE
    want = have if columns is None else columns
    if q_t.shape[1] != want * TILE or want < groups:
        raise ValueError(f"{name} must have {want * TILE} columns (a k-grouped layout: tiles of 128 tokens, at least "
                         f"one per each of {groups} groups{'' if columns is None else ', as the other operand'}), "
                         f"got shape {tuple(q_t.shape)}")
    check_scale(f"{name}_scale", scale, (q_t.shape[0], want))


def activation_scale_shape(q: Tensor) -> tuple[int, int]:
    """Shape of the 1x128-tile scales of an [M, K] activation."""
    return q.shape[0], num_tiles(q.shape[1])


def weight_scale_shape(q: Tensor) -> tuple[int, ...]:
    """Shape of the 128x128-block scales of a [..., N, K] weight."""
    return (*q.shape[:-2], num_tiles(q.shape[-2]), num_tiles(q.shape[-1]))
