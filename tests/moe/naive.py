"""Naive per-token references for the router and the MoE layer, written with plain Python loops.

They read only the inputs and parameters (as nested lists of Python floats), never the code under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class NaiveRoute:
    """One naive routing decision for T tokens (k slots each)."""

    indices: list[list[int]]      # -1 where dropped by capacity
    weights: list[list[float]]    # 0 where dropped by capacity
    chosen: list[list[int]]       # experts chosen before capacity drops
    scores: list[list[float]]     # per-token affinities (softmax or sigmoid)
    logits: list[list[float]]
    kept_groups: list[set[int]]   # groups each token was allowed to use


def _dot(a: list[float], b: list[float]) -> float:
    return sum(p * q for p, q in zip(a, b))


def _silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


def _scores(logits: list[float], score_func: str) -> list[float]:
    if score_func == "sigmoid":
        return [1.0 / (1.0 + math.exp(-v)) for v in logits]
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    return [v / sum(exps) for v in exps]


def _best(values: dict[int, float], count: int) -> list[int]:
    """Keys of the `count` largest values, largest first (lower key first on ties)."""
    return sorted(values, key=lambda key: (-values[key], key))[:count]


def _choose(selection: list[float], top_k: int, num_groups: int, topk_groups: int) -> tuple[list[int], set[int]]:
    """Top-k experts by selection score among the best topk_groups groups (score: sum of a group's top-2)."""
    size = len(selection) // num_groups
    group_score = {}
    for g in range(num_groups):
        members = sorted(selection[g * size:(g + 1) * size], reverse=True)
        group_score[g] = sum(members[:2])
    kept = set(_best(group_score, topk_groups))
    eligible = {e: s for e, s in enumerate(selection) if e // size in kept}
    return _best(eligible, top_k), kept


def capacity_keep(chosen: list[list[int]], priority: list[list[float]], num_experts: int,
                  capacity: int, policy: str) -> list[list[bool]]:
    """Which (token, slot) pairs each expert keeps: the `capacity` best by priority or by position."""
    keep = [[False] * len(row) for row in chosen]
    for expert in range(num_experts):
        slots = [(t, j) for t, row in enumerate(chosen) for j, e in enumerate(row) if e == expert]
        if policy == "probs":
            slots.sort(key=lambda s: (-priority[s[0]][s[1]], s[0], s[1]))
        for t, j in slots[:capacity]:
            keep[t][j] = True
    return keep


def route(x: list[list[float]], weight: list[list[float]], bias: list[float], *, top_k: int,
          score_func: str = "softmax", num_groups: int = 1, topk_groups: int = 1,
          capacity_factor: float | None = None, drop_policy: str = "probs", norm_topk: bool = True,
          route_scale: float = 1.0) -> NaiveRoute:
    """Route every token on its own, then apply the capacity limit expert by expert."""
    num_experts = len(weight)
    all_logits, all_scores, chosen, weights, kept_groups = [], [], [], [], []
    for token in x:
        logits = [_dot(token, row) for row in weight]
        scores = _scores(logits, score_func)
        experts, kept = _choose([s + b for s, b in zip(scores, bias)], top_k, num_groups, topk_groups)
        picked = [scores[e] for e in experts]
        total = sum(picked) if norm_topk else 1.0
        weights.append([p / total * route_scale for p in picked])
        all_logits.append(logits)
        all_scores.append(scores)
        chosen.append(experts)
        kept_groups.append(kept)
    keep = [[True] * top_k for _ in x]
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * len(x) * top_k / num_experts)
        priority = [[scores[e] for e in row] for scores, row in zip(all_scores, chosen)]
        keep = capacity_keep(chosen, priority, num_experts, capacity, drop_policy)
    indices = [[e if k else -1 for e, k in zip(row, krow)] for row, krow in zip(chosen, keep)]
    weights = [[w if k else 0.0 for w, k in zip(row, krow)] for row, krow in zip(weights, keep)]
    return NaiveRoute(indices, weights, chosen, all_scores, all_logits, kept_groups)


def _normalised(scores: list[float]) -> list[float]:
    return [s / sum(scores) for s in scores]


def load_balance_loss(r: NaiveRoute, num_experts: int, top_k: int) -> float:
    """Switch loss E * sum_e f_e P_e, f_e from the slots chosen before capacity drops."""
    tokens = len(r.chosen)
    loss = 0.0
    for e in range(num_experts):
        f = sum(row.count(e) for row in r.chosen) / (tokens * top_k)
        p = sum(_normalised(s)[e] for s in r.scores) / tokens
        loss += f * p
    return num_experts * loss


def seq_balance_loss(r: NaiveRoute, num_experts: int, top_k: int, seq_len: int) -> float:
    """DeepSeek sequence-wise loss: mean over sequences of sum_i f_i P_i."""
    per_seq = []
    for start in range(0, len(r.chosen), seq_len):
        chosen, scores = r.chosen[start:start + seq_len], r.scores[start:start + seq_len]
        total = 0.0
        for i in range(num_experts):
            f = num_experts / (top_k * seq_len) * sum(row.count(i) for row in chosen)
            p = sum(_normalised(s)[i] for s in scores) / seq_len
            total += f * p
        per_seq.append(total)
    return sum(per_seq) / len(per_seq)


def z_loss(r: NaiveRoute) -> float:
    """Mean over tokens of logsumexp(logits)^2."""
    values = []
    for logits in r.logits:
        top = max(logits)
        values.append((top + math.log(sum(math.exp(v - top) for v in logits))) ** 2)
    return sum(values) / len(values)


def swiglu(x: list[float], gate_up: list[list[float]], down: list[list[float]]) -> list[float]:
    """down @ (silu(gate @ x) * (up @ x)) with gate_up = [gate rows; up rows]."""
    ffn = len(gate_up) // 2
    hidden = [_silu(_dot(gate_up[i], x)) * _dot(gate_up[ffn + i], x) for i in range(ffn)]
    return [_dot(row, hidden) for row in down]


def moe_layer(x: list[list[float]], r: NaiveRoute, w_gate_up: list, w_down: list,
              shared: tuple[list, list] | None) -> list[list[float]]:
    """out[t] = sum over t's kept slots of weight * expert(x[t]) (+ shared expert), token by token."""
    out = []
    for token, experts, weights in zip(x, r.indices, r.weights):
        acc = swiglu(token, *shared) if shared is not None else [0.0] * len(token)
        for e, w in zip(experts, weights):
            if e >= 0:
                acc = [a + w * y for a, y in zip(acc, swiglu(token, w_gate_up[e], w_down[e]))]
        out.append(acc)
    return out
