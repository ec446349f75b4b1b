"""Compute seconds of one chunk through one layer on one GPU, GEMM by GEMM (launch.plan.efficiency prices each).

Per chunk of T tokens on one TP rank of tp: the attention projections (a weight block of P params fed by
hidden-wide rows is priced as one [T, hidden] x [hidden, P / hidden / tp] GEMM; TP splits the sharded
part's columns, the replicated part runs on the rank's T / tp sequence shard), flash attention's core, the
dense FFN or shared experts (gate|up then down, columns split by TP), the router ([T / tp, hidden] x
[hidden, E], BF16) and the routed experts as two grouped GEMMs over the E / ep local experts, each receiving
T / tp x top_k / (E / ep) rows under balanced routing (every EP rank receives as many slots as it sends).
Backward = input grads + weight grads of every GEMM and twice the attention core's forward FLOPs. An MoE layer also
pays for handling its T / tp x top_k routed slots (GemmModel.routed_slots), half forward, half backward.

Between the GEMMs run memory-bound ops, priced by the bytes they move through HBM (reads + writes in the training
dtype, each op once, as fused kernels do): two RMSNorms (each reads and writes a hidden-wide tensor a token) and two
residual adds (each reads two and writes one), RoPE on q and k, each SwiGLU's activation (reads gate|up, writes
their product) and the MoE layer's permutation (copies top_k rows a token out and back) and combine (reads top_k
rows, writes one); their backward moves twice the bytes (output grads in, input grads out, saved inputs read). FP8
linears also quantize their inputs (forward) and their output grads (backward): efficiency.QUANTIZE_BYTES an
element. The loss reads the LM head's logits twice forward, once backward, and writes their grads.

Every term is kept under the kind of work it prices (WORK_KINDS, the kinds `moe-bench gpu`'s profile sums kernels
into: launch.bench.breakdown): a Work holds each kind's Seconds, and its f, b, w are their sums (what the planner's
StageCost takes). The attention projections, dense FFN, shared experts, router, MTP's eh_proj and LM head are
"GEMM"; the routed experts' grouped GEMMs "expert GEMM"; flash attention's core "attention"; the routed slots'
handling and the permutation and combine bytes "routing & permute"; the RMSNorms and the loss "norm & softmax"; the
residual adds, RoPE and SwiGLU activations "elementwise & copy"; the FP8 linears' quantisation "FP8 quantise".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launch.metrics.flops import AttentionShape, layer_flops
from launch.plan.efficiency import QUANTIZE_BYTES, GemmModel
from moe.config import ModelConfig


# The kinds of work a step's compute is split into (launch.plan.kinds.step_kinds), named once here: moe-bench's profile
# breakdown (launch.bench.breakdown) sums a real step's kernels into the same kinds, plus its "other".
WORK_KINDS = (FP8_QUANTISE, EXPERT_GEMM, ATTENTION, GEMM, OPTIMIZER, COMMUNICATION, ROUTING, NORM, ELEMENTWISE) = (
    "FP8 quantise", "expert GEMM", "attention", "GEMM", "optimizer", "communication", "routing & permute",
    "norm & softmax", "elementwise & copy")


@dataclass(frozen=True)
class Precisions:
    """GEMM precision (launch.plan.efficiency.PRECISIONS) of the dense linears (attention projections, dense
    FFN, shared experts) and of the routed experts; the router and the LM head stay BF16."""

    dense: str = "bf16"
    expert: str = "bf16"

    @classmethod
    def of(cls, cfg: ModelConfig, linears: str | None = None) -> Precisions:
        """linears for every linear if given; else the config's linear and expert precisions (this project's FP8
        GEMMs use 1x128 / 128x128 scales)."""
        if linears:
            return cls(linears, linears)
        return cls(*("fp8-block" if p == "fp8" else "bf16" for p in (cfg.linear_precision, cfg.expert_precision)))


@dataclass(frozen=True)
class Seconds:
    """Forward, full backward (input + weight grads) and weight-grad seconds of some GEMMs."""

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0

    def __add__(self, other: Seconds) -> Seconds:
        return Seconds(self.f + other.f, self.b + other.b, self.w + other.w)


@dataclass(frozen=True)
class Work:
    """Seconds of some compute by kind of work (WORK_KINDS -> Seconds); f, b and w are the kinds' sums."""

    kinds: dict[str, Seconds] = field(default_factory=dict)

    @classmethod
    def of(cls, kind: str, seconds: Seconds) -> Work:
        """seconds of one kind of work."""
        return cls({kind: seconds})

    def __add__(self, other: Work) -> Work:
        kinds = dict(self.kinds)
        for kind, seconds in other.kinds.items():
            kinds[kind] = kinds.get(kind, Seconds()) + seconds
        return Work(kinds)

    def rerun(self, times: float = 1.0) -> Work:
        """This work's forward run `times` times again inside a backward (a recompute): each kind's f as b."""
        return Work({kind: Seconds(0.0, times * s.f, 0.0) for kind, s in self.kinds.items()})

    @property
    def f(self) -> float:
        """Forward seconds."""
        return sum(s.f for s in self.kinds.values())

    @property
    def b(self) -> float:
        """Full backward seconds (input + weight grads)."""
        return sum(s.b for s in self.kinds.values())

    @property
    def w(self) -> float:
        """Weight-grad seconds (of b)."""
        return sum(s.w for s in self.kinds.values())


