"""Memory per rank: model states under ZeRO stages, activations per layer (SP, recomputation) and the
schedule's peak of live chunks (DualPipe: 2x params, PP+1 chunks in flight)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from launch.plan.params import AttentionShape
from launch.plan.presets import StateBytes
from launch.plan.timing import StageCost
from launch.plan.traffic import cp_kv_width
from moe.config import ModelConfig
from moe.cp import CP_METHODS
from moe.recompute import RECOMPUTE
from pipeline.schedules import Op, Schedule

KERNELS = ("project", "fused", "fused-fp8")
# What moe-plan plans besides this runtime's modes (RECOMPUTE), for the published runs of calibration.toml that use
# them (neither `moe-plan --recompute` nor train.recompute offers them): "moe", Megatron-Core's
# `--recompute-modules layernorm moe`: an MoE layer's MoE block (router, dispatch, experts, combine, shared experts)
# keeps nothing and reruns, exchanges included, before its backward; of the norms only the MoE layer's FFN norm is
# recomputed (keeps its input): Transformer Engine's layer spec fuses the attention norm (and a dense layer's FFN
# norm) into the next linear, which the layernorm module leaves alone. "layer", the other stacks' full recompute
# (Megatron-Core's --recompute-granularity full with one layer a checkpoint, torchtitan's and FSDP2's activation
# checkpointing of each block): a layer keeps its input only and reruns its whole forward, exchanges and collectives
# included, before its backward, where this runtime's "full" keeps what its communication-free segments need so that
# nothing is exchanged twice.
PLAN_RECOMPUTE = (*RECOMPUTE, "moe", "layer")
RERUN_EXCHANGES = ("moe", "layer")  # the modes whose backward first reruns its layers' EP exchanges
FP8_CACHED = 1 + 4 / 128  # bytes per element of an e4m3 tensor with one fp32 scale per 128 (1x128 tiles)
FP8_WEIGHT_COPY = 1 + 4 / 128**2  # bytes per element of an e4m3 weight copy with one fp32 scale per 128x128 block


@dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank's weights, gradients and optimizer state on the GPU, and what it keeps in host memory
    (ZeRO-Offload: masters, optimizer state, the grad shards' copies)."""

    params: float
    grads: float
    optimizer: float
    host: float = 0.0

    def __add__(self, other: ModelStates) -> ModelStates:
        return ModelStates(self.params + other.params, self.grads + other.grads, self.optimizer + other.optimizer,
                           self.host + other.host)

    @property
    def total(self) -> float:
        """All model-state bytes on the GPU."""
        return self.params + self.grads + self.optimizer


def offloaded(states: ModelStates, num_params: float, shard_group: int, recipe: StateBytes) -> ModelStates:
    """states with the optimizer moved to host memory (optim.offload "optimizer"): its state, the fp32 masters
    (apart from the params where those are fp32 and were their own masters) and a host copy of the reduced fp32
    grad shard."""
    shard = num_params / shard_group
    masters = 4 * shard if recipe.param >= 4 else 0.0
    return ModelStates(states.params, states.grads, 0.0, states.host + states.optimizer + masters + 4 * shard)


