"""Seconds of a GEMM and of attention on one GPU by shape and precision: moe-plan's compute model.

A GEMM [M, K] x [K, N] (2MNK FLOPs, in `groups` groups of M rows each) takes its main loop at a fixed
share of the tensor cores' peak for its precision, plus the time to move its operands and output through
HBM once (the two do not overlap well at the sizes that matter: small K leaves every tile's output write
exposed, small M every weight read):

    t = 2 * groups * M' * N * K / (peak * TENSOR_EFFICIENCY * clock * grouped * scaling) + bytes / (HBM bandwidth)

with M' = M rounded up to TILE_ROWS per group (the grouped kernels pad every group to their tile),
grouped = GROUPED_EFFICIENCY for a grouped GEMM, scaling = 1 - BLOCK_SCALING_COST[precision] for FP8 with
1x128 / 128x128 scales (by the kernels that run them), and bytes = operands in their precision, output in BF16
(FP32 for a weight gradient), plus the FP32 scales, and clock = SUSTAINED_CLOCK by default (the share of its
boost clock a GPU holds through a training run at its power cap; 1 for a short benchmark). Efficiency
(2MNK / t / peak) therefore rises with every dimension and saturates below TENSOR_EFFICIENCY x clock; it falls
for the small-N, small-K and few-row GEMMs of fine-grained experts.

Attention's core (flash attention: QK^T, softmax, AV) runs at ATTENTION_EFFICIENCY of the BF16 peak, x
ATTENTION_SUSTAINED_CLOCK through a run (`moe-plan --clock/--attention-clock` take the factors `moe-bench clock`
measures on another GPU).

The constants are the same for every GPU and run; docs/planner.md gives the measurement or publication each one
comes from, and the published runs the fitted ones (SLOT_SECONDS) are fitted to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launch.plan.presets import GPU

# BF16; FP8 with one scale per tensor; FP8 with 1x128 / 128x128 tiles on kernels that promote on the CUDA cores as
# DeepGEMM does (DeepSeek's, this project's; MXFP8 on Blackwell is priced so too); the same tiles through Transformer
# Engine's Float8BlockScaling on Hopper (cuBLAS's block-scaled GEMMs)
PRECISIONS = ("bf16", "fp8-tensor", "fp8-block", "fp8-block-te")

# Where each constant below comes from (the measurement or publication and the arithmetic) is in docs/planner.md,
# "Where the constants come from"; the comments here say what each one means.

# The tensor cores' main-loop share of the dense peak (a GEMM's operand and output bytes priced apart).
TENSOR_EFFICIENCY = 0.89
# A grouped GEMM's main loop against a dense one's (a group per tile row, uneven tails).
GROUPED_EFFICIENCY = 0.90
# Share of the main loop an FP8 GEMM with 1x128 / 128x128 scales loses: promoting each 128-wide K slice's partial
# sums to FP32 on the CUDA cores (fp8-block), or cuBLAS's block-scaled GEMMs under Transformer Engine (fp8-block-te).
BLOCK_SCALING_COST = {"fp8-block": 0.015, "fp8-block-te": 0.176}
# Share of the boost clock tensor-core work holds through a training run at the GPU's power cap (GEMMs; flash
# attention, which draws less power a FLOP). Applied to every GPU; `moe-bench clock` measures them on the GPU at
# hand and `moe-plan --clock/--attention-clock` takes others.
SUSTAINED_CLOCK = 0.854
ATTENTION_SUSTAINED_CLOCK = 0.93
# Rows per tile of a grouped GEMM: the contiguous layout aligns every group's M to it.
TILE_ROWS = 128
# Share of its HBM bandwidth a device copy reaches.
HBM_EFFICIENCY = 0.9
# Flash attention's share of the BF16 peak over a training step (forward + backward, causal).
ATTENTION_EFFICIENCY = 0.49
# Bytes an FP8 linear moves to quantize one element of its input (forward) or output grad (backward) from
# BF16, both orientations (the weight grad needs the transpose): per-tensor current scaling first reads the
# tensor for its amax, then reads it again and writes e4m3 twice (2 + 2 + 1 + 1); 1x128 tiles take their scale
# in the same pass (2 + 1 + 1, the FP32 scales 1/32 more). BF16 linears quantize nothing.
QUANTIZE_BYTES = {"bf16": 0.0, "fp8-tensor": 6.0, "fp8-block": 4.0 + 4 / 128, "fp8-block-te": 4.0 + 4 / 128}
# Seconds per routed slot (one token's copy to one of its top_k experts) of an MoE layer's forward + backward that
# the GEMMs, the memory-bound ops' bytes and the links' bytes above do not account for: the router's top-k and
# the permutation's index work, the dispatch/combine kernels' per-token processing, the host syncs on expert
# counts and the eager launches around them. It is fitted to the published runs of launch/plan/calibration.toml
# (`moe-plan --validate` refits it and prints each run's leave-one-out ratio), one cost per way a stack handles the
# slots (MOE_HANDLING; `moe-plan --moe-handling`), each over that way's runs that are not held out:
# - "synced": the stack reads the expert counts to the host in every MoE layer and launches the permutation and
#   the exchange eagerly around that read (this project's runtime among them);
# - "captured": the router and the MoE preprocessing replayed as CUDA graphs in front of a fused dispatcher
#   (Megatron-Core's flex dispatcher on DeepEP or HybridEP with cuda_graph_scope moe_router + moe_preprocess).
# Which stacks and runs each fit holds, and how well it predicts the held-out ones: docs/planner.md.
MOE_HANDLING = ("synced", "captured")
SYNCED_SLOT_SECONDS = 0.245e-6
CAPTURED_SLOT_SECONDS = 0.052e-6
SLOT_SECONDS = {"synced": SYNCED_SLOT_SECONDS, "captured": CAPTURED_SLOT_SECONDS}
# What `moe-plan --validate` gives with the shipped constants, for every plan to state its known error: over the
# published MoE runs it plans, (runs, lowest, highest) predicted/published tokens/s per GPU of the runs the slot costs
# are fitted to and of those held out, and how many of all are within +-20% (tests keep it current).
VALIDATED = {"fitted": (13, 0.83, 1.20), "held_out": (26, 0.70, 1.54), "within": 26}


@dataclass(frozen=True)
class GemmModel:
    """Prices GEMMs, attention and routed slots on one GPU; `flat` (a share of peak) replaces the shape model with
    the old single efficiency for every GEMM and attention (no bytes, no padding, no slot cost)."""

    gpu: GPU
    flat: float | None = None
    slot_seconds: float = SYNCED_SLOT_SECONDS
    clock: float = SUSTAINED_CLOCK  # share of the boost clock GEMMs hold through a run (1: a short benchmark)
    attention_clock: float = ATTENTION_SUSTAINED_CLOCK  # the same for flash attention

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s of precision."""
        if precision not in PRECISIONS:
            raise ValueError(f"GEMM precision {precision!r} is not allowed; choose one of {', '.join(PRECISIONS)}")
        return (self.gpu.bf16_tflops if precision == "bf16" else self.gpu.fp8_tflops) * 1e12

    def gemm(self, m: float, n: float, k: float, precision: str, groups: int = 1, out_bytes: int = 2) -> float:
        """Seconds of `groups` GEMMs [m, k] x [k, n] (m rows each; m may be fractional: an average)."""
        flops = 2.0 * groups * m * n * k
        if flops == 0:
            return 0.0
        if self.flat is not None:
            return flops / (self.peak(precision) * self.flat)
        rows = math.ceil(m / TILE_ROWS) * TILE_ROWS if groups > 1 else m
        rate = self.peak(precision) * TENSOR_EFFICIENCY * self.clock
        rate *= GROUPED_EFFICIENCY if groups > 1 else 1.0
        rate *= 1.0 - BLOCK_SCALING_COST.get(precision, 0.0)
        size = 2 if precision == "bf16" else 1
        moved = groups * ((m * k + k * n) * size + m * n * out_bytes)
        if precision in BLOCK_SCALING_COST:
            moved += groups * 4 * (m * k / 128 + n * k / 128 ** 2)
        return 2.0 * groups * rows * n * k / rate + self.memory(moved)

    def memory(self, nbytes: float) -> float:
        """Seconds to move nbytes through HBM (0 under a flat efficiency, which prices FLOPs only)."""
        return 0.0 if self.flat is not None else nbytes / (self.gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY)

    def routed_slots(self, slots: float) -> float:
        """Seconds of handling `slots` routed slots, forward + backward (0 under a flat efficiency)."""
        return 0.0 if self.flat is not None else slots * self.slot_seconds

    def linear(self, m: float, n: float, k: float, precision: str, groups: int = 1) -> tuple[float, float, float]:
        """(forward, input grad, weight grad) seconds of a linear [m, k] -> [m, n] (weight [n, k]) in each
        of `groups` groups; the weight grad reduces over the m rows (FP8: FP32 out, as k-grouped kernels)."""
        wgrad_out = 2 if precision == "bf16" else 4
        return (self.gemm(m, n, k, precision, groups), self.gemm(m, k, n, precision, groups),
                self.gemm(n, k, m, precision, groups, wgrad_out) if m else 0.0)

    def attention(self, flops: float) -> float:
        """Seconds of flash attention doing flops (BF16)."""
        if self.flat is not None:
            return flops / (self.peak("bf16") * self.flat)
        return flops / (self.peak("bf16") * ATTENTION_EFFICIENCY * self.attention_clock)

    def efficiency(self, m: float, n: float, k: float, precision: str, groups: int = 1) -> float:
        """Achieved share of the peak of a GEMM (2 groups m n k FLOPs over its seconds)."""
        return 2.0 * groups * m * n * k / self.gemm(m, n, k, precision, groups) / self.peak(precision)