def _linear(model: GemmModel, m: float, n: float, k: float, precision: str, groups: int = 1) -> Seconds:
    f, dgrad, wgrad = model.linear(m, n, k, precision, groups)
    return Seconds(f, dgrad + wgrad, wgrad)


def _swiglu(model: GemmModel, m: float, h: int, ffn: float, precision: str, groups: int = 1) -> Seconds:
    return _linear(model, m, 2 * ffn, h, precision, groups) + _linear(model, m, h, ffn, precision, groups)


def layer_seconds(model: GemmModel, cfg: ModelConfig, attention: AttentionShape, index: int, seq_len: int,
                  tokens: int, tp: int, ep: int, precisions: Precisions, busiest: float = 1.0) -> Work:
    """Seconds of one chunk of `tokens` tokens through layer `index` on one TP rank (see the module doc); an MoE
    layer's routed experts at the busiest EP rank's rows (busiest: its rows over the balanced share)."""
    h = cfg.hidden_size
    out = Work.of(GEMM, _linear(model, tokens, attention.sharded / h / tp, h, precisions.dense)
                  + _linear(model, tokens / tp, attention.replicated / h, h, precisions.dense))
    core = model.attention(layer_flops(cfg, index, seq_len, attention).core * tokens / tp)
    out += Work.of(ATTENTION, Seconds(core, 2 * core, 0.0))
    if index < cfg.first_k_dense:
        return out + Work.of(GEMM, _swiglu(model, tokens, h, cfg.dense_ffn_size / tp, precisions.dense))
    return out + moe_block_seconds(model, cfg, tokens, tp, ep, precisions, busiest)


def moe_block_seconds(model: GemmModel, cfg: ModelConfig, tokens: int, tp: int, ep: int,
                      precisions: Precisions, busiest: float = 1.0) -> Work:
    """Seconds of one chunk through an MoE layer's MoE block on one TP rank: shared experts, router, the routed
    experts' grouped GEMMs and the routed slots' handling (see the module doc). The grouped GEMMs run the rows of
    the busiest EP rank, `busiest` times the balanced share (launch.plan.imbalance; 1: forced balance)."""
    h = cfg.hidden_size
    dense = _linear(model, tokens / tp, cfg.num_experts, h, "bf16")  # the router
    if cfg.num_shared_experts:
        dense = _swiglu(model, tokens, h, cfg.num_shared_experts * cfg.expert_ffn_size / tp, precisions.dense) + dense
    local = cfg.num_experts // ep
    rows = tokens / tp * cfg.top_k / local * busiest  # per local expert of the busiest rank
    handling = model.routed_slots(tokens / tp * cfg.top_k) / 2  # the slots' routing and permutation, each way
    return (Work.of(GEMM, dense) + Work.of(EXPERT_GEMM, _swiglu(model, rows, h, cfg.expert_ffn_size, precisions.expert,
                                                                 local))
            + Work.of(ROUTING, Seconds(handling, handling)))


