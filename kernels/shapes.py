"""Issue 47's shape table of the FP8 grouped GEMMs (DeepSeek-V3's expert shapes), shared by `moe-bench kernels` and
kernels.gpu_check: (op, N, K, group sizes), dgrad's N and K being its forward's (it reduces N, its output is K wide)."""

JAGGED = (0, 4093, 8192, 1, 6000, 2048, 4096, 8338)  # 32768 rows as 8 x 4096, an empty and a 4093-row group
MGROUPED_SIZES = ((4096,) * 8, (8192,) * 4, (512,) * 8, (512,) * 32, (128,) * 32, JAGGED)
WGROUPED_SIZES = ((4096,) * 8, (512,) * 32, (8192,) * 4)
EXPERT_SHAPES = ((4096, 7168), (7168, 2048))  # (N, K) of the gate|up half and of the down projection
SHAPE_TABLE = ([(op, n, k, sizes) for op in ("forward", "dgrad") for n, k in EXPERT_SHAPES for sizes in MGROUPED_SIZES]
               + [("wgrad", n, k, sizes) for n, k in EXPERT_SHAPES for sizes in WGROUPED_SIZES])
