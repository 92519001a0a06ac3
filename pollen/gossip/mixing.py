"""Gossip mixing matrices of HA-Fed (pure numpy, no Flower imports).

HA-Fed (spec ``papers/hafed.md``) splits the N clients into K disjoint clusters of n
clients each. Inside a cluster the clients mix their models after every local step
(Algorithm 1 line 9 / Algorithm 2 line 13, §3.2-3.4)::

    x_i <- sum_j W[i, j] x_j^{1/2}          matrix form:  X <- W X   (rows are clients)

This module holds everything about ``W`` and nothing about training:

- the topologies of §3.5 (:func:`mixing_matrix` and one function per topology);
- the connectivity number ``rho = ||W - 11^T/n||_2`` (:func:`spectral_gap_rho`) and the
  interpolation ``W(lam) = lam W_ring + (1 - lam) 11^T/n`` that hits the ablation's rho
  values (:func:`lambda_for_rho`);
- the checks of Assumption 5.5 (:func:`check_mixing_matrix`);
- the fault rule for a gossip step that some clients miss (:func:`without_absent`);
- one mixing step on an ``(n, d)`` stack of float32 models (:func:`gossip_step`);
- the cluster layout of §9 (client ``i`` is in cluster ``i // n``: :func:`cluster_of`,
  :func:`validate_clusters`).

Every matrix is float64, ``n x n``, symmetric and doubly stochastic with non-negative
entries; the neighbour set of a client includes the client itself (§8 A1).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import numpy as np

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

#: Topology names accepted by :func:`mixing_matrix`:
#:
#: - ``"ring"``: self and the two ring neighbours, weight 1/3 each (§3.5 default; rho = 0.80474 at n = 8);
#: - ``"full"``: every client averages all n models, ``W = 11^T/n`` (rho = 0);
#: - ``"bipartite"``: complete bipartite K_{n/2,n/2}, uniform weights 1/(n/2 + 1) (rho = 0.6 at n = 8);
#: - ``"circulant"``: node i linked to i +- o (mod n) for each offset o, uniform weights 1/(degree + 1);
#: - ``"identity"``: no mixing, ``W = I`` (rho = 1; HA-Fed reduces to FedAMSGrad, §3.3 Remark 5.10);
#: - ``"interpolated"``: ``lam W_ring + (1 - lam) 11^T/n`` (rho = lam * rho_ring; §3.5, §9 ablation).
TOPOLOGIES: tuple[str, ...] = ("ring", "full", "bipartite", "circulant", "identity", "interpolated")

#: Absolute tolerance of :func:`check_mixing_matrix` (symmetry and row/column sums).
TOLERANCE = 1e-12

# Columns mixed per block in :func:`gossip_step`: bounds the float64 scratch to n x 65536.
_GOSSIP_BLOCK = 1 << 16


# --------------------------------------------------------------------------- argument checks


def _check_n(n: object, *, minimum: int = 1, what: str = "n") -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}; got {n!r}")
    return int(n)


def _check_lam(lam: object) -> float:
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real) or not math.isfinite(lam):
        raise ValueError(f"lam must be a real number in [0, 1]; got {lam!r}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be a real number in [0, 1]; got {lam}")
    return float(lam)


def _check_offsets(n: int, offsets: object) -> tuple[int, ...]:
    allowed = f"allowed: distinct integers in [1, {n // 2}] (n // 2) whose gcd with n = {n} is 1"
    if isinstance(offsets, np.ndarray) and offsets.ndim == 1:
        offsets = offsets.tolist()
    if isinstance(offsets, (str, bytes)) or not isinstance(offsets, Sequence) or len(offsets) == 0:
        raise ValueError(f"circulant offsets must be a non-empty sequence of integers; got {offsets!r}; {allowed}")
    for o in offsets:
        if isinstance(o, bool) or not isinstance(o, numbers.Integral) or not 1 <= o <= n // 2:
            raise ValueError(f"circulant offset {o!r} is out of range for n = {n}; {allowed}")
    clean = tuple(int(o) for o in offsets)
    if len(set(clean)) != len(clean):
        raise ValueError(f"circulant offsets {list(clean)} repeat a value; {allowed}")
    if math.gcd(n, *clean) != 1:
        # The graph splits into gcd(n, offsets) disjoint cycles: W has eigenvalue 1 more than
        # once, rho = 1, and Assumption 5.5 (null(I - W) = span(1)) fails.
        raise ValueError(
            f"circulant offsets {list(clean)} give a disconnected graph for n = {n} "
            f"(gcd = {math.gcd(n, *clean)}); {allowed}"
        )
    return clean


# --------------------------------------------------------------------------- topologies


def identity(n: int) -> np.ndarray:
    """No mixing, ``W = I`` (rho = 1).

    Not a valid HA-Fed matrix in the sense of Assumption 5.5 (the graph is disconnected), but
    the control of §7 C2 / §8 A7: HA-Fed with ``W = I`` is FedAMSGrad with stratified sampling.
    """
    return np.eye(_check_n(n), dtype=np.float64)


def fully_connected(n: int) -> np.ndarray:
    """Every client averages all n models, ``W = 11^T / n`` (rho = 0, §3.5).

    With this W all models of a cluster are equal after every step, so partial participation
    equals full participation (§3.3 Remark 5.9).
    """
    n = _check_n(n)
    return np.full((n, n), 1.0 / n, dtype=np.float64)


def ring(n: int) -> np.ndarray:
    """The paper's default topology: a ring with weight 1/3 on self and on each neighbour (§3.5).

    ``W[i, i] = W[i, i+1 mod n] = W[i, i-1 mod n] = 1/3``; rho = 1/3 + (2/3) cos(2 pi / n) for
    n >= 4 (0.80474 at n = 8, the paper's 0.805); at n = 3 the ring is the complete graph
    (rho = 0).

    Small clusters, where "two neighbours" does not exist:

    - ``n = 1``: ``W = [[1]]`` (a client alone keeps its model).
    - ``n = 2``: the ring is the single edge 0-1, and the uniform rule "1/(degree + 1) on self
      and on each neighbour" (degree 1) gives ``W = [[1/2, 1/2], [1/2, 1/2]]``, the matrix
      §7 C5 recommends for the two-client study. (Writing the n >= 3 formula literally would
      count the one neighbour twice and give ``[[1/3, 2/3], [2/3, 1/3]]``; we do not do that.)
    """
    n = _check_n(n)
    if n <= 2:
        return fully_connected(n)
    idx = np.arange(n)
    w = np.zeros((n, n), dtype=np.float64)
    third = 1.0 / 3.0
    w[idx, idx] = third
    w[idx, (idx + 1) % n] = third
    w[idx, (idx - 1) % n] = third
    return w


def circulant(n: int, offsets: Sequence[int]) -> np.ndarray:
    """Circulant graph ``C_n(offsets)``: node i is linked to i +- o (mod n) for each offset o.

    Weights are uniform over the closed neighbourhood, ``1 / (degree + 1)`` on self and on each
    neighbour (the circulant graph is regular, so W is symmetric and doubly stochastic). The
    degree is ``2 * len(offsets)``, minus one when ``n / 2`` is an offset (then i + n/2 and
    i - n/2 are the same node). Example from §3.5: ``C_8(1, 3)`` is K_{4,4}, weights 1/5,
    rho = 0.6 (the paper's 0.599).

    Offsets must be distinct integers in ``[1, n // 2]`` (o and n - o give the same edges) and
    the graph must be connected (``gcd(n, *offsets) == 1``, Assumption 5.5); otherwise
    ``ValueError``.
    """
    n = _check_n(n, minimum=2)
    offs = _check_offsets(n, offsets)
    adj = np.eye(n, dtype=bool)
    idx = np.arange(n)
    for o in offs:
        adj[idx, (idx + o) % n] = True
        adj[idx, (idx - o) % n] = True
    closed_degree = int(adj[0].sum())  # degree + 1, the same for every node
    return adj.astype(np.float64) / closed_degree


def complete_bipartite(n: int) -> np.ndarray:
    """Complete bipartite graph K_{n/2, n/2} with uniform weights ``1 / (n/2 + 1)`` (§3.5).

    The two sides are the even and the odd clients, so this is ``circulant(n, odd offsets)``;
    K_{4,4} for n = 8 (= C_8(1, 3)) has rho = 0.6000, the ablation's "0.599". ``n`` must be
    even and >= 2 (K_{1,1} for n = 2 is ``11^T/2``).
    """
    n = _check_n(n, minimum=2)
    if n % 2:
        raise ValueError(f"bipartite (K_(n/2,n/2)) needs an even cluster size n >= 2; got n = {n}")
    idx = np.arange(n)
    adj = (idx[:, None] - idx[None, :]) % 2 == 1
    adj |= np.eye(n, dtype=bool)
    return adj.astype(np.float64) / (n // 2 + 1)


def interpolated(n: int, lam: float) -> np.ndarray:
    """``W(lam) = lam * W_ring + (1 - lam) * 11^T / n`` for ``lam`` in [0, 1] (§3.5, §9).

    ``W(lam) - 11^T/n = lam (W_ring - 11^T/n)``, so rho(W(lam)) = lam * rho(W_ring) exactly:
    the ablation's rho values are reached with :func:`lambda_for_rho` (lam = 0.1553 for 0.125,
    0.7443 for 0.599 at n = 8). ``lam = 1`` is the ring, ``lam = 0`` the complete graph.
    """
    n = _check_n(n)
    lam = _check_lam(lam)
    return lam * ring(n) + (1.0 - lam) * fully_connected(n)


def mixing_matrix(
    topology: str,
    n: int,
    *,
    lam: float | None = None,
    offsets: Sequence[int] | None = None,
) -> np.ndarray:
    """Build the n x n mixing matrix of a cluster by topology name.

    Parameters
    ----------
    topology : str
        One of :data:`TOPOLOGIES`: ``"ring"``, ``"full"``, ``"bipartite"``, ``"circulant"``,
        ``"identity"``, ``"interpolated"``.
    n : int
        Clients per cluster (>= 1; ``"bipartite"`` needs an even n, ``"circulant"`` n >= 2).
    lam : float, optional
        Interpolation weight in [0, 1]; required by ``"interpolated"``, rejected otherwise.
    offsets : sequence of int, optional
        Circulant offsets, distinct integers in [1, n // 2] with gcd(n, *offsets) = 1;
        required by ``"circulant"``, rejected otherwise.

    Returns
    -------
    np.ndarray
        float64, shape (n, n), symmetric, doubly stochastic, non-negative.

    Raises
    ------
    ValueError
        For an unknown topology, a bad n, lam or offsets, or lam/offsets given to a topology
        that does not use them; the message names the value and what is allowed.
    """
    if not isinstance(topology, str) or topology not in TOPOLOGIES:
        raise ValueError(f"gossip topology {topology!r} is unknown; allowed: {', '.join(TOPOLOGIES)}")
    n = _check_n(n)
    if topology == "interpolated":
        if lam is None:
            raise ValueError("topology 'interpolated' needs lam, a real number in [0, 1]")
    elif lam is not None:
        raise ValueError(f"lam={lam!r} is only used by topology 'interpolated', not {topology!r}")
    if topology == "circulant":
        if offsets is None:
            raise ValueError(f"topology 'circulant' needs offsets, distinct integers in [1, {n // 2}]")
    elif offsets is not None:
        raise ValueError(f"offsets={offsets!r} are only used by topology 'circulant', not {topology!r}")

    if topology == "ring":
        return ring(n)
    if topology == "full":
        return fully_connected(n)
    if topology == "bipartite":
        return complete_bipartite(n)
    if topology == "circulant":
        return circulant(n, offsets)  # type: ignore[arg-type]
    if topology == "identity":
        return identity(n)
    return interpolated(n, lam)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- checks and rho


def _as_square(w: object, what: str = "mixing matrix") -> np.ndarray:
    arr = np.asarray(w)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1] or arr.shape[0] == 0:
        raise ValueError(f"{what} must be a non-empty square 2-D array; got shape {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{what} must hold real numbers; got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=False)
    if not np.all(np.isfinite(arr)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        raise ValueError(f"{what} must be finite; entry {bad} is {float(arr[bad])}")
    return arr


def check_mixing_matrix(w: np.ndarray, *, tol: float = TOLERANCE) -> np.ndarray:
    """Check Assumption 5.5's conditions on W and return it as float64.

    W must be a non-empty square real matrix, finite, non-negative, symmetric, with every row
    and every column summing to 1 (within ``tol``, absolute). Symmetry plus row sums make W
    doubly stochastic, which is what keeps the cluster mean unchanged by gossip (eq. B.1).

    Connectivity (null(I - W) = span(1), i.e. rho < 1) is *not* required, so that the
    ``W = I`` control passes; test ``spectral_gap_rho(W) < 1`` for it.

    Raises
    ------
    ValueError
        Naming the first problem found and where (entry, row or column).
    """
    arr = _as_square(w)
    if arr.min() < 0.0:
        pos = tuple(int(i) for i in np.unravel_index(np.argmin(arr), arr.shape))
        raise ValueError(f"mixing matrix must be non-negative; entry {pos} is {float(arr[pos])!r}")
    asym = np.abs(arr - arr.T)
    if asym.max() > tol:
        i, j = (int(k) for k in np.unravel_index(np.argmax(asym), arr.shape))
        raise ValueError(
            f"mixing matrix must be symmetric (tolerance {tol:g}); W[{i},{j}] = {float(arr[i, j])!r} "
            f"but W[{j},{i}] = {float(arr[j, i])!r}"
        )
    for axis, name in ((1, "row"), (0, "column")):
        sums = arr.sum(axis=axis)
        k = int(np.argmax(np.abs(sums - 1.0)))
        if abs(sums[k] - 1.0) > tol:
            raise ValueError(
                f"every {name} of the mixing matrix must sum to 1 (tolerance {tol:g}); "
                f"{name} {k} sums to {float(sums[k])!r}"
            )
    return arr


def spectral_gap_rho(w: np.ndarray) -> float:
    """rho = ||W - 11^T/n||_2, the paper's "spectral gap" (Assumption 5.5, §3.5, §8 C1).

    For a symmetric doubly stochastic W this is the second-largest singular value (= the
    largest |eigenvalue| other than the eigenvalue 1 on the all-ones vector). Despite the name,
    **smaller is better connected**: 0 for ``11^T/n``, 1 for ``I``; the true spectral gap is
    ``1 - rho``. One gossip step contracts the disagreement by at least this factor:
    ``||W X - 1 xbar^T||_F <= rho ||X - 1 xbar^T||_F``.

    W is checked with :func:`check_mixing_matrix` first (rho of a non-mixing matrix means
    nothing); ``ValueError`` if it fails.
    """
    arr = check_mixing_matrix(w)
    n = arr.shape[0]
    return float(np.linalg.norm(arr - 1.0 / n, ord=2))


def lambda_for_rho(n: int, rho: float) -> float:
    """The ``lam`` for which ``interpolated(n, lam)`` has ``spectral_gap_rho == rho`` (§3.5).

    Closed form: rho(W(lam)) = lam * rho(W_ring(n)), so ``lam = rho / rho_ring``. At n = 8,
    rho_ring = 0.80474 and the ablation values {0, 0.125, 0.599, 0.805} need
    lam = {0, 0.1553, 0.7443, ~1}. ``rho`` must lie in ``[0, rho_ring(n)]``; rho = 0.805 is a
    rounding of rho_ring = 0.80474 and is accepted up to 5e-4 above it (lam is then 1).
    For n <= 3 the ring is already the complete graph (rho_ring = 0): only rho = 0 is
    reachable and lam = 0 is returned.

    Raises
    ------
    ValueError
        For a bad n, or a rho that is not finite or outside the reachable range.
    """
    n = _check_n(n)
    if isinstance(rho, bool) or not isinstance(rho, numbers.Real) or not math.isfinite(rho):
        raise ValueError(f"rho must be a real number; got {rho!r}")
    rho_ring = spectral_gap_rho(ring(n))
    # Reported rho values are rounded (the paper's 0.805 for 0.80474): accept half a unit of
    # the third decimal above the ring and clamp lam to 1.
    slack = 5e-4
    if not 0.0 <= rho <= rho_ring + slack:
        raise ValueError(
            f"rho = {rho} is not reachable by interpolated(n={n}, lam); allowed: 0 <= rho <= rho(ring) = {rho_ring:.5f}"
        )
    if rho_ring <= 1e-12:
        if rho > 1e-12:
            raise ValueError(f"rho = {rho} is not reachable for n = {n}: the ring is the complete graph (rho = 0)")
        return 0.0
    return min(1.0, float(rho) / rho_ring)


# --------------------------------------------------------------------------- faults and mixing


def without_absent(w: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Mixing matrix for a gossip step that some clients of the cluster miss.

    Rule (ours; the paper has no faults): the weight a present client gave an absent one moves
    onto its own diagonal entry, ``W'_ii = W_ii + sum_{j absent} W_ij``, and ``W'_ij = 0`` for
    an absent ``j``. An absent client does not take part: its row is the unit row ``e_i``, so
    its model stays as it was (the server has no new one from it). Weights between present
    clients are unchanged.

    ``W'`` stays symmetric, non-negative and doubly stochastic, so the mean of the cluster's
    models is preserved (eq. B.1) and a missed step never pulls the cluster off its average;
    with everybody present ``W' = W``. The server does the mixing when it relays gossip, so it
    knows every link and can apply the rule (a rule clients apply locally, "average what you
    received", would keep rows stochastic but not columns, and the mean would drift).

    Parameters
    ----------
    w : np.ndarray
        A mixing matrix that passes :func:`check_mixing_matrix`.
    present : np.ndarray of bool, shape (n,)
        ``present[j]`` is True when client j's half-step model arrived for this gossip step.

    Returns
    -------
    np.ndarray
        float64 (n, n), symmetric, non-negative, doubly stochastic.
    """
    arr = check_mixing_matrix(w)
    n = arr.shape[0]
    mask = np.asarray(present)
    if mask.dtype != np.bool_ or mask.shape != (n,):
        raise ValueError(
            f"present must be a boolean array of shape ({n},), one flag per client of the cluster; "
            f"got dtype {mask.dtype}, shape {mask.shape}"
        )
    if mask.all():
        return arr.copy()
    out = np.where(mask[:, None] & mask[None, :], arr, 0.0)
    np.fill_diagonal(out, 0.0)
    out[np.diag_indices(n)] = 1.0 - out.sum(axis=1)  # own weight + the weight of absent neighbours
    return out


def gossip_step(w: np.ndarray, models: np.ndarray) -> np.ndarray:
    """One gossip step ``W @ X`` on a cluster's stacked models (Algorithm 1 line 9).

    ``models`` is ``(n, d)``, one row per client (usually float32, the wire format). The product
    is accumulated in float64 and rounded to float32 once, in column blocks so the float64
    scratch stays ``n x 65536`` whatever d is, and every row adds its terms in the same order:
    two clients with the same row of ``W`` get bit-identical models (``W = 11^T/n`` makes a
    cluster's models equal exactly, as the spec's reduction C2 needs). ``w`` may be any finite ``(n, n)`` matrix (a
    :func:`mixing_matrix` or a :func:`without_absent` result); it is not re-checked for
    symmetry here.

    Returns
    -------
    np.ndarray
        float32 ``(n, d)``, a new array.

    Raises
    ------
    ValueError
        If ``w`` is not a finite square matrix, or ``models`` is not a real 2-D array with n rows.
    """
    arr = _as_square(w)
    x = np.asarray(models)
    n = arr.shape[0]
    if x.ndim != 2 or x.shape[0] != n:
        raise ValueError(f"models must be a 2-D array with one row per client ({n} rows); got shape {x.shape}")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"models must hold real numbers; got dtype {x.dtype}")
    d = x.shape[1]
    out = np.empty((n, d), dtype=np.float32)
    acc = np.empty((n, min(d, _GOSSIP_BLOCK)), dtype=np.float64)
    for start in range(0, d, _GOSSIP_BLOCK):
        stop = min(start + _GOSSIP_BLOCK, d)
        block = acc[:, : stop - start]
        block.fill(0.0)
        for j in range(n):  # the same sequence of adds for every row (BLAS would block rows differently)
            block += arr[:, j : j + 1] * x[j, start:stop].astype(np.float64)
        out[:, start:stop] = block
    return out


# --------------------------------------------------------------------------- cluster layout


def cluster_of(partition_id: int, cluster_size: int) -> int:
    """Cluster of a client: ``partition_id // cluster_size`` (§8 E6, §9: clients 8k..8k+7 form cluster k)."""
    pid = _check_n(partition_id, minimum=0, what="partition_id")
    size = _check_n(cluster_size, minimum=1, what="cluster_size")
    return pid // size


def validate_clusters(assignment: Mapping[str, int]) -> dict[int, list[str]]:
    """Group clients by cluster and check that the clusters are HA-Fed clusters.

    HA-Fed assumes K disjoint clusters of equal size n (§2; the mean over uploads is
    ``(1/K) sum_k (1/m) sum_{i in S_k}``, §3.3). Cluster ids must be integers >= 0, every id from
    0 to the largest must have clients (no empty cluster), and all clusters must have the same
    size.

    Parameters
    ----------
    assignment : mapping of str to int
        Client key (e.g. a node id as a string) -> cluster id.

    Returns
    -------
    dict[int, list[str]]
        Cluster id -> its client keys, sorted; clusters in increasing id order.

    Raises
    ------
    ValueError
        For an empty assignment, a non-string key, a cluster id that is not a non-negative
        integer, an empty cluster, or clusters of unequal sizes; the message lists the sizes.
    """
    if not isinstance(assignment, Mapping) or len(assignment) == 0:
        raise ValueError(f"cluster assignment must be a non-empty mapping client key -> cluster id; got {assignment!r}")
    groups: dict[int, list[str]] = {}
    for key, cid in assignment.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"client keys must be non-empty strings; got {key!r} ({type(key).__name__})")
        if isinstance(cid, bool) or not isinstance(cid, numbers.Integral) or cid < 0:
            raise ValueError(f"client {key!r}: cluster id must be an integer >= 0; got {cid!r}")
        groups.setdefault(int(cid), []).append(key)
    k = max(groups) + 1
    sizes = {c: len(groups.get(c, [])) for c in range(k)}
    empty = [c for c, s in sizes.items() if s == 0]
    if empty:
        raise ValueError(
            f"cluster ids must run 0..{k - 1} with no empty cluster; empty: {empty}; sizes: {sizes}; "
            "allowed: equal, non-empty clusters"
        )
    if len(set(sizes.values())) != 1:
        raise ValueError(f"clusters must all have the same size; sizes: {sizes}; allowed: equal, non-empty clusters")
    return {c: sorted(groups[c]) for c in range(k)}


def segment_bounds(tau: int, every: int) -> list[tuple[int, int]]:
    """The iterations ``[start, stop)`` of each segment: a gossip after every ``every`` and after the last."""
    if tau < 1 or every < 1:
        raise ValueError(f"tau={tau} and gossip-every={every} must both be >= 1")
    ends = [*range(every, tau, every), tau]
    return list(zip([0, *ends[:-1]], ends))