def elementwise_seconds(model: GemmModel, cfg: ModelConfig, attention: AttentionShape, index: int, tokens: int,
                        tp: int, sequence_parallel: bool, itemsize: int, precisions: Precisions) -> Work:
    """The memory-bound ops of one chunk through layer `index` on one TP rank (see the module doc)."""
    h, kv = cfg.hidden_size, attention.heads if attention.kind == "mla" else cfg.num_kv_heads
    moe = index >= cfg.first_k_dense
    ffn = (cfg.num_shared_experts * cfg.expert_ffn_size if moe else cfg.dense_ffn_size) / tp  # dense or shared
    slots, width = (cfg.top_k / tp if moe else 0.0), cfg.expert_ffn_size  # routed slots per token on this rank
    row = h / (tp if sequence_parallel else 1)
    elements = {NORM: 2 * 2 * row,                                             # two norms
                ELEMENTWISE: (2 * 3 * row                                      # two residual adds
                              + 2 * (attention.heads + kv) * attention.qk_head_dim / tp  # RoPE on q and k
                              + 3 * ffn + slots * 3 * width),                  # SwiGLU activations
                ROUTING: slots * 3 * h + (h / tp if moe else 0.0)}             # permutation out and back, combine
    # FP8 linears quantise their inputs in forward and their output grads in backward
    dense_in = h + attention.heads * attention.v_head_dim / tp + (h + ffn if ffn else 0.0)
    dense_out = attention.sharded / h / tp + h + (2 * ffn + h if ffn else 0.0)
    dense_q, expert_q = QUANTIZE_BYTES[precisions.dense], QUANTIZE_BYTES[precisions.expert]
    forward = dense_q * dense_in + expert_q * slots * (h + width)
    backward = dense_q * dense_out + expert_q * slots * (2 * width + h)
    out = Work.of(FP8_QUANTISE, Seconds(model.memory(forward * tokens), model.memory(backward * tokens), 0.0))
    for kind, n in elements.items():  # backward: twice the bytes
        out += Work.of(kind, Seconds(model.memory(n * itemsize * tokens), model.memory(2 * n * itemsize * tokens), 0.0))
    return out


def head_seconds(model: GemmModel, cfg: ModelConfig, tokens: int, tp: int) -> Work:
    """The LM head (BF16, vocab split by TP) and the cross-entropy over its logits (memory-bound, as a fused kernel:
    forward reads the BF16 logits twice, for their log-sum-exp and the targets' logits; backward reads them and
    writes their grads)."""
    logits = tokens * cfg.padded_vocab_size / tp
    loss = Seconds(model.memory(2 * 2 * logits), model.memory(2 * 2 * logits), 0.0)
    return (Work.of(GEMM, _linear(model, tokens, cfg.padded_vocab_size / tp, cfg.hidden_size, "bf16"))
            + Work.of(NORM, loss))


def mtp_seconds(model: GemmModel, cfg: ModelConfig, attention: AttentionShape, seq_len: int, tokens: int, tp: int,
                ep: int, sequence_parallel: bool, itemsize: int, precisions: Precisions,
                busiest: float = 1.0) -> Work:
    """The MTP depths (moe.mtp) of one chunk on the last stage: each one's eh_proj ([2 hidden] -> hidden), a block
    of the model's MoE kind with its memory-bound ops (its routed experts at `busiest`, layer_seconds), and the
    shared LM head."""
    index = cfg.num_layers if cfg.num_moe_layers else 0
    depth = (layer_seconds(model, cfg, attention, index, seq_len, tokens, tp, ep, precisions, busiest)
             + elementwise_seconds(model, cfg, attention, index, tokens, tp, sequence_parallel, itemsize, precisions)
             + Work.of(GEMM, _linear(model, tokens, cfg.hidden_size, 2 * cfg.hidden_size, precisions.dense))
             + head_seconds(model, cfg, tokens, tp))
    return sum((depth for _ in range(cfg.mtp_depth)), Work())
