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

The constants are the same for every GPU and run; each comes from a public measurement, given beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launch.plan.presets import GPU

# BF16; FP8 with one scale per tensor; FP8 with 1x128 / 128x128 tiles on kernels that promote on the CUDA cores as
# DeepGEMM does (DeepSeek's, this project's; MXFP8 on Blackwell is priced so too); the same tiles through Transformer
# Engine's Float8BlockScaling on Hopper (cuBLAS's block-scaled GEMMs)
PRECISIONS = ("bf16", "fp8-tensor", "fp8-block", "fp8-block-te")

# The tensor cores' main-loop share of the dense peak. An H100 runs an 8192^3 BF16 GEMM at 798 TFLOPS
# (ANCHORS.md), 1.378 ms, of which moving its 403 MB at the 3.0 TB/s a device copy reaches is 0.134 ms: the
# main loop ran at 1.1e12 / 1.244 ms = 884 TFLOPS = 0.89 of 989. DeepGEMM's dense FP8 4096x7168x16384 at
# 1520 TFLOPS on an H800 (1x128 scales), its 243 MB taken off the same way, gives 0.87 of 1979.
TENSOR_EFFICIENCY = 0.89
# A grouped GEMM's scheduling (a group per tile row, uneven tails) against a dense one: DeepGEMM's grouped
# contiguous FP8 (4 groups of M=8192: N=4096 K=7168 at 1346 TFLOPS, N=7168 K=2048 at 1214) gives 0.78-0.79
# of the FP8 peak once its bytes are taken off, against 0.87 dense: a factor of 0.90.
GROUPED_EFFICIENCY = 0.90
# FP8 with fine-grained scales promotes each 128-wide K slice's partial sums to FP32 on the CUDA cores
# (DeepSeek-V3 report 3.3.2); the kernels overlap it with the tensor cores, leaving DeepGEMM's dense 1x128
# GEMM at 0.87 of peak against the 0.89 a GEMM without it reaches: the promotion costs 1.5%. Transformer Engine's
# Float8BlockScaling on Hopper (cuBLAS's block-scaled GEMMs and TE's 1x128 casts) is its slowest FP8 recipe: TE's
# GEMM profiling guide (docs/examples/gemm_profiling, H200 NVL, a layer's 12 GEMMs of hidden 4096, FFN 16384 at
# 15,872 tokens in autocast: inputs and weights cast before each GEMM) reads 22.882 ms a layer against 20.285 for
# current scaling (x1.128; 32.014 in BF16). With its casts priced by their bytes (QUANTIZE_BYTES, as current
# scaling's), the main loop that reproduces x1.128 runs 17.6% below a GEMM without scales (FBGEMM's block-scaled
# CUTLASS GEMM on an H100 at 500 W ran at 0.73-0.77 of its row-scaled one: pytorch/FBGEMM PR 2546).
BLOCK_SCALING_COST = {"fp8-block": 0.015, "fp8-block-te": 0.176}
# Tensor-core work through a training run holds less than the boost clock the benchmarks above ran at. On the H100s
# lent to this project (700 W cap, 2026-11-27; two machines) an 8192^3 BF16 GEMM on random data ran at 787 and 804
# TFLOPS over its first calls and at a median 672 and 688 over 20-30 s of back-to-back calls, the SM clock down
# from 1980 MHz to 1305-1410 MHz at 695-701 W: 0.854 and 0.855 of the burst rate; FP8 (per-tensor scales) 1443 ->
# 1248, 0.864 (1140-1275 MHz). Flash attention draws less power a FLOP: torch's SDPA, causal, forward + backward at
# 8192 tokens, 510 -> 474 TFLOPS, 0.93 (1590-1620 MHz). Applied to every GPU (H800 and H200 are the same silicon at
# the same cap; B200's is not measured here). A run that interleaves enough memory-bound and communication time
# stays below the cap (an MoE layer's forward and backward held 1980 MHz at 200-550 W): GEMM-bound runs slow most.
# `moe-bench clock` measures these factors on the GPU at hand (an H200, same cap: 0.847, 0.850 and 0.917).
SUSTAINED_CLOCK = 0.854
ATTENTION_SUSTAINED_CLOCK = 0.93
# Rows per tile of a grouped GEMM: DeepGEMM's contiguous layout aligns every group's M to 128 (ANCHORS.md).
TILE_ROWS = 128
# HBM: an H100 copies at ~3.0 TB/s of its 3.35 TB/s (ANCHORS.md).
HBM_EFFICIENCY = 0.9
# Flash attention's share of the BF16 peak over a training step (forward + backward, causal, head width
# 128, 4K tokens): FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608) reaches ~600 TFLOPS forward and
# ~450 backward at these sizes on an H100, and the backward does 2/3 of the FLOPs: 3 / (1/0.6 + 2/0.45)
# = 0.49 of 989.
ATTENTION_EFFICIENCY = 0.49
# Bytes an FP8 linear moves to quantize one element of its input (forward) or output grad (backward) from
# BF16, both orientations (the weight grad needs the transpose): per-tensor current scaling first reads the
# tensor for its amax, then reads it again and writes e4m3 twice (2 + 2 + 1 + 1); 1x128 tiles take their scale
# in the same pass (2 + 1 + 1, the FP32 scales 1/32 more). BF16 linears quantize nothing.
QUANTIZE_BYTES = {"bf16": 0.0, "fp8-tensor": 6.0, "fp8-block": 4.0 + 4 / 128, "fp8-block-te": 4.0 + 4 / 128}
# Seconds per routed slot (one token's copy to one of its top_k experts) of an MoE layer's forward + backward that
# the GEMMs, the memory-bound ops' bytes and the links' bytes above do not account for: the router's top-k and
# the permutation's index work, the dispatch/combine kernels' per-token processing, the host syncs on expert
# counts and the eager launches around them. No public source breaks it down, so it is fitted to the published
# runs (launch/plan/calibration.toml; `moe-plan --validate` refits it and prints each run's leave-one-out ratio),
# one cost per way a stack handles the slots (MOE_HANDLING; `moe-plan --moe-handling`), each over that way's runs:
# - "synced": the stack reads the expert counts to the host in every MoE layer and launches the permutation and
#   the exchange eagerly around that read (Megatron-Core's NCCL all-to-all dispatcher, graphed or not, and its flex
#   dispatcher without CUDA graphs; DeepSeek's and NeMo AutoModel's runs; this project's runtime): 0.245 us a
#   slot over DeepSeek's, Megatron-Core's and NeMo AutoModel's runs on H800, H100 and B200, alike from hidden
#   2048 to 7168 (it scales with slots, not with bytes: a cost per byte misses by 1.5x).
# - "captured": the router and the MoE preprocessing replayed as CUDA graphs in front of a fused dispatcher
#   (Megatron-Core's flex dispatcher on DeepEP or HybridEP with cuda_graph_scope moe_router + moe_preprocess; which
#   part of the slot's cost the graphs and the fused kernels each take off is not published): fitted to NVIDIA's
#   HybridEP A/B of Qwen3-30B on 16 H100 (24.71 and 20.99 s a step), whose Nsight profile puts the dispatch with
#   permute and the preprocess at 7.4 s of the 24.7 (73 ns a slot, their communication included); of the eight other
#   published runs of such a stack it predicts six within the band (Qwen3-30B on B200 at MBS4; DeepSeek-V3 on B200
#   and Qwen3-235B on 256 H100, both on DeepEP; the three Qwen3 rows on GB200) and misses DeepSeek-V3 on GB200.
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
