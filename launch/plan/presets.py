"""GPU and network presets (with their sources) and byte recipes of model states."""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class GPU:
    """One accelerator and its links: dense peaks, memory and per-GPU one-direction bandwidths."""

    name: str
    bf16_tflops: float      # dense BF16 peak (the MFU denominator; with fp8_tflops mixed in for FP8 experts)
    fp8_tflops: float       # dense FP8 peak (FP8 expert GEMMs run against it; launch.metrics.flops.mixed_peak)
    memory_gb: float        # HBM capacity, 1e9 bytes
    intra_node_gbps: float  # NVLink, GB/s per GPU per direction
    inter_node_gbps: float  # InfiniBand/RoCE NIC per GPU, GB/s per direction
    source: str
    exchange_latency_us: float = 0.0  # fixed cost of one all-to-all exchange of an EP hop, on top of its bytes
    hbm_gbps: float = 3350.0  # HBM bandwidth, GB/s (launch.plan.efficiency prices GEMM operand and output bytes)
    host_gbps: float = 64.0  # host link (PCIe 5.0 x16: 64 GB/s per direction), for an offloaded optimizer's copies


GPUS: dict[str, GPU] = {
    "h800": GPU("H800 SXM", 989.0, 1979.0, 80.0, 160.0, 50.0,
                "NVIDIA H800 SXM datasheet (Hopper compute and 3.35 TB/s HBM3 as H100 SXM); NVLink ~160 GB/s and "
                "IB ~50 GB/s per GPU as achieved in DeepSeek-V3 report (arXiv 2412.19437) section 3.2.2",
                hbm_gbps=3350.0),
    "h100": GPU("H100 SXM", 989.0, 1979.0, 80.0, 450.0, 50.0,
                "NVIDIA H100 SXM datasheet: 989 TFLOPS BF16 / 1979 FP8 dense, 80 GB HBM3 at 3.35 TB/s, NVLink4 "
                "900 GB/s bidirectional; one 400 Gb/s ConnectX-7 NDR NIC per GPU (DGX H100)", hbm_gbps=3350.0),
    "h200": GPU("H200 SXM", 989.0, 1979.0, 141.0, 450.0, 50.0,
                "NVIDIA H200 SXM datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s, NVLink4 900 GB/s "
                "bidirectional; one 400 Gb/s NDR NIC per GPU (DGX H200)", hbm_gbps=4800.0),
    "b200": GPU("B200", 2250.0, 4500.0, 180.0, 900.0, 50.0,
                "NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training / 8 GPUs (dense half of sparse peaks), "
                "1440 GB HBM3e / 8 (64 TB/s / 8), NVLink5 1.8 TB/s bidirectional; 8x 400 Gb/s ConnectX-7 per node",
                hbm_gbps=8000.0),
    "gb200": GPU("GB200 NVL72", 2500.0, 5000.0, 186.0, 900.0, 50.0,
                 "NVIDIA GB200 NVL72 spec, a rack of 72 GPUs: 360 / 720 PFLOPS BF16 / FP8 with sparsity (2.5 / 5 dense "
                 "a GPU, against HGX B200's 2.25 / 4.5), 13.4 TB HBM3e at 576 TB/s (186 GB at 8 TB/s a GPU; MLPerf's "
                 "GB200 system descriptions list 186 GB), NVLink5 130 TB/s (1.8 TB/s bidirectional a GPU across the "
                 "rack's NVLink domain; gpus_per_node: the part of it a job spans, e.g. 64 of 72); one 400 Gb/s "
                 "ConnectX-7 a GPU; NVLink-C2C to its Grace CPU at 900 GB/s bidirectional",
                 hbm_gbps=8000.0, host_gbps=450.0),
}


def preset_for_device(device_name: str) -> GPU | None:
    """The preset whose key appears in a device's name (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3"), or None."""
    words = device_name.lower().replace("-", " ").split()
    return next((gpu for key, gpu in GPUS.items() if key in words), None)


def gpu_preset(name: str) -> GPU:
    """The preset called name (case-insensitive); ValueError naming the allowed ones."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"--gpu {name!r} is not a known GPU; choose one of {', '.join(GPUS)} "
                         f"(or give --peak-tflops, --intra-node-gbps and --inter-node-gbps for another)")
    return GPUS[key]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the model states: weights, gradients, optimizer (sharded by ZeRO)."""

    name: str
    param: float
    grad: float
    optimizer: float
    source: str


RECIPES: dict[str, StateBytes] = {
    "zero-paper": StateBytes("zero-paper", 2, 2, 12, "ZeRO (Rajbhandari et al. 2020): fp16 params and grads, "
                             "fp32 master + Adam moments (K = 12)"),
    "project-bf16": StateBytes("project-bf16", 2, 4, 12, "this project's ZeroOptimizer on bf16 weights: grads summed "
                               "in a full fp32 flat buffer and reduce-scattered in place, fp32 master + AdamW moments "
                               "sharded"),
    "project-fp32": StateBytes("project-fp32", 4, 4, 8, "this project's ZeroOptimizer on fp32 weights (CPU runs): the "
                               "weights are their own masters (counted as params), grads reduce-scattered in place, "
                               "AdamW moments sharded"),
    "project-fp32-bf16-moments": StateBytes("project-fp32-bf16-moments", 4, 4, 4, "project-fp32 with "
                                            "optim.moment_dtype = \"bfloat16\": AdamW moments stored in BF16"),
    "megatron": StateBytes("megatron", 2, 4, 12, "Megatron-Core's distributed optimizer: BF16 params, FP32 main grads, "
                           "FP32 main params + Adam moments sharded over DP (its docs: 6 + 12/d bytes per param)"),
    "deepseek-v3": StateBytes("deepseek-v3", 2, 4, 8, "DeepSeek-V3 report section 3.3.3: BF16 weights, FP32 grads "
                              "and master weights, BF16 AdamW moments; this project's ZeroOptimizer on bf16 weights "
                              "with optim.moment_dtype = \"bfloat16\" (grads reduce-scattered in place)"),
}
