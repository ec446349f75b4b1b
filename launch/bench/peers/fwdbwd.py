"""Forward+backward timing of an MoE layer, and the peer scripts' protocol; imports torch only.

A peer script is run as `PYTHON SCRIPT SPEC_JSON` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set
(WORLD_SIZE 1: one process). spec["weights"] names a torch.save'd dict every contender loads, in our layout:
"router" [E, H], "w_gate_up" [E, 2F, H] (gate rows first), "w_down" [E, H, F], "reference": per rank, the
float64 output of one process's layer on that rank's tokens, and "checked": per rank, a [batch, seq] mask of the
tokens whose top-k the dtype's rounding cannot change (decided_tokens). Its last stdout line is {"seconds": [...],
"max_rel_diff": max over checked tokens |out - reference| / max |reference|, "info": {...}} or {"error": "..."}.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

EXIT_MISSING = 3  # the peer library is not importable: the row says why
TIE_EPS = 2  # decided_tokens: a top-k closer than this many eps of the dtype (times the largest logit) is a near tie

def time_steps(step: Callable[[], Any], warmup: int, repeats: int, barrier: Callable[[], Any] | None = None,
               guard: Callable[[int], AbstractContextManager] | None = None) -> list[float]:
    """Seconds of each of `repeats` calls of step() after `warmup` untimed ones; barrier() before each call
    (EP: every rank starts together) and each call inside guard(i) (a per-call budget) when given."""
    seconds = []
    for i in range(warmup + repeats):
        if barrier is not None:
            barrier()
        with guard(i) if guard is not None else nullcontext():
            start = time.perf_counter()
            step()
            spent = time.perf_counter() - start
        if i >= warmup:
            seconds.append(spent)
    return seconds


def inputs(spec: dict[str, Any], rank: int) -> tuple[Tensor, Tensor]:
    """(x, dy) [batch, seq, hidden] of this rank, from seed + 1000 * (rank + 1), in the spec's dtype on CPU."""
    gen = torch.Generator().manual_seed(spec["seed"] + 1000 * (rank + 1))
    shape = (spec["batch"], spec["seq"], spec["hidden"])
    dtype = getattr(torch, spec["dtype"])
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def fwd_bwd(module: torch.nn.Module, forward: Callable[[Tensor], Tensor], x: Tensor, dy: Tensor) -> Callable[[], None]:
    """One step: drop the grads, forward(x) with x requiring grad, backward of dy."""
    def step() -> None:
        module.zero_grad(set_to_none=True)
        forward(x.detach().requires_grad_()).backward(dy)
    return step


def decided_tokens(logits: Tensor, top_k: int, dtype: torch.dtype) -> Tensor:
    """[..., E] router logits (float64) -> [...] mask of the tokens whose k-th and (k+1)-th logits differ by more than
    TIE_EPS eps of `dtype` times the token's largest |logit|: a router computing in `dtype` picks their top-k as
    float64 does, where a near tie may go either way (and route the token to another expert)."""
    ordered = logits.sort(-1, descending=True).values
    if top_k >= logits.shape[-1]:
        return torch.ones(logits.shape[:-1], dtype=torch.bool)
    gap = ordered[..., top_k - 1] - ordered[..., top_k]
    return gap > TIE_EPS * torch.finfo(dtype).eps * logits.abs().amax(-1)


def relative_error(out: Tensor, reference: Tensor, checked: Tensor) -> float:
    """max over the checked tokens ([batch, seq] mask) of |out - reference|, over max |reference|."""
    return ((out.double() - reference)[checked].abs().max() / reference.abs().max()).item()


def _init_process_group(spec: dict[str, Any]) -> None:
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=spec["timeout_s"]))


Build = Callable[[dict[str, Any], int, int, dict[str, Tensor]],
                 tuple[torch.nn.Module, Callable[[Tensor], Tensor], dict[str, Any]]]


def peer_main(build: Build, library: str) -> int:
    """A peer script's whole run: spec from argv[1], gloo group from the environment, build(spec, rank, world,
    weights) -> (module holding the weights, forward on [batch, seq, hidden], info), the output checked against
    the reference, timed steps, one JSON line on stdout. Without `library` (its top-level package) every rank
    says so before any rendezvous."""
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    if importlib.util.find_spec(library) is None:
        print(json.dumps({"error": f"not importable: No module named {library!r}"}), flush=True)
        return EXIT_MISSING
    try:
        _init_process_group(spec)
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(spec["seed"])
        weights = torch.load(spec["weights"], weights_only=True)
        module, forward, info = build(spec, rank, world, weights)
        x, dy = inputs(spec, rank)
        diff = relative_error(forward(x).detach(), weights["reference"][rank], weights["checked"][rank])
        seconds = time_steps(fwd_bwd(module, forward, x, dy), spec["warmup"], spec["repeats"],
                             barrier=dist.barrier if world > 1 else None)
        print(json.dumps({"seconds": seconds, "max_rel_diff": diff, "info": {**info, "torch": torch.__version__}}),
              flush=True)
        return 0
    except ImportError as err:
        print(json.dumps({"error": f"not importable: {err}"}), flush=True)
        return EXIT_MISSING
    except Exception as err:  # noqa: BLE001 - any failure of the peer becomes its row's reason
        where = traceback.extract_tb(err.__traceback__)[-1]
        first = (str(err).splitlines() or [""])[0][:200]
        print(json.dumps({"error": f"{type(err).__name__} at {where.filename}:{where.lineno}: {first}"}), flush=True)
        traceback.print_exc()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
