"""Pipeline parallelism: schedules as data, DualPipe/DualPipeV runtime, B/W split, simulator."""

import importlib
from typing import Any

from pipeline.overlap import OverlapSequential
from pipeline.runtime import AFAB, ZB1P, DualPipe, DualPipeV, OneFOneB, PipelineRuntime
from pipeline.schedules import (SCHEDULES, Action, StageLayout, Op, Schedule, afab, build, dualpipe, dualpipev,
                                forward_only, merge_weight_grads, min_chunks, one_f_one_b, with_communication,
                                without_split, zb1p)
from pipeline.wgrad import WeightGradStore, accumulate_grad, defer_weight_grad, install_split_linear

_SIMULATOR = ("Costs", "SimResult", "render_svg", "render_text", "simulate")

__all__ = ["AFAB", "DualPipe", "DualPipeV", "OneFOneB", "ZB1P", "PipelineRuntime", "OverlapSequential", "SCHEDULES",
           "Action", "StageLayout", "Op", "Schedule", "afab", "build", "dualpipe", "dualpipev", "forward_only",
           "merge_weight_grads", "min_chunks", "one_f_one_b",
           "with_communication", "without_split", "zb1p", "WeightGradStore", "accumulate_grad",
           "defer_weight_grad", "install_split_linear", *_SIMULATOR]


def __getattr__(name: str) -> Any:
    """Simulator names (pipeline.simulator) load on first use, so `python -m pipeline.simulator`
    runs that module fresh."""
    if name in _SIMULATOR:
        return getattr(importlib.import_module("pipeline.simulator"), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