def zero_model_states(num_params: float, shard_group: int, stage: int, recipe: StateBytes) -> ModelStates:
    """Model-state bytes of num_params params under ZeRO stage 0-3 sharded over shard_group ranks
    (stage 1: optimizer sharded; 2: and grads; 3: and params)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage = {stage!r} is not allowed; choose one of 0, 1, 2, 3")
    if shard_group < 1:
        raise ValueError(f"shard group size = {shard_group!r} must be >= 1")
    split = [1 if stage < s else shard_group for s in (3, 2, 1)]
    return ModelStates(num_params * recipe.param / split[0],
                       num_params * recipe.grad / split[1],
                       num_params * recipe.optimizer / split[2])


@dataclass(frozen=True)
class ActivationModel:
    """Saved-for-backward bytes per token of each layer kind on one rank, by component formulas.

    kernels="project" counts what this project's model (moe.model, moe.layer) saves op by op on a GPU: an
    RMSNorm (CUDA's fused kernel) keeps its input and an fp32 rstd per row, its consumer the output; k and v
    are expanded to every query head before attention (q, k, v, output and the fp32 log-sum-exp kept,
    no scores), the output projection keeps its own copy of the attention output; a SwiGLU keeps
    gate|up, silu(gate) and the product; combine keeps each slot's expert output, its weight and its two
    row ids. kernels="fused" counts fused kernels (norm into its consumer, SwiGLU, combine;
    GQA heads unexpanded); "fused-fp8" also caches the expert inputs and the SwiGLU inputs in FP8 (1x128
    tiles), DeepSeek-V3's low-precision activation storage (report section 3.3.2), and runs every other linear but
    the embedding, head and gate in FP8 (model.linear_precision = "fp8"): each keeps its input's e4m3 tiles, a norm's
    output is kept only as those tiles (rebuilt under selective recompute), the out projection keeps nothing of its own. TP splits the head/FFN widths;
    SP also splits the hidden-width tensors (norm inputs and outputs) that TP alone keeps whole. CP (cp > 1) leaves
    the bytes per token alone but for the attention core, moe.cp's whatever the kernels: q, k, v, its output and
    log-sum-exp in at least float32, K/V unexpanded, the rank's own (ring) or all cp ranks' (allgather); each rank
    holds S / cp of a sequence's tokens. slot_rows: the rows the routed experts take per routed slot, 1 but for a
    padded exchange's (parallel.dispatch_exchange = "padded"), whose experts take a fixed number of rows, padding
    included (dispatch.routes.padded_bounds): every per-row term of the routed experts (their inputs, SwiGLUs,
    combine's and the deferred weight grads' rows) grows by it. Recomputation:
    "selective" recomputes the norms, SwiGLU products and (MLA) the q/kv up-projections from their
    latents, as DeepSeek-V3 does; "full" keeps only a dense layer's input and recomputes the layer, and reruns an
    MoE layer's communication-free segments (see layer; moe.model.Block); "moe" (PLAN_RECOMPUTE, Megatron-Core's)
    keeps attention whole, the MoE layer's FFN norm's input only and nothing of its MoE block; "layer" (PLAN_RECOMPUTE)
    keeps every layer's input only. Under CP, the fused
    kernels (Transformer Engine's ring attention) keep the rank's own q, k, v and output in the training dtype, as
    without CP.
    """

    cfg: ModelConfig
    attention: AttentionShape
    itemsize: int = 2
    tp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    kernels: str = "project"
    cp: int = 1
    cp_method: str = "ring"
    slot_rows: float = 1.0

    def __post_init__(self) -> None:
        for name, allowed in (("recompute", PLAN_RECOMPUTE), ("kernels", KERNELS), ("cp_method", CP_METHODS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} = {getattr(self, name)!r} is not allowed; choose one of "
                                 f"{', '.join(map(repr, allowed))}")

    @property
    def _routed(self) -> float:
        """Rows the routed experts take per token: top_k slots, slot_rows rows each."""
        return self.cfg.top_k * self.slot_rows

    @property
    def _project(self) -> bool:
        return self.kernels == "project"

    def _hidden(self, count: float) -> float:
        """count hidden-width tensors outside the TP regions (split by SP)."""
        width = count * self.cfg.hidden_size * self.itemsize
        return width / self.tp if self.sequence_parallel else width

    @property
    def _fp8(self) -> bool:
        """FP8 linears (model.linear_precision = "fp8", kernels.FP8Linear): what fused-fp8 prices."""
        return self.kernels == "fused-fp8"

    def _tiles(self, width: float) -> float:
        """e4m3 tiles (+ fp32 scale per 128) of a width-wide FP8 linear input per token, as FP8GroupedLinear saves
        them (x_q, x_scale); never split by SP: under TP the linears read the rows gathered from the sequence shards."""
        return width * FP8_CACHED

    def _norm(self, fp8_consumer: bool = False) -> float:
        """An RMSNorm and its consumer: the norm's input (RMSNorm saves it) and output (its consumer's saved input;
        project: also the fp32 rstd per row); selective recompute keeps the input only. fp8_consumer under fused-fp8
        (the consumers are FP8 linears): the input and the consumers' one set of e4m3 tiles of the output
        (moe.linear.fp8_norm_output, or quantised_once after TP's gather: MLA's q_a and kv_a, GQA's qkv and kv share
        it; no bf16 output kept); selective recompute rebuilds the tiles from the input without TP (the norm fused
        into its consumers, moe.recompute.Rebuild), and keeps them under TP (the gather is not rerun) or for MLA
        without a query latent."""
        if fp8_consumer and self._fp8:
            fused = self.tp == 1 and not (self.attention.kind == "mla" and not self.cfg.q_lora_rank)
            return self._hidden(1) + (0.0 if self.recompute == "selective" and fused else self._tiles(self.cfg.hidden_size))
        if self.recompute == "selective":
            return self._hidden(1)
        if not self._project:
            return self._hidden(2)
        return self._hidden(2) + 4 / (self.tp if self.sequence_parallel else 1)

    def _core(self) -> tuple[float, float]:
        """(q, k and v; the output, its copy the output projection keeps (project only) and the log-sum-exp): bytes
        per token. fused-fp8: the FP8 out projection keeps a view of the output the fused core keeps
        (moe.linear.project_heads, keep_input), no bytes of its own."""
        a, t, att = self.itemsize, self.tp, self.attention
        kv_width = att.qk_head_dim + att.v_head_dim
        if self.cp > 1 and (self._project or self.cp_method == "allgather"):
            # moe.cp: in at least float32, its output cast back to the training dtype for the projection
            c = max(a, 4)
            kv = cp_kv_width(self.cfg, att, t) * (self.cp if self.cp_method == "allgather" else 1)
            return c * (att.heads * att.qk_head_dim / t + kv), ((c + a) * att.v_head_dim + c) * att.heads / t
        kv_heads = att.heads if att.kind == "mla" or self._project else self.cfg.num_kv_heads
        qkv = a * (att.heads * att.qk_head_dim + kv_heads * kv_width) / t
        return qkv, a * att.heads * att.v_head_dim / t * (2 if self._project else 1) + 4 * att.heads / t

    def _attention(self) -> float:
        """The attention norm (see _norm), MLA's latents (kept by the latent norms, RMSNorm's input), the core (see
        _core). fused-fp8 without selective recompute: also the e4m3 tiles of the latent norms' outputs that q_b and
        kv_b keep (FP8GroupedLinear; rebuilt under selective recompute, moe.linear.fp8_norm_output)."""
        qkv, out = self._core()
        att = self.attention
        latent = self.itemsize * att.latent
        if self._fp8 and att.kind == "mla" and self.recompute != "selective":
            latent += self._tiles(self.cfg.q_lora_rank + self.cfg.kv_lora_rank)
        if self.recompute == "selective":
            return self._norm(True) + latent + out + (0 if att.kind == "mla" else qkv)
        return self._norm(True) + latent + qkv + out

    def _swiglu(self, ffn: float) -> float:
        """Saved bytes of a SwiGLU of width ffn (its input counted by the caller): gate|up, then silu(gate) and
        the product (fused: the product), not kept under selective recompute (moe.experts.swiglu_down). fused-fp8
        (model.activation_cache "fp8"): gate|up's e4m3 tiles and fp32 scales only, whatever the recompute
        (moe.experts._CachedSwiGLU saves them; the down projection's input is rebuilt from them in backward)."""
        if self.kernels == "fused-fp8":
            return 2 * ffn * FP8_CACHED
        gate_up = 2 * ffn * self.itemsize
        if self.recompute == "selective":
            return gate_up
        return gate_up + (2 if self._project else 1) * ffn * self.itemsize

    def _router(self) -> float:
        """Router: fp32 logits and scores (project: also the chosen ids and weights; the gate keeps its input as
        given, moe.router.promoted_linear, which the norm's count holds)."""
        cfg = self.cfg
        if not self._project:
            return 2 * 4 * cfg.num_experts
        return 2 * 4 * cfg.num_experts + cfg.top_k * (8 + 4 + 1) + 3 * 4

    def _slot(self) -> float:
        """One routed slot: the expert input, its SwiGLU, the expert output kept for combine's weight
        grad (project: also the fp32 weight and two int64 row ids); the FP8 expert
        linear keeps its input unquantised, so FP8 experts save the same bytes. fused-fp8 (model.activation_cache
        "fp8" with expert_precision "fp8"): the input as the e4m3 tiles the first FP8 GEMM reads (moe.experts'
        FP8Rows, kept by kernels.FP8GroupedLinear), the SwiGLU's cache (_swiglu), the row's fp32 routing weight
        (moe.experts._CachedSwiGLU: it scales the SwiGLU output before the down projection, and the weight's grad
        is the down projection's input grad dotted with the rebuilt product) and the dispatch's two int64 row ids
        (the source token and the flat slot, moe.local_dispatch; an EP dispatch's perm.row and perm.slot, which the
        row weights are gathered with); combine, a plain sum then, keeps no expert output (dispatch.permute). Full
        recompute keeps no SwiGLU bytes (the experts rerun from their input)."""
        h, a = self.cfg.hidden_size, self.itemsize
        swiglu = 0.0 if self.recompute == "full" else self._swiglu(self.cfg.expert_ffn_size)
        if self.kernels == "fused-fp8":
            return h * FP8_CACHED + swiglu + 4 + 16
        combine = h * a + (4 + 16 if self._project else 0)
        return h * a + swiglu + combine

    def layer(self, moe: bool) -> float:
        """Bytes per token one layer keeps for backward. Full recompute (moe.model.Block): a dense layer keeps its
        input; an MoE layer its input, the FFN norm's output (the router's and the shared experts' input), the
        router's and each slot's expert input and combine bytes (router, dispatch and combine are not rerun).
        "layer": any layer its input; "moe": see the class doc."""
        cfg = self.cfg
        if self.recompute == "layer":
            return self._hidden(1)
        if self.recompute == "full":
            if not moe:
                return self._hidden(1)
            return self._hidden(2) + self._routed * self._slot() / self.tp + self._router()
        if not moe:
            return self._attention() + self._norm(True) + self._swiglu(cfg.dense_ffn_size / self.tp)
        if self.recompute == "moe":  # the FFN norm keeps its input, the MoE block nothing
            return self._attention() + self._hidden(1)
        return self._attention() + self._norm() + self._moe_block()

    def _moe_block(self) -> float:
        """An MoE block's saved bytes per token: each routed slot's, the router's and the shared experts' (fused-fp8:
        with the e4m3 tiles of their input that their FP8 gate_up keeps, FP8GroupedLinear; the FFN norm's bf16 output
        is the router's input)."""
        cfg = self.cfg
        shared = self._swiglu(cfg.num_shared_experts * cfg.expert_ffn_size / self.tp)
        if self._fp8 and cfg.num_shared_experts:
            shared += self._tiles(cfg.hidden_size)
        return self._routed * self._slot() / self.tp + self._router() + shared

    def backward_layer(self, moe: bool) -> float:
        """Bytes per token one layer holds at most during its own backward: what it keeps, or under full recompute
        what a rerun segment saves beside it (a dense layer: the whole layer's; an MoE layer: the routed or shared
        experts' SwiGLUs beside all it keeps, or, once those are done, attention with both norms, its input
        included; under "layer" the whole rerun layer's)."""
        kept = self.layer(moe)
        if self.recompute == "layer":  # the rerun saves the kept input again: counted once
            return replace(self, recompute="none").layer(moe)
        if self.recompute == "moe" and moe:  # the rerun MoE block's bytes beside all the layer keeps
            return kept + replace(self, recompute="none")._moe_block()
        if self.recompute != "full":
            return kept
        plain = replace(self, recompute="none")  # the rerun saves the kept input again: counted once
        if not moe:
            return plain.layer(False)
        cfg = self.cfg
        experts = max(self._routed * plain._swiglu(cfg.expert_ffn_size) / self.tp,
                      plain._swiglu(cfg.num_shared_experts * cfg.expert_ffn_size / self.tp))
        return max(kept + experts, plain._attention() + plain._norm(not moe))

    def head(self) -> float:
        """Final norm and LM head: the fp32 log-probabilities cross-entropy keeps (fused: also the
        logits in the training dtype), vocab split by TP."""
        vocab = self.cfg.padded_vocab_size / self.tp
        return self._norm() + vocab * (4 if self._project else self.itemsize + 4)

    def mtp_depth(self) -> float:
        """One MTP depth (moe.mtp.MTPDepth) per token: the enorm's input (the embedding; the hnorm's is the main
        model's last residual, which its final norm keeps), eh_proj's input [2H] (an FP8 linear's e4m3 tiles under
        fused-fp8, else in the run's dtype), its MoE block (layer) and its own head_norm, LM head and cross-entropy
        (head)."""
        width = 2 * self.cfg.hidden_size
        eh_input = self._tiles(width) if self._fp8 else width * self.itemsize
        return self._hidden(1) + eh_input + self.layer(self.cfg.num_experts > 0) + self.head()

    def stage(self, layers: range, has_head: bool, tokens: int) -> float:
        """Bytes one chunk of `tokens` tokens keeps through a stage holding `layers` (and the head, with the MTP
        depths after it)."""
        per_token = sum(self.layer(i >= self.cfg.first_k_dense) for i in layers)
        per_token += self.head() + self.cfg.mtp_depth * self.mtp_depth() if has_head else 0.0
        return per_token * tokens

    def backward_stage(self, layers: range, has_head: bool, tokens: int) -> float:
        """The most bytes one chunk holds during its backward through a stage (the head's first, then the layers
        last to first: each layer's backward_layer beside what the layers before it keep); at least stage()."""
        held, most = 0.0, 0.0
        for i in layers:
            moe = i >= self.cfg.first_k_dense
            most = max(most, held + self.backward_layer(moe))
            held += self.layer(moe)
        return max(most * tokens, self.stage(layers, has_head, tokens))

    def _linear_pairs(self, width_in: float, width_out: float, fp8: bool = True, grouped: bool = False) -> float:
        """A linear's input and output grad, kept for its deferred weight grad; an FP8 linear's (fused-fp8, fp8) W
        action holds its input's e4m3 1x128 row tiles and scales (the forward's, FP8GroupedLinear; the out projection
        quantises the attention output in B), which it re-tiles along tokens when it runs, and the output grad
        (kernels.linear._weight_grad): a grouped linear's (the routed experts') as e4m3 tiles along tokens made in
        B, a plain linear's in the training dtype."""
        if fp8 and self._fp8:
            return self._tiles(width_in) + (self._tiles(width_out) if grouped else width_out * self.itemsize)
        return (width_in + width_out) * self.itemsize

    def deferred_layer(self, moe: bool) -> float:
        """Bytes per token a layer keeps from a split backward (B) to its weight grads (W): every deferred
        linear's input and output grad (attention's qkv and out, the experts' and shared experts' or the dense
        FFN's gate|up and down; the router's grad is not deferred)."""
        cfg, att, t, h = self.cfg, self.attention, self.tp, self.cfg.hidden_size
        qkv = (att.heads * att.qk_head_dim + (att.heads if att.kind == "mla" else cfg.num_kv_heads)
               * (att.qk_head_dim + att.v_head_dim)) / t
        attention = self._linear_pairs(h, qkv) + self._linear_pairs(att.heads * att.v_head_dim / t, h)

        def ffn(width: float, grouped: bool = False) -> float:
            return self._linear_pairs(h, 2 * width, grouped=grouped) + self._linear_pairs(width, h, grouped=grouped)

        if not moe:
            return attention + ffn(cfg.dense_ffn_size / t)
        return (attention + self._routed * ffn(cfg.expert_ffn_size, grouped=True) / t
                + ffn(cfg.num_shared_experts * cfg.expert_ffn_size / t))

    def deferred_stage(self, layers: range, has_head: bool, tokens: int) -> float:
        """Bytes one chunk keeps from a split backward of the stage to its W (the LM head: its input and the
        logits' grad)."""
        per_token = sum(self.deferred_layer(i >= self.cfg.first_k_dense) for i in layers)
        head = self._linear_pairs(self.cfg.hidden_size, self.cfg.padded_vocab_size / self.tp, fp8=False)  # nn.Linear
        per_token += head if has_head else 0.0
        return per_token * tokens


def backward_workspace(cfg: ModelConfig, layers: range, embedding: bool, head: bool, ep: int, tp: int,
                       itemsize: int, tokens: int) -> float:
    """The most bytes one op of these layers' backward holds beyond the saved activations: the largest weight
    grad before ZeRO-1 folds it into its fp32 sums (a grad in the training dtype, autograd's until the
    post-accumulate hook moves it; for FP8 experts the kernel's fp32 grad beside its cast: an MoE layer's
    local experts' gate|up weight, the embedding's and the LM head's, vocab split by TP), or, on the last
    stage, the cross-entropy's fp32 grads of the log-probabilities and of the logits of a chunk's tokens.
    FP8 experts' dgrad also holds the weight's e4m3 copy in dgrad's orientation (kernels.quantize_weight's
    transposed=True, with its fp32 scale per 128x128 block; freed before the wgrad): FP8_WEIGHT_COPY bytes per
    weight element, counted as its own op."""
    h = cfg.hidden_size
    fp8 = cfg.expert_precision == "fp8"
    experts = 2 * cfg.expert_ffn_size * h * (cfg.num_experts // ep)  # an MoE layer's local gate|up weight elements
    moe_layers = sum(i >= cfg.first_k_dense for i in layers)
    sizes = [2 * cfg.dense_ffn_size / tp * h * itemsize for i in layers if i < cfg.first_k_dense]
    sizes += [experts * (4 + itemsize if fp8 else itemsize)] * moe_layers
    sizes += [experts * FP8_WEIGHT_COPY] * (moe_layers if fp8 else 0)
    sizes += [cfg.padded_vocab_size / tp * h * itemsize] * (embedding + head)
    sizes += [2 * 4 * cfg.padded_vocab_size / tp * tokens] * head
    return max(sizes, default=0.0)


def schedule_peaks(schedule: Schedule, stage_bytes: Sequence[float],
                   pair_costs: Sequence[StageCost] | None = None,
                   deferred_bytes: Sequence[float] | None = None,
                   backward_bytes: Sequence[float] | None = None) -> list[float]:
    """Per rank, the most activation bytes held at once: each forward adds its stage's chunk bytes
    until that chunk's backward; a split backward leaves deferred_bytes (per stage; none if not given)
    held until its W. While a backward runs, its chunk holds backward_bytes (per stage, ActivationModel.backward_stage;
    the stage bytes if not given) instead of its stage bytes.

    An F&B pair counts its forward, then its backward, unless pair_costs (per stage) says the runtime
    runs the two halves at once: the forward then allocates and the backward frees at even rates over
    their own durations, so the pair peaks when its forward ends, less what the backward freed by then."""
    layout = schedule.layout
    deferred = deferred_bytes or [0.0] * len(stage_bytes)
    rerun = [b - s for b, s in zip(backward_bytes, stage_bytes)] if backward_bytes else [0.0] * len(stage_bytes)
    peaks = []
    for rank in range(layout.num_ranks):
        live = peak = 0.0
        for action in schedule.compute_actions(rank):
            halves = action.halves()
            stages = [layout.stage_of(rank, half.phase) for half in halves]
            sizes = [stage_bytes[s] - (deferred[s] if half.op is Op.B and half.split else 0.0)
                     for half, s in zip(halves, stages)]
            if action.op is Op.W:
                live -= deferred[stages[0]] * len(action.chunks)
            elif pair_costs is not None and action.op is Op.FB:
                f, b = (pair_costs[s].compute(h.op, h.split) for h, s in zip(halves, stages))
                freed = sizes[1] * (min(1.0, f / b) if b > 0 else 1.0)
                # a backward reruns its segments as it goes: counted at its start, beside none of the forward yet
                peak = max(peak, live + sizes[0] - freed, live + rerun[stages[1]])
                live += sizes[0] - sizes[1]
                continue
            for half, size, stage in zip(halves, sizes, stages):
                if half.op is Op.F:
                    live += size
                    peak = max(peak, live)
                elif half.op is Op.B:
                    peak = max(peak, live + rerun[stage])
                    live -= size
        peaks.append(peak)
    return peaks
