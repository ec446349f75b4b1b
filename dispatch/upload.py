"""Host values to the device without waiting for the device.

torch.tensor(values, device="cuda") copies from pageable memory and waits for the copy (a host sync). upload stages
the values in pinned host memory and queues the copy on the current stream (non_blocking), as the exact exchange
sends its counts and the step's statistics gather their host-side numbers; the caching host allocator keeps the
pinned buffer alive until the copy has run. Not for a CUDA graph's captured region, which would capture the host
buffer: constants there come from dispatch.layout.device_index, made once before any capture.
"""

from __future__ import annotations

import torch
from torch import Tensor


def upload(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """values (numbers or nested lists of them) as a dtype tensor on device; on CUDA through pinned memory, queued
    without waiting; elsewhere made there directly."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)
