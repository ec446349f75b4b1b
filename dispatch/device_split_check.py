"""The GPU check of the device-split exchange (issue 48 Deliver 4: "the device-split exchange only at world size 1"):
gpu_check runs dispatch.device_split's NVSHMEM path on one CUDA GPU against its reference; `moe-bench gpu` calls it."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from dispatch.device_split import NvshmemBuffers, nvshmem_split, pad_blocks
from dispatch.dispatcher import EPDispatcher


def gpu_check(device: torch.device | str = "cuda") -> dict:
    """On one CUDA GPU, world size 1 (issue 48 Deliver 4): the NVSHMEM path of the device-split exchange (nvshmem_split)
    of random blocks (counts at random up to the bound, one block of 0 rows, one at the bound) against the reference
    masking of the same rows, bitwise; and one flat dispatch + combine forward and backward through a device-split
    EPDispatcher against the exact exchange's. Initialises a 1-rank NCCL process group (TCP store on localhost) if none
    exists. Returns {"ok": bool, ...details}; NVSHMEM or CUDA unavailable is a result ({"ok": False, "reason": ...}),
    not an exception, and so is an error of the op."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return {"ok": False, "reason": f"needs a CUDA device, got {device} (cuda available: "
                                       f"{torch.cuda.is_available()})"}
    from torch.distributed import _symmetric_memory as symm_mem
    if not symm_mem.is_nvshmem_available():
        return {"ok": False, "reason": "NVSHMEM is not available to this torch (symm_mem.is_nvshmem_available())"}
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    group = dist.new_group([dist.get_rank()], backend="nccl")
    result: dict = {"ok": False, "device": torch.cuda.get_device_name(device)}
    try:
        result["exchange"] = _check_exchange(device, group)
        result["layer"] = _check_layer(device)
    except Exception as error:  # an op's failure on this GPU is the check's finding
        result["error"] = f"{type(error).__name__}: {error}"
        return result
    result["ok"] = result["exchange"]["bitwise"] and result["layer"]["max_abs_diff"] <= result["layer"]["bound"]
    return result


def _check_exchange(device: torch.device, group: dist.ProcessGroup) -> dict:
    """nvshmem_split at world 1 against pad_blocks of the same rows (what the reference delivers at world 1), for a few
    blocks: bound 8 of 3 dtypes and widths, counts 0, the bound, and random."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    buffers, cases = NvshmemBuffers(group), []
    for bound, width, dtype, count in ((8, 16, torch.float32, 0), (8, 16, torch.float32, 8),
                                       (8, 40, torch.bfloat16, int(torch.randint(1, 8, (), generator=gen))),
                                       (5, 12, torch.int32, int(torch.randint(0, 6, (), generator=gen)))):
        rows = torch.randn(bound, width, generator=gen).mul(100).to(dtype).to(device)
        sent = torch.tensor([count], dtype=torch.int64, device=device)
        padding = torch.full((width,), -1, dtype=dtype, device=device) if dtype == torch.int32 else None
        got, received = nvshmem_split(rows, sent, buffers, padding)
        want = pad_blocks(rows, sent, bound, padding)
        cases.append({"bound": bound, "count": count, "dtype": str(dtype), "received": int(received.item()),
                      "bitwise": bool(torch.equal(got, want)) and int(received.item()) == count})
        torch.cuda.synchronize(device)
    return {"cases": cases, "bitwise": all(case["bitwise"] for case in cases)}


def _check_layer(device: torch.device) -> dict:
    """A flat dispatch + combine (world 1, 4 experts, top-2, float32) forward and backward through a device-split
    EPDispatcher against an exact one: the same rows reach the same experts, so outputs and grads match to rounding
    (bound: 1e-5 of the largest value, the experts' float32 sums in other row counts)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    tokens, hidden, experts, top_k = 24, 32, 4, 2
    x = torch.randn(tokens, hidden, generator=gen).to(device)
    indices = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(device)
    weights = torch.rand(tokens, top_k, generator=gen).to(device)
    scale = torch.rand(experts, generator=gen).to(device)
    results = {}
    for exchange in ("exact", "device_split"):
        dispatcher = EPDispatcher(experts, exchange=exchange, tokens=tokens, headroom=2.0)
        for transport in dispatcher.channels + dispatcher.grad_channels if exchange == "device_split" else ():
            transport.exchange_alone = True  # through the op, though the hop has one peer
        x_in, w_in = x.clone().requires_grad_(), weights.clone().requires_grad_()
        rows, info, handle = dispatcher.dispatch(x_in, indices, w_in)
        ends = torch.cumsum(info.tokens_per_local_expert, 0)  # each row's expert (padding rows: past the last)
        groups = torch.searchsorted(ends, torch.arange(rows.shape[0], device=device), right=True)
        out = dispatcher.combine(rows * scale[groups.clamp(max=experts - 1)].unsqueeze(1), handle)
        out.square().sum().backward()
        results[exchange] = (out.detach(), x_in.grad, w_in.grad)
    diffs = [(a - b).abs().max().item() for a, b in zip(results["exact"], results["device_split"])]
    largest = max(t.abs().max().item() for t in results["exact"])
    return {"max_abs_diff": max(diffs), "bound": 1e-5 * largest}


def _free_port() -> int:
    """A free TCP port on localhost."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
