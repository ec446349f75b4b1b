"""The one device each rank computes on, and the backend its process groups use, chosen in one place.

`train.device`: "auto" takes CUDA when it is available, else the CPU; "cuda" and "cpu" force one. A
CUDA rank uses `cuda:LOCAL_RANK` (the launcher's local rank: torchrun's LOCAL_RANK, moe-train's own
spawn and mpiexec set it too) and NCCL; a CPU rank uses gloo. A rehearsal hands the trainer the
`meta` device instead (launch.plan.rehearse). Every check here runs before any process is spawned.
"""

from __future__ import annotations

import os
from typing import Literal, Mapping, get_args

import numpy as np
import torch
from torch import Tensor

Device = Literal["auto", "cuda", "cpu"]
DEVICES = get_args(Device)
CommBackend = Literal["auto", "gloo", "nccl"]
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89) and Hopper (sm90) onwards


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank on its node (LOCAL_RANK; 0 for a single process)."""
    env = os.environ if env is None else env
    return int(env.get("LOCAL_RANK", "0"))


def uses_cuda(setting: str) -> bool:
    """Whether train.device = setting puts the ranks on CUDA GPUs on this machine."""
    return setting == "cuda" or (setting == "auto" and torch.cuda.is_available())


def rank_device(setting: str, env: Mapping[str, str] | None = None) -> torch.device:
    """The device of this rank: cuda:LOCAL_RANK when train.device resolves to CUDA, else the CPU."""
    return torch.device("cuda", local_rank(env)) if uses_cuda(setting) else torch.device("cpu")


def backend_for(setting: str, comm_backend: str) -> str:
    """parallel.comm_backend resolved against the device: auto is NCCL for CUDA ranks, gloo for CPU ones."""
    if comm_backend != "auto":
        return comm_backend
    return "nccl" if uses_cuda(setting) else "gloo"


def check_device(setting: str, comm_backend: str, expert_precision: str, local_ranks: int | None = None,
                 cuda_graphs: bool = False) -> None:
    """Raise ValueError naming the field and the numbers unless the ranks can run on the chosen device:
    CUDA requested without CUDA, fewer visible GPUs than ranks on this node, FP8 experts on GPUs
    without FP8 tensor cores, NCCL without CUDA, CUDA graphs (train.cuda_graphs) off CUDA."""
    cuda = uses_cuda(setting)
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device = 'cuda' but this torch sees no CUDA GPU; allowed here: 'auto', 'cpu'")
    if cuda_graphs and not cuda:
        why = "puts the ranks on the CPU" if setting == "cpu" else "resolves to the CPU (this torch sees no CUDA GPU)"
        raise ValueError(f"train.cuda_graphs = true captures CUDA graphs, which run on CUDA GPUs only, but "
                         f"train.device = {setting!r} {why}; allowed here: train.cuda_graphs = false")
    if comm_backend == "nccl" and not cuda:
        raise ValueError(f"parallel.comm_backend = 'nccl' needs the ranks on CUDA GPUs, but train.device = {setting!r} "
                         f"resolves to the CPU here; allowed: 'auto', 'gloo'")
    if not cuda:
        return
    gpus = torch.cuda.device_count()
    if local_ranks is not None and gpus < local_ranks:
        raise ValueError(f"train.device = {setting!r} puts each rank on its own GPU: {local_ranks} ranks on this node "
                         f"but {gpus} GPUs visible; start at most {gpus} ranks per node or set train.device = 'cpu'")
    if expert_precision == "fp8":
        found = {torch.cuda.get_device_capability(i) for i in range(gpus)}
        old = sorted(c for c in found if c < FP8_MIN_CAPABILITY)
        if old:
            raise ValueError(f"model.expert_precision = 'fp8' needs FP8 tensor cores (compute capability >= "
                             f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}), but this machine's GPUs are "
                             f"{', '.join(f'{a}.{b}' for a, b in old)}; allowed there: 'native'")


def to_host(tensor: Tensor) -> Tensor:
    """tensor's values on the CPU (a host sync on a GPU: callers do it once per step); a rehearsal's meta
    tensors hold no values and read as zeros (host values), so the step's host-side decisions take their
    usual branch."""
    if tensor.is_meta:
        return torch.from_numpy(np.zeros(tuple(tensor.shape))).to(tensor.dtype)
    return tensor.cpu()
