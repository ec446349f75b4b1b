"""Triton kernels (FP8 quantisation, grouped GEMM) with plain-torch references."""
