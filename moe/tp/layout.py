"""Where each tensor-parallel parameter's rows come from, how its grads relate across TP ranks, shape checks.

Every parameter of a converted module carries a `tp_spec` (TPSpec). Grad semantics per kind
(`grads`), which the trainer's ZeRO-1 needs (grads summed, not averaged, over a replica group):

    "sharded"   each TP rank holds different rows (attention heads, FFN columns/rows, vocab rows):
                no TP replicas; the grad is complete on the rank.
    "partial"   every TP rank holds the whole param and its local grad is a partial sum that must be
                summed over the TP group: norms with SP (each rank normalises its sequence shard),
                the router (each rank routes its own tokens), KV projections replicated because
                num_kv_heads < tp, MLA's latent down-projections and norms (each rank's heads use
                them), and routed experts held locally (no EP).
    "identical" every TP rank holds the whole param and computes the same grad: norms without SP;
                do not sum over TP (count one copy).

Routed experts under EP carry no spec: their replica group is the trainer's expert-DP group.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe.config import ModelConfig
from moe.tp.comm import Group, all_gather, all_reduce

GRAD_KINDS = ("sharded", "partial", "identical")


@dataclass
class TPSpec:
    """How a local param maps onto the full single-process param, and what its grad is across TP ranks."""

    grads: str                                # one of GRAD_KINDS
    dim: int = 0                              # dim of the full param the rows are taken along
    indices: tuple[Tensor, ...] | None = None  # per TP rank, positions along dim (None: the whole param)
    full_size: int = 0                        # size of the full param along dim
    source: str | None = None                 # "<module>.<param>" of the full param when named differently


def shard_param(module: nn.Module, name: str, indices: list[Tensor], rank: int, dim: int = 0,
                grads: str = "sharded", source: str | None = None) -> None:
    """Replace module.<name> by the rows indices[rank] (along dim) of the full param, recording its TPSpec."""
    full = getattr(module, name)
    local = nn.Parameter(full.detach().index_select(dim, indices[rank]).clone(), requires_grad=full.requires_grad)
    local.tp_spec = TPSpec(grads, dim, tuple(indices), full.shape[dim], source)
    setattr(module, name, local)


def mark_replicated(module: nn.Module, grads: str) -> None:
    """Record every param of module as held whole on each TP rank, with grads 'partial' or 'identical'."""
    if grads not in GRAD_KINDS[1:]:
        raise ValueError(f"grads = {grads!r} is not allowed; choose one of {GRAD_KINDS[1:]}")
    for param in module.parameters():
        param.tp_spec = TPSpec(grads)


def tp_specs(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, TPSpec]]:
    """(name, param, spec) for every param of module carrying a TPSpec."""
    for name, param in module.named_parameters():
        spec = getattr(param, "tp_spec", None)
        if spec is not None:
            yield name, param, spec


def tp_replicated_params(module: nn.Module) -> list[tuple[str, nn.Parameter, str]]:
    """(name, param, 'partial' | 'identical') for params held whole on every rank of the TP group.

    'partial': sum the local grads over the TP group (SP norms, routers, replicated KV, local experts);
    'identical': every TP rank has the same grad (norms without SP): sum over DP only.
    """
    return [(name, p, spec.grads) for name, p, spec in tp_specs(module) if spec.grads != "sharded"]


def full_name(name: str, spec: TPSpec) -> str:
    """Name of the single-process param that a local param's rows belong to."""
    if spec.source is None:
        return name
    parent = name.rsplit(".", 2)[0] + "." if name.count(".") >= 2 else ""
    return parent + spec.source


@torch.no_grad()
def gather_full(module: nn.Module, tp_group: Group, grads: bool = False) -> dict[str, Tensor]:
    """The single-process params (or, with grads=True, their grads) rebuilt from every TP rank's pieces.

    Sharded rows are all-gathered; 'partial' grads are summed over the group; replicas are taken
    as they are. Keys are the single-process names (e.g. attn.kv's rows land in attn.qkv.weight).
    Collective: every rank of tp_group must call it with the same module layout.
    """
    size, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    out: dict[str, Tensor] = {}
    for name, param, spec in tp_specs(module):
        local = param.grad if grads else param.detach()
        if local is None:
            raise ValueError(f"{name} has no grad to gather")
        if grads and spec.grads == "partial":
            local = all_reduce(local, tp_group)
        if spec.indices is None:
            out[name] = local.clone()
            continue
        shape = list(local.shape)
        shape[spec.dim] = spec.full_size
        target = out.setdefault(full_name(name, spec), local.new_zeros(shape))
        if spec.grads == "sharded":
            pieces = all_gather(local.unsqueeze(0), 0, tp_group)
            for r in range(size):
                target.index_copy_(spec.dim, spec.indices[r], pieces[r])
        else:
            target.index_copy_(spec.dim, spec.indices[rank], local)
    return out


