"""EP overlap inside an F&B pair: a forward written as a generator pauses at in-flight communication.

A stage module may define `forward_steps(*inputs)`, a generator that starts asynchronous
communication (e.g. an expert all-to-all with async_op=True), yields its handle, waits on it
when resumed and finally returns what `forward` would. Inside an overlapped F&B pair the runtime
runs the forward up to its first yield, runs the other chunk's backward while that communication
is in flight, then resumes the forward. Modules without it just run forward then backward.
"""

from __future__ import annotations

import inspect
from typing import Any, Generator

from torch import nn


def complete(forward: Any) -> Any:
    """Run a forward_steps generator to its end and return its value (other values pass through)."""
    if not inspect.isgenerator(forward):
        return forward
    while True:
        try:
            next(forward)
        except StopIteration as stop:
            return stop.value


def start(forward: Any) -> tuple[bool, Any]:
    """Advance a forward to its first in-flight communication: (False, paused generator), or
    (True, its value) when it finished without pausing (or was not a generator)."""
    if not inspect.isgenerator(forward):
        return True, forward
    try:
        next(forward)
    except StopIteration as stop:
        return True, stop.value
    return False, forward


class OverlapSequential(nn.Sequential):
    """nn.Sequential whose forward_steps chains its children's forward_steps (plain calls for others)."""

    def forward_steps(self, *inputs: Any) -> Generator[Any, None, Any]:
        """Run the children in order, yielding whatever their forward_steps yield."""
        out: Any = inputs
        for i, child in enumerate(self):
            args = out if i == 0 else (out,)
            if hasattr(child, "forward_steps"):
                out = yield from child.forward_steps(*args)
            else:
                out = child(*args)
        return out

    def forward(self, *inputs: Any) -> Any:
        """Same result as forward_steps, run without pausing."""
        return complete(self.forward_steps(*inputs))
