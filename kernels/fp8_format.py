"""The FP8 recipe's numbers, importable without torch (the Gluon kernels' ahead-of-time compile check runs under a
Triton with no torch beside it): tile width, e4m3's largest value, the scale floor, TMA's row alignment."""

TILE = 128  # elements per 1x128 activation tile and per side of a 128x128 weight block; the promotion interval
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_EPS = 1e-12  # floor of a tile's absolute maximum, so an all-zero tile gets a finite scale
ALIGN = 16  # e4m3 elements (= bytes) every row of an FP8 GEMM operand is a multiple of (TMA row alignment)