def full_state_dict(module: nn.Module, tp_group: Group) -> dict[str, Tensor]:
    """module's state dict with every TP param replaced by the single-process one (gather_full); loads into
    the unconverted module. Params without a TPSpec (routed experts under EP) stay this rank's. Collective."""
    state = module.state_dict()
    for name, _, spec in tp_specs(module):
        if spec.source is not None:
            del state[name]
    return state | gather_full(module, tp_group)


def divisors(n: int) -> list[int]:
    """The positive divisors of n."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divisible(field: str, value: int, tp: int) -> None:
    """Raise ValueError naming field unless tp divides value."""
    if value % tp:
        raise ValueError(f"{field} = {value} is not divisible by parallel.tp = {tp}; "
                         f"tp must be one of {divisors(value)}")


def check_vocab(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError naming model.vocab_size, model.vocab_multiple and parallel.tp unless tp divides the padded vocab
    (cfg.padded_vocab_size: each TP rank holds an equal block of the embedding's and the head's rows)."""
    padded = cfg.padded_vocab_size
    if padded % tp:
        rows = (f" (padded to {padded} rows by model.vocab_multiple = {cfg.vocab_multiple})"
                if padded != cfg.vocab_size else "")
        raise ValueError(f"model.vocab_size = {cfg.vocab_size}{rows} is not divisible by parallel.tp = {tp}; "
                         f"tp must be one of {divisors(padded)}, or set model.vocab_multiple to a multiple of {tp}")


def check_kv_heads(num_kv_heads: int, tp: int) -> None:
    """KV heads are split when tp divides them, replicated when they divide tp; anything else is refused."""
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"model.num_kv_heads = {num_kv_heads} and parallel.tp = {tp} must divide one another "
                         f"(KV heads split or replicated); tp must be one of {divisors(num_kv_heads)} "
                         f"or a multiple of {num_kv_heads}")


def check_tp_group(tp_group: Group, tp: int) -> None:
    """Raise ValueError unless tp_group has parallel.tp ranks (the mesh's TP group of this rank)."""
    size = dist.get_world_size(tp_group)
    if size != tp:
        raise ValueError(f"the TP process group has {size} ranks but parallel.tp = {tp}; pass the group of the "
                         f"{tp} ranks that share this rank's pipeline stage and DP index (allowed: {tp} ranks)")


def check_tp_shapes(cfg: ModelConfig, seq_len: int | None, tp: int, sequence_parallel: bool, cp: int = 1) -> None:
    """Raise ValueError naming the field and the allowed values unless cfg (and seq_len) split over tp ranks.

    Needs tp | num_heads (GQA or MLA heads), tp | the padded vocab (check_vocab), tp | dense_ffn_size (dense layers),
    tp | the shared
    experts' width (MoE layers with shared experts), GQA's num_kv_heads and tp dividing one another, and
    tp | seq_len / cp with SP or with MoE layers (each TP rank holds or routes S / (cp tp) tokens of its CP shard
    of S / cp; cp must already divide seq_len).
    seq_len=None skips the sequence check (the model checks at run time).
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"parallel.tp = {tp!r} must be an integer >= 1")
    check_divisible("model.num_heads", cfg.num_heads, tp)
    if cfg.attention == "gqa":
        check_kv_heads(cfg.num_kv_heads, tp)
    check_vocab(cfg, tp)
    if cfg.first_k_dense:
        check_divisible("model.dense_ffn_size", cfg.dense_ffn_size, tp)
    if cfg.num_moe_layers and cfg.num_shared_experts:
        check_divisible("model.num_shared_experts * model.expert_ffn_size",
                        cfg.num_shared_experts * cfg.expert_ffn_size, tp)
    if seq_len is not None and (sequence_parallel or cfg.num_moe_layers) and (seq_len // cp) % tp:
        why = "parallel.sequence_parallel = true" if sequence_parallel else "MoE layers (tokens routed per TP rank)"
        shard = f" / parallel.cp = {seq_len // cp}" if cp > 1 else ""
        multiple = math.lcm(2 * cp, cp * tp) if cp > 1 else tp  # CP also cuts 2 x cp zig-zag chunks
        raise ValueError(f"train.seq_len = {seq_len}{shard} is not divisible by parallel.tp = {tp}, which {why} "
                         f"needs; seq_len must be a multiple of {multiple}")
