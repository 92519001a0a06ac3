"""Gossip inside HA-Fed clusters: mixing matrices, rho, the fault rule, cluster layout.

Pure numpy, no Flower imports (the math layer of ``DESIGN.md``). The HA-Fed strategy and the
gossip participant on the client build on this package; see :mod:`pollen.gossip.mixing` and
the spec ``papers/hafed.md`` §3.2-3.6.

>>> W = mixing_matrix("ring", 8)
>>> round(spectral_gap_rho(W), 5)
0.80474
>>> lam = lambda_for_rho(8, 0.125)
>>> round(spectral_gap_rho(mixing_matrix("interpolated", 8, lam=lam)), 6)
0.125
"""

from __future__ import annotations

from .mixing import (
    TOLERANCE,
    TOPOLOGIES,
    check_mixing_matrix,
    circulant,
    cluster_of,
    complete_bipartite,
    fully_connected,
    gossip_step,
    identity,
    interpolated,
    lambda_for_rho,
    mixing_matrix,
    ring,
    segment_bounds,
    spectral_gap_rho,
    validate_clusters,
    without_absent,
)

# The same names, in the same order, as ``mixing.__all__``.
__all__ = [
    "segment_bounds",
    "TOLERANCE",
    "TOPOLOGIES",
    "check_mixing_matrix",
    "circulant",
    "cluster_of",
    "complete_bipartite",
    "fully_connected",
    "gossip_step",
    "identity",
    "interpolated",
    "lambda_for_rho",
    "mixing_matrix",
    "without_absent",
    "ring",
    "spectral_gap_rho",
    "validate_clusters",
]
