"""The index-only sampler: a deterministic weighted blend of sources and a seeded per-epoch row permutation.

Sample g of the global order comes from the source furthest below its share of the first g + 1 samples
(ties: the first such source), so every prefix of n samples holds each source's share of n within one
sample; the k-th sample of source s is row P(k mod rows_s) of that source, P the keyed permutation of epoch
k // rows_s. The order depends only on the seed, the weights and the row counts; the state is how many
samples each source has given.
"""

from __future__ import annotations

import hashlib

import numpy as np

FEISTEL_ROUNDS = 6


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic, the same on every platform)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class RowPermutation:
    """A seeded bijection of [0, size), evaluated per index in O(1) memory: a balanced Feistel network on
    the smallest even number of bits covering size (round keys from blake2b of seed and epoch, round
    function splitmix64's finaliser; source > 0 keys another source's), cycle-walking any image >= size back
    into range."""

    def __init__(self, size: int, seed: int, epoch: int, source: int = 0) -> None:
        self.size = size
        self.half = max(1, ((size - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        key = f"rows/{seed}/{epoch}" + (f"/{source}" if source else "")
        digest = hashlib.blake2b(key.encode(), digest_size=8 * FEISTEL_ROUNDS).digest()
        self.keys = np.frombuffer(digest, dtype="<u8").astype(np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x >> shift, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << shift) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """The images of indices (each in [0, size)) as int64."""
        out = self._encrypt(np.atleast_1d(np.asarray(indices, dtype=np.uint64)))
        walking = out >= self.size
        while walking.any():
            out[walking] = self._encrypt(out[walking])
            walking = out >= self.size
        return out.astype(np.int64)


class Blend:
    """Assigns the global order's samples to sources in proportion to weights (deterministic, see the module)."""

    def __init__(self, weights: list[float]) -> None:
        total = sum(weights)
        self.shares = [w / total for w in weights]

    def assign(self, taken: list[int], count: int) -> list[tuple[int, int]]:
        """(source, index within the source) of the next count samples after taken[s] of each source s;
        advances taken."""
        if len(taken) == 1:
            taken[0] += count
            return [(0, k) for k in range(taken[0] - count, taken[0])]
        picks = []
        done = sum(taken)
        for g in range(done + 1, done + count + 1):
            source = max(range(len(taken)), key=lambda s: self.shares[s] * g - taken[s])
            picks.append((source, taken[source]))
            taken[source] += 1
        return picks

    def rows(self, picks: list[tuple[int, int]], counts: list[int], seed: int) -> list[tuple[int, int]]:
        """(source, row) of each pick: row P(k mod rows) of epoch k // rows of its source's permutation."""
        out = [(0, 0)] * len(picks)
        groups: dict[tuple[int, int], list[int]] = {}
        for at, (source, k) in enumerate(picks):
            groups.setdefault((source, k // counts[source]), []).append(at)
        for (source, epoch), ats in groups.items():
            order = RowPermutation(counts[source], seed, epoch, source)
            rows = order(np.array([picks[a][1] % counts[source] for a in ats]))
            for a, row in zip(ats, rows.tolist()):
                out[a] = (source, row)
        return out
