"""Triton kernels (FP8 quantisation, grouped GEMM) with plain-torch references.

Importing this package needs neither a GPU nor Triton: the Triton modules load on first use.
"""

from kernels.backend import BACKEND_ENV, BACKENDS
from kernels.linear import FP8GroupedLinear, FP8Linear, FP8Rows, fp8_grouped_linear
from kernels.metrics import calc_diff
from kernels.ops import (fp8_grouped_gemm, fp8_grouped_gemm_dgrad, fp8_grouped_gemm_wgrad, quantize_activation,
                         quantize_activation_kgrouped, quantize_weight, retile_kgrouped)
from kernels.quant_ref import (FP8_DTYPE, FP8_MAX, TILE, dequantize_activation, dequantize_kgrouped,
                               dequantize_weight)

__all__ = [
    "BACKENDS", "BACKEND_ENV", "FP8_DTYPE", "FP8_MAX", "FP8GroupedLinear", "FP8Linear", "FP8Rows", "TILE", "calc_diff",
    "dequantize_activation", "dequantize_kgrouped", "dequantize_weight", "fp8_grouped_gemm",
    "fp8_grouped_gemm_dgrad", "fp8_grouped_gemm_wgrad", "fp8_grouped_linear", "quantize_activation",
    "quantize_activation_kgrouped", "quantize_weight", "retile_kgrouped",
]
