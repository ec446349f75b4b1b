"""[train], [data], [parallel] and [optim]: the run's sections beside [model] (moe.config) and [ops]
(launch.config.ops), each checked on its own (checks across sections: launch.config.checks)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dispatch.choices import allowed_values, check_choice
from dispatch.dispatcher import Exchange, Payload
from dispatch.topology import DispatchBackend
from kernels.backend import GemmKernels
from launch.parallel.device import CommBackend, Device
from launch.parallel.mesh import ONE_NODE, Layout
from moe.config import ModelConfig, check_positive
from moe.cp import CpMethod
from moe.recompute import Recompute
from optim.zero import MomentDtype, ZeroStage
from pipeline.schedules import ScheduleName

Dtype = Literal["float32", "bfloat16", "float64"]
ONLY_AT_END = 0  # train.checkpoint_every, train.eval_every: no periodic ones, only after the last step
PEAK_FROM_GPU = 0.0  # train.peak_tflops_per_gpu: looked up from the GPU's name


@dataclass
class TrainSettings:
    """[train]: the optimisation, the step loop, its checkpoints, evaluations and records."""

    steps: int = 200
    """Optimizer steps the run trains for (a resumed run goes on to this many)."""
    micro_batch_size: int = 16
    """Sequences in one micro-batch (one forward and backward of a DP rank)."""
    grad_accum_steps: int = 1
    """Micro-batches in one optimizer step, over all DP ranks (a multiple of parallel.dp): a step holds
    micro_batch_size x grad_accum_steps sequences."""
    seq_len: int = 128
    """Tokens in one training sequence (at most model.max_seq_len)."""
    lr: float = 3e-3
    """Peak learning rate, reached after the warmup; it then decays along a cosine (optim.lr_schedule)."""
    min_lr_ratio: float = 0.1
    """Learning rate the cosine decays to by the last step, as a fraction of lr (in [0, 1])."""
    warmup_steps: int = 20
    """Steps of the linear warmup from lr / warmup_steps to lr."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay (>= 0)."""
    beta1: float = 0.9
    """AdamW's first-moment decay (in [0, 1))."""
    beta2: float = 0.95
    """AdamW's second-moment decay (in [0, 1))."""
    grad_clip: float = 1.0
    """Largest global L2 norm of the gradients: larger ones are scaled down to it (> 0)."""
    seed: int = 0
    """Seed of the initial weights (each drawn from a seed derived from it and the weight's name) and of the data
    order."""
    dtype: Dtype = "float32"
    """Dtype of the parameters and activations."""
    device: Device = "auto"
    """Where the ranks compute: "auto" on CUDA when it is available (cuda:LOCAL_RANK per rank), else on the CPU;
    "cuda" or "cpu" force one (launch.parallel.device)."""
    run_dir: str = "runs/default"
    """Folder of the run: checkpoints, metrics.jsonl, logs, the prepared corpus, TensorBoard events."""
    checkpoint_every: int = ONLY_AT_END
    """Steps between checkpoints; `ONLY_AT_END`: a checkpoint after the last step only (one is always saved
    there)."""
    eval_every: int = 50
    """Steps between evaluations on held-out data; `ONLY_AT_END`: after the last step only (always evaluated when
    there is held-out data)."""
    eval_batches: int = 4
    """Held-out micro-batches one evaluation averages over (rounded up to a multiple of the DP ranks); 0: no
    evaluation."""
    peak_tflops_per_gpu: float = PEAK_FROM_GPU
    """Peak dense TFLOP/s of one GPU, the denominator of the MFU metric; `PEAK_FROM_GPU`: looked up from the GPU's
    name and the run's precision (no MFU on CPU)."""
    tensorboard: bool = False
    """Also write TensorBoard events to run_dir/tensorboard."""
    rank_metrics_every: int = 10
    """Steps between the records' per-rank sections (gathered to rank 0); the last step always has one."""
    recompute: Recompute = "none"
    """Activation recomputation (moe.recompute): "none" keeps every activation for the backward; "selective"
    (DeepSeek-V3's) rebuilds the norms' outputs, MLA's q/k/v and the SwiGLU products in the backward; "full" keeps
    each block segment's inputs only and reruns the segment."""
    cuda_graphs: bool = False
    """Capture each micro-batch's forward, loss and backward in a CUDA graph and replay it for the later micro-batches
    of the same shape (issue 48; launch.train.graphs): 2 eager micro-batches of a shape warm up on a side stream, the
    next one is captured (one private memory pool per rank), every later one is copied into the graph's static
    buffers and replayed. With parallel.pp > 1 each compute action of the pipeline schedule (a forward, a backward,
    a W action, a DualPipe F&B pair) of each stage and chunk has its graph: one eager pipeline step warms up, the
    next is captured, the later ones replayed; the p2p messages stay eager, between the graphs (pipeline.graphs).
    The step must read nothing to the host: ranks on CUDA GPUs, and with parallel.ep > 1
    parallel.dispatch_exchange = "padded" or "device_split" (its all-to-alls are captured). Captured today: tp = cp
    = 1, no redundant experts, optim.zero_stage = 1, any pp, dp and ep (ZeRO's reduction runs after the backward, not
    during it: parallel.overlap_grad_reduce is not used); other layouts are refused before any process starts,
    naming the key. Steps of a fault drill's loss scale, the held-out evaluation and the exact rerun of an
    overflowed padded exchange run eagerly (the graphs are captured again after such a rerun). moe-plan prices the
    routed slots of such a runtime as "captured" (launch.plan.efficiency.SLOT_SECONDS) instead of "synced", for any
    layout. Default false."""
    fp8_gemm: GemmKernels = "reference"
    """Which Triton FP8 grouped GEMMs (the forward, dgrad and wgrad of FP8 experts and linears) run on CUDA: "auto" the
    persistent warp-specialised Gluon kernels on sm_90 GPUs (H100/H200) with a Triton that has Gluon (>= 3.6), the
    `tl` reference kernels elsewhere; "fast" the Gluon kernels (an error where they cannot run); "reference" the `tl`
    kernels. The environment variable MOE_FP8_GEMM, when set, overrides it (kernels.backend). Default "reference"
    until the Gluon kernels pass `python -m kernels.gpu_check` on an H100/H200 (they compile for sm_90a here, but
    have not run on a GPU yet: issue 47); "auto" is meant to become the default then."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "grad_accum_steps", "seq_len", "rank_metrics_every"):
            check_positive(name, getattr(self, name))
        for name in ("warmup_steps", "checkpoint_every", "seed", "eval_every", "eval_batches"):
            check_positive(name, getattr(self, name), minimum=0)
        for name in ("lr", "grad_clip"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} = {getattr(self, name)!r} must be > 0")
        if self.peak_tflops_per_gpu < 0:
            raise ValueError(f"train.peak_tflops_per_gpu = {self.peak_tflops_per_gpu!r} must be >= 0 "
                             f"({PEAK_FROM_GPU}: from the GPU)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio = {self.min_lr_ratio!r} must be in [0, 1]")
        check_choice("train.dtype", self.dtype, Dtype)
        check_choice("train.device", self.device, Device)
        check_choice("train.recompute", self.recompute, Recompute)
        check_choice("train.fp8_gemm", self.fp8_gemm, GemmKernels)


@dataclass
class DataSettings:
    """[data]: where the training tokens come from: data.sources (datasets `moe-data prepare` made, blended by
    weight), or data.corpus prepared into the run directory. Paths written in a config file are relative to that
    file (launch.data.feed, launch.data.shards)."""

    corpus: str = "stdlib"
    """Text to train on when data.sources is empty: "stdlib" (Python's own standard-library sources), or a text
    file or a folder of them; tokenised into run_dir/data."""
    max_bytes: int = 4_000_000
    """How much of the corpus is tokenised, in tokens (bytes with the byte tokenizer); the rest is not read."""
    eval_fraction: float = 0.02
    """Share of the corpus's tokens held out for evaluation, taken from its end (in [0, 0.5))."""
    tokenizer: str = "bytes"
    """"bytes" (one token per byte), a tokenizer.json, or a Hugging Face model folder holding one."""
    sources: list[dict] = field(default_factory=list)
    """Prepared datasets to train on instead of the corpus: [{path = FOLDER, weight = W}, ...], each FOLDER made
    by `moe-data prepare` with data.tokenizer, sampled in proportion to its weight (a finite number > 0)."""
    eval_sources: list[dict] = field(default_factory=list)
    """Held-out prepared datasets for evaluation with data.sources: [{path = FOLDER}, ...], none of them a
    training source."""
    prefetch_steps: int = 1
    """Steps whose rows a background thread reads ahead; 0: each row read when first used."""
    document_mask: bool = False
    """Keep attention, RoPE positions and the loss inside each document: rows split after every end-of-document
    token of data.tokenizer (moe.documents; Megatron's reset_attention_mask + reset_position_ids +
    eod_mask_loss)."""

    def __post_init__(self) -> None:
        check_positive("data.max_bytes", self.max_bytes)
        check_positive("data.prefetch_steps", self.prefetch_steps, minimum=0)
        if not 0 <= self.eval_fraction < 0.5:
            raise ValueError(f"data.eval_fraction = {self.eval_fraction!r} must be in [0, 0.5)")
        if self.corpus != "stdlib" and not Path(self.corpus).exists():
            raise ValueError(f"data.corpus = {self.corpus!r}: no such file or folder "
                             f"(give a path to text files, or \"stdlib\" for the shipped default)")
        train = [_check_source("data.sources", i, s, ("path", "weight")) for i, s in enumerate(self.sources)]
        held = [_check_source("data.eval_sources", i, s, ("path",)) for i, s in enumerate(self.eval_sources)]
        if self.eval_sources and not self.sources:
            raise ValueError("data.eval_sources needs data.sources (the corpus holds out data.eval_fraction itself)")
        for i, path in enumerate(held):
            if path in train:
                raise ValueError(f"data.eval_sources[{i}].path = {self.eval_sources[i]['path']!r} is also a training "
                                 f"source (data.sources[{train.index(path)}]): held-out data must differ")

    @property
    def has_held_out(self) -> bool:
        """Whether the run has held-out data: data.eval_sources, or the corpus's data.eval_fraction."""
        return bool(self.eval_sources) if self.sources else self.eval_fraction > 0


def _check_source(field_name: str, index: int, source: object, keys: tuple[str, ...]) -> Path:
    """A source table {path, weight}: its keys, a path to an existing folder, a finite weight > 0; its resolved path."""
    name = f"{field_name}[{index}]"
    if not isinstance(source, dict):
        raise ValueError(f"{name} = {source!r} must be a table {{{', '.join(f'{k} = ...' for k in keys)}}}")
    for key in keys:
        if key not in source:
            raise ValueError(f"{name}.{key} is missing (each entry gives {', '.join(keys)})")
    for key in source:
        if key not in keys:
            raise ValueError(f"unknown key {name}.{key}; allowed: {', '.join(keys)}")
    if not isinstance(source["path"], str) or not Path(source["path"]).is_dir():
        raise ValueError(f"{name}.path = {source['path']!r}: no such folder (a dataset `moe-data prepare` made)")
    weight = source.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{name}.weight = {weight!r} must be a finite number > 0")
    return Path(source["path"]).resolve()


Schedule = Literal["none", ScheduleName]  # "none": no pipeline (parallel.pp = 1)
ENDS_TOGETHER = ("dualpipev", "dualpipe")  # schedules placing the first and the last stage on one rank
ALL_MICRO_BATCHES = 0  # parallel.num_chunks: one pipeline step runs all of a DP rank's micro-batches of a step


@dataclass
class ParallelSettings:
    """[parallel]: the layout, world = pp x dp x cp x tp ranks (TP innermost, then CP, DP, PP), EP folded over a
    stage's dp x cp x tp ranks, and how the pipeline, the expert dispatch and the collectives run."""

    pp: int = 1
    """Pipeline-parallel ranks: the layers are cut into stages over them (parallel.schedule)."""
    dp: int = 1
    """Data-parallel ranks: each runs its share of a step's micro-batches."""
    tp: int = 1
    """Tensor-parallel ranks: attention heads, FFN widths and the vocabulary split over them (moe.tp)."""
    ep: int = 1
    """Expert-parallel ranks: a stage's routed experts split over them (must divide dp x cp x tp and
    model.num_experts); each expert is replicated over dp x cp x tp / ep ranks."""
    cp: int = 1
    """Context-parallel ranks: each sequence split over them in 2 x cp zig-zag chunks (moe.cp); for gradient sums
    they are data replicas."""
    cp_method: CpMethod = "ring"
    """How CP attention sees the whole sequence: "ring" passes K/V blocks round the CP ranks, each hop's transfer
    beside the attention of the block in hand; "allgather" gathers all K/V at once (one collective, cp x the K/V
    memory)."""
    sequence_parallel: bool = False
    """With tp > 1, split the activations outside attention and the FFNs over the TP ranks along the sequence (SP)."""
    gpus_per_node: int = ONE_NODE
    """Ranks (GPUs) on one node, dividing the world size: consecutive ranks share a node, and the hierarchical
    dispatch crosses nodes once. On CPU the nodes are simulated. `ONE_NODE`: every rank on one node."""
    schedule: Schedule = "none"
    """Pipeline schedule: "none" without a pipeline (pp = 1); with pp > 1 one of the pipeline's schedules
    (pipeline.schedules; "dualpipe" needs an even pp; "dualpipev" runs two stages per rank)."""
    num_chunks: int = ALL_MICRO_BATCHES
    """Micro-batches one pipeline step runs (dividing the grad_accum_steps / dp a DP rank runs per step; at least
    what the schedule needs to fill the pipeline); `ALL_MICRO_BATCHES`: all of them in one pipeline step."""
    defer_weight_grads: bool = True
    """Split each backward into B (input grads, sent upstream at once) and W (weight grads, run later by the
    schedule's W actions), as zero-bubble schedules and DualPipe do (pipeline.wgrad); false: a backward computes
    both."""
    chunks_per_weight_grad: int = 1
    """Chunks whose weight grads one W action computes together, as one larger GEMM per weight
    (schedules.merge_weight_grads); > 1 needs defer_weight_grads. Holds each chunk's layer inputs and output grads
    until then."""
    overlap_fb_pairs: bool = True
    """In DualPipe's paired forward-and-backward actions, run one chunk's backward while the other chunk's forward
    waits on its expert all-to-all (on a helper thread beside the forward when both stages allow it,
    pipeline.overlap); false: each pair runs its forward, then its backward."""
    overlap_grad_reduce: bool = True
    """Start each gradient bucket's reduce-scatter over its replicas during the step's last backward, once its
    grads are final; false: reduce after the backward (bitwise the same)."""
    dispatch_backend: DispatchBackend = "flat"
    """Expert dispatch and combine: "flat" sends each token once to every EP rank holding one of its experts;
    "hierarchical" sends it once per destination node, then within the node (dispatch)."""
    dispatch_payload: Payload = "bf16"
    """Dispatched rows travel "bf16" (in the activations' own dtype) or "fp8" (e4m3 with one scale per 128
    channels); combine always travels in the activations' dtype."""
    dispatch_chunks: int = 1
    """Chunks of tokens the hierarchical dispatch pipelines its two hops in (> 1 only with "hierarchical")."""
    dispatch_exchange: Exchange = "exact"
    """How the expert dispatch sizes its exchanges: "exact" reads each exchange's row counts to the host (traded
    between the EP ranks, then handed to the all-to-all as lists); "padded" sends a fixed number of rows to every EP
    peer and hands the experts a fixed number of rows, bounds derived from the tokens per micro-batch, model.top_k,
    parallel.ep and parallel.dispatch_headroom, so no MoE layer reads the device in forward or backward and every
    step issues the same shapes. A step whose routing exceeds a bound is rerun on the exact path (no token lost, the
    same math) and the bounds doubled for later steps; the metric `dispatch_reruns` counts them. With
    parallel.dispatch_chunks > 1 every chunk has the same bounds, from its share of the tokens. "device_split" is
    "padded" (the same bounds, layout, overflow rule and rerun; accepted and refused where "padded" is) with only each
    block's filled rows on the wire, their counts kept on the device (dispatch.device_split): on CUDA ranks of an NCCL
    group with NVSHMEM (torch symmetric memory's all_to_all_vdev; not yet run on a GPU over more than one rank),
    elsewhere (gloo, CPU, or CUDA without NVSHMEM) a reference that moves whole blocks and pads the rows past the
    counts, to the same result. Default "exact"."""
    dispatch_headroom: float = 2.0
    """With parallel.dispatch_exchange = "padded" or "device_split": the bounds' factor over a balanced routing's rows
    (> 0). Larger: fewer reruns, more padding moved and held. Flat: rows per EP peer min(T, ceil(h x T x min(k, ep) /
    ep)), expert rows per rank ceil(h x T x k) (T tokens per micro-batch and rank, k = model.top_k); hierarchical:
    each hop's bound likewise from the rows a balanced routing brings it, per chunk of ceil(T /
    parallel.dispatch_chunks) tokens (dispatch.EPDispatcher.padded_bounds)."""
    comm_backend: CommBackend = "auto"
    """Backend of the process groups: "auto" is NCCL on CUDA ranks and gloo on CPU ones; "gloo" or "nccl" force
    one."""
    redundant_experts: int = 0
    """Spare expert slots per EP rank (0 to the experts per EP rank, model.num_experts / parallel.ep; > 0 needs
    parallel.ep > 1 and dropless routing): each holds a copy of a hot expert, placed every
    parallel.rebalance_every steps from the loads of the last window (moe.replicas), so a skewed routing's rows
    are split over the copies; owners never move (one optimizer state per expert, checkpoints hold owners and
    the placement). 0: no spare slots."""
    rebalance_every: int = 100
    """Steps between placements of the redundant experts (>= 1): each one reads the loads all-reduced over those
    steps (unit: optimizer steps)."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "ep", "cp", "chunks_per_weight_grad", "dispatch_chunks"):
            check_positive(f"parallel.{name}", getattr(self, name))
        check_choice("parallel.cp_method", self.cp_method, CpMethod)
        for name in ("gpus_per_node", "num_chunks", "redundant_experts"):
            check_positive(f"parallel.{name}", getattr(self, name), minimum=0)
        check_positive("parallel.rebalance_every", self.rebalance_every)
        check_choice("parallel.schedule", self.schedule, Schedule)
        check_choice("parallel.dispatch_backend", self.dispatch_backend, DispatchBackend)
        check_choice("parallel.dispatch_payload", self.dispatch_payload, Payload)
        check_choice("parallel.dispatch_exchange", self.dispatch_exchange, Exchange)
        if isinstance(self.dispatch_headroom, bool) or not isinstance(self.dispatch_headroom, (int, float)) \
                or not self.dispatch_headroom > 0:
            raise ValueError(f"parallel.dispatch_headroom = {self.dispatch_headroom!r} must be a number > 0")
        check_choice("parallel.comm_backend", self.comm_backend, CommBackend)
        if self.dispatch_chunks > 1 and self.dispatch_backend != "hierarchical":
            raise ValueError(f"parallel.dispatch_chunks = {self.dispatch_chunks} pipelines the two hops of "
                             f"parallel.dispatch_backend = 'hierarchical'; with {self.dispatch_backend!r} allowed: 1")
        if (self.pp == 1) != (self.schedule == "none"):
            allowed = "'none'" if self.pp == 1 else ", ".join(map(repr, allowed_values(ScheduleName)))
            raise ValueError(f"parallel.schedule = {self.schedule!r} with parallel.pp = {self.pp}: allowed {allowed}")
        if self.schedule == "dualpipe" and self.pp % 2:
            raise ValueError(f"parallel.pp = {self.pp}: schedule 'dualpipe' needs an even pp (allowed: 2, 4, 6, ...)")
        if self.stage_ranks % self.ep:
            allowed = [d for d in range(1, self.stage_ranks + 1) if self.stage_ranks % d == 0]
            raise ValueError(f"parallel.ep = {self.ep} must divide dp x cp x tp = {self.stage_ranks} "
                             f"(allowed: {', '.join(map(str, allowed))})")
        if self.gpus_per_node != ONE_NODE and self.world_size % self.gpus_per_node:
            allowed = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise ValueError(f"parallel.gpus_per_node = {self.gpus_per_node} must divide the world size "
                             f"pp x dp x cp x tp = {self.world_size} (allowed: {ONE_NODE} (one node), "
                             f"{', '.join(map(str, allowed))})")

    @property
    def stage_ranks(self) -> int:
        """Ranks holding one pipeline stage (dp x cp x tp): the EP groups fold over them."""
        return self.dp * self.cp * self.tp

    @property
    def world_size(self) -> int:
        """Ranks the layout needs."""
        return self.pp * self.stage_ranks

    @property
    def num_stages(self) -> int:
        """Pipeline stages the model is split into (DualPipeV: two per rank)."""
        return 2 * self.pp if self.schedule == "dualpipev" else self.pp

    def chunks_per_step(self, grad_accum_steps: int) -> int:
        """Micro-batches one DP rank runs in one pipeline step, of train.grad_accum_steps over all DP ranks."""
        return grad_accum_steps // self.dp if self.num_chunks == ALL_MICRO_BATCHES else self.num_chunks

    def layout(self, model: ModelConfig) -> Layout:
        """The rank layout of these settings for model (its MTP modules may need an embedding copy on the last
        stage's rank; no communication)."""
        return Layout(self.pp, self.dp, self.tp, self.ep, self.gpus_per_node, mirrored=self.schedule == "dualpipe",
                      cp=self.cp, hop_groups=self.dispatch_backend == "hierarchical" and self.ep > 1,
                      embed_copy=model.mtp_depth > 0 and self.pp > 1 and self.schedule not in ENDS_TOGETHER)


Offload = Literal["none", "optimizer"]


@dataclass
class OptimSettings:
    """[optim]: the distributed optimizer (optim.ZeroOptimizer): AdamW whose fp32 masters and moments are sharded over each
    parameter's replicas."""

    zero_stage: ZeroStage = 1
    """What is sharded: 1 the fp32 masters and AdamW moments; 2 also the grads (reduce-scattered during every
    backward, full grads freed); 3 also the dense params (each module's gathered around its forward and backward,
    per micro-batch; optim.zero3)."""
    offload: Offload = "none"
    """"optimizer" (ZeRO-Offload, zero_stage 1 or 2) keeps the fp32 masters and AdamW moments in host memory and
    updates them there; "none" keeps them on the device."""
    moment_dtype: MomentDtype = "float32"
    """Dtype AdamW's two moments (exp_avg, exp_avg_sq) are stored in, on the device or offloaded: "bfloat16" (DeepSeek-V3's
    recipe) halves their bytes; each step still updates them in fp32 arithmetic and rounds them once. The masters
    stay fp32. A checkpoint with moments of the other dtype is converted on load, with a warning."""
    ema_decay: float = 0.0
    """Decay of an exponential moving average of the weights kept in host memory (never on the device), updated
    after each optimizer step in the background: ema = decay x ema + (1 - decay) x master, from the fp32 masters,
    saved in checkpoints (`moe-train export --weights ema` writes it). 0.0 (the default) keeps none; otherwise in
    (0, 1)."""

    def __post_init__(self) -> None:
        check_choice("optim.zero_stage", self.zero_stage, ZeroStage)
        check_choice("optim.offload", self.offload, Offload)
        check_choice("optim.moment_dtype", self.moment_dtype, MomentDtype)
        if not (isinstance(self.ema_decay, (int, float)) and not isinstance(self.ema_decay, bool)
                and (self.ema_decay == 0.0 or 0.0 < self.ema_decay < 1.0)):
            raise ValueError(f"optim.ema_decay = {self.ema_decay!r} is not allowed; choose 0.0 (no weight EMA) or a "
                             f"decay in (0, 1), e.g. 0.999")

