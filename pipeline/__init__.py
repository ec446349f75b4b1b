"""Pipeline parallelism: schedules as data, DualPipe/DualPipeV runtime, B/W split, simulator."""

from pipeline.runtime import DualPipe, DualPipeV, PipelineRuntime
from pipeline.schedules import (SCHEDULES, Action, Layout, Op, Schedule, build, dualpipe, dualpipev,
                                forward_only, one_f_one_b, with_communication, without_split, zb1p)
from pipeline.simulate import Costs, SimResult, render_svg, render_text, simulate
from pipeline.wgrad import WeightGradStore, defer_weight_grad, install_split_linear

__all__ = ["DualPipe", "DualPipeV", "PipelineRuntime", "SCHEDULES", "Action", "Layout", "Op", "Schedule",
           "build", "dualpipe", "dualpipev", "forward_only", "one_f_one_b", "with_communication",
           "without_split", "zb1p", "Costs", "SimResult", "render_svg", "render_text", "simulate",
           "WeightGradStore", "defer_weight_grad", "install_split_linear"]
