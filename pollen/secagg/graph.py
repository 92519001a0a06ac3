"""SecAgg+'s communication graph: each client shares its secrets with a few neighbours, not with everyone.

Bell et al. (2020) replace SecAgg's complete graph with a sparse one of degree ``O(log n)``. pollen's
graph: the participants shuffled by a public seed onto a ring, each joined to the ``degree / 2`` nearest on
either side (``degree`` even), or the complete graph when ``degree >= n - 1``. A client's secrets are
shared among its neighbours and itself, ``threshold`` of them reconstruct one.

Defaults (the spec's recommendation, ``papers/privacy.md`` §14): ``k = 2 * ceil(log2 n) + 1`` holders of a
client's shares (itself and ``k - 1`` neighbours) and ``t = ceil(2k / 3)``.
"""

from __future__ import annotations

import math

import numpy as np


def default_degree(count: int) -> int:
    """Neighbours per client: ``2 * ceil(log2 n)`` (the holders of its shares are these and itself)."""
    return 2 * math.ceil(math.log2(max(count, 2)))


def default_threshold(holders: int) -> int:
    """Shares needed to reconstruct a secret held by ``holders`` parties: ``ceil(2 * holders / 3)``, at least 2."""
    return max(2, math.ceil(2 * holders / 3))


def neighbourhoods(ids: list[int], degree: int, seed: int) -> dict[int, tuple[int, ...]]:
    """Each participant's neighbours (sorted, itself excluded) on the shuffled ring; symmetric."""
    if len(set(ids)) != len(ids):
        raise ValueError("secagg: participant ids repeat")
    if not (isinstance(degree, int) and degree >= 2 and degree % 2 == 0):
        raise ValueError(f"secagg degree={degree!r} is invalid; allowed: an even integer >= 2")
    order = [ids[i] for i in np.random.default_rng(seed).permutation(len(ids))]
    count = len(order)
    if degree >= count - 1:
        return {node: tuple(sorted(set(ids) - {node})) for node in ids}
    half = degree // 2
    out: dict[int, set[int]] = {node: set() for node in ids}
    for position, node in enumerate(order):
        for offset in range(1, half + 1):
            other = order[(position + offset) % count]
            out[node].add(other)
            out[other].add(node)
    return {node: tuple(sorted(neighbours)) for node, neighbours in out.items()}


__all__ = ["default_degree", "default_threshold", "neighbourhoods"]
