"""The variance-reduced aggregate of FedAdaVR (spec ``papers/fedadavr.md`` sections 3.4 and 7, item 1).

The printed Eq. 6 (global weights ``p_i`` on the sampled sum) collapses algebraically to MIFA's SAG average;
the spec's boxed estimator is what we build by default:

    r = sum_{i in S} c_i (y_i - D(y_i_old))  +  sum_{j=1..N} p_j D(y_j_old)

with ``y_i`` the fresh updates of the clients that replied, ``y_j_old`` the table *before* this round's
replacement (``D`` = dequantise; zero for never-seen clients), ``p_j = n_j / W`` the population weights
(``W = sum_{k=1..N} n_k``) and, per ``weighting``:

* ``"sampled-normalised"`` (default): ``c_i = q_i = n_i / sum_{k in S} n_k``. Equal sizes: exactly
  FedVARP's ``1/M sum_S (y_i - y_i_old) + 1/N sum_j y_j_old``; a ratio estimator, what Flower's
  ``num_examples`` normalisation gives.
* ``"horvitz-thompson"``: ``c_i = (N/M) p_i``: strictly unbiased for any sizes (equals the default for equal
  sizes).
* ``"literal"``: ``c_i = p_i`` (Eq. 6 as printed). Equals ``sum_j p_j D(y_j_new)``, i.e. MIFA / SAG (fresh
  and stale updates weighted alike), with the table after replacement.
* ``"none"``: no variance reduction, ``r = sum_S q_i y_i`` (FedAvg's aggregate; the NoVR ablation). The table
  is ignored.

The same dequantised ``D(y_i_old)`` enters both sums, so the table's quantisation error cancels for the
sampled clients. The second sum is the table's O(d) running sum divided by ``W``: a round costs O(M d).

Sign and scale. ``y`` is whatever the caller stores: in pollen, ``(x_local - x_global) / client_lr`` (points
downhill; the paper's ``g`` has the opposite sign, which is the same algorithm because everything is linear).
The return value is ``client_lr * r``: the paper's ``G = eta_c r`` (Eq. 8) in pollen's sign, i.e. the
``delta`` for ``pollen.optim`` (whose step is *added* to the model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pollen.vr.table import ClientKey, UpdateTable, client_key

WEIGHTINGS = ("sampled-normalised", "horvitz-thompson", "literal", "none")
"""Allowed values of ``weighting`` / run-config ``vr-weighting`` (underscores are accepted too)."""


def check_weighting(weighting: str) -> str:
    """Canonical spelling of ``weighting`` (``_`` -> ``-``), or ``ValueError`` naming the allowed values."""
    w = str(weighting).replace("_", "-")
    if w not in WEIGHTINGS:
        raise ValueError(f"vr_weighting={weighting!r} is not supported; allowed: {', '.join(WEIGHTINGS)}")
    return w


def population_weight(
    table: UpdateTable | None,
    sample_weights: Mapping[str, float],
    num_clients: int,
) -> float:
    """Estimate ``W = sum_{k=1..N} n_k`` when the server does not know every client's size.

    ``N * mean(n)`` over the clients seen so far (table rows, with the sampled clients' fresh weights). Exact
    when all sizes are equal (``W = N * n``, ``W = N`` for weights of 1). ``N`` is raised to the number of
    distinct clients seen if more have been seen than ``num_clients`` says.
    """
    count = 0 if table is None else table.known_clients
    total = 0.0 if table is None else table.total_weight
    for key, n in sample_weights.items():
        if table is not None and key in table:
            total += n - table.weight(key)
        else:
            count += 1
            total += n
    return total / count * population_size(table, sample_weights, num_clients)


def population_size(table: UpdateTable | None, sampled: Mapping[str, Any], num_clients: int) -> int:
    """``N``: ``num_clients``, raised to the number of distinct clients seen (table rows plus new sampled)."""
    seen = 0 if table is None else table.known_clients
    seen += sum(1 for k in sampled if table is None or k not in table)
    return max(int(num_clients), seen)


def vr_aggregate(
    updates: Mapping[ClientKey, np.ndarray],
    table: UpdateTable | None,
    *,
    num_clients: int,
    weights: Mapping[ClientKey, float] | None = None,
    total_weight: float | None = None,
    weighting: str = "sampled-normalised",
    client_lr: float = 1.0,
) -> np.ndarray:
    """Variance-reduced aggregate ``client_lr * r`` of one round (pure: the table is not modified).

    Parameters
    ----------
    updates : mapping of client key to float vector
        ``y_i`` for every client that replied this round (its update divided by the client learning rate),
        each of length ``table.dim``. Clients that were sampled but did not reply are simply absent.
    table : UpdateTable or None
        The stored updates *before* this round's replacement. None behaves as an empty table (round 0).
    num_clients : int
        ``N``, the size of the client population (used for ``p_j`` and by ``horvitz-thompson``).
    weights : mapping of client key to float, optional
        ``n_i`` of each replying client (number of examples). None gives every client weight 1 (MIFA,
        FedVARP). Must match the weights given to :meth:`UpdateTable.replace`.
    total_weight : float, optional
        ``W = sum_{k=1..N} n_k`` if the server knows it; otherwise :func:`population_weight` estimates it.
    weighting : str, default "sampled-normalised"
        One of :data:`WEIGHTINGS` (see the module docstring).
    client_lr : float, default 1.0
        ``eta_c``; the result is multiplied by it (Eq. 8), giving the server optimiser's ``delta``.

    Returns
    -------
    np.ndarray
        float32 vector of length ``dim``.
    """
    weighting = check_weighting(weighting)
    if not updates:
        raise ValueError("vr_aggregate needs at least one update (all sampled clients failed?)")
    keys = [client_key(k) for k in updates]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate client keys in updates")
    dim = table.dim if table is not None else np.asarray(next(iter(updates.values()))).shape[-1]
    ys = [_as_vector(v, dim) for v in updates.values()]
    if weights is None:
        n = np.ones(len(keys))
    else:
        wmap = {client_key(k): float(v) for k, v in weights.items()}
        missing = [k for k in keys if k not in wmap]
        if missing:
            raise KeyError(f"no weight for client(s) {missing}")
        n = np.array([wmap[k] for k in keys], dtype=np.float64)
    if not np.all(np.isfinite(n)) or np.any(n < 0) or n.sum() <= 0:
        raise ValueError(f"client weights must be finite, >= 0 and not all 0, got {n.tolist()}")

    acc = np.zeros(dim, dtype=np.float64)
    if weighting == "none":
        for ni, yi in zip(n / n.sum(), ys):
            acc += ni * yi
        return (client_lr * acc).astype(np.float32)

    if int(num_clients) < 1:
        raise ValueError(f"num_clients={num_clients} must be >= 1")
    if total_weight is None:
        W = population_weight(table, dict(zip(keys, n.tolist())), num_clients)
    else:
        W = float(total_weight)
        if not np.isfinite(W) or W <= 0:
            raise ValueError(f"total_weight={total_weight!r} must be finite and > 0")

    if weighting == "sampled-normalised":
        coef = n / n.sum()
    elif weighting == "horvitz-thompson":
        N = population_size(table, dict.fromkeys(keys), num_clients)
        coef = (N / len(keys)) * n / W
    else:  # literal
        coef = n / W

    if table is not None:
        acc += table.running_sum / W
    for ci, k, yi in zip(coef, keys, ys):
        old = table.get(k) if table is not None else None
        if old is None:
            acc += ci * yi
        else:
            acc += ci * (yi.astype(np.float64) - old)
    return (client_lr * acc).astype(np.float32)


def _as_vector(v: Any, dim: int) -> np.ndarray:
    arr = np.asarray(v)
    if arr.ndim != 1 or arr.shape[0] != dim:
        raise ValueError(f"update has shape {arr.shape}, expected ({dim},)")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"update has dtype {arr.dtype}, expected a float array")
    if not np.all(np.isfinite(arr)):
        raise ValueError("update contains NaN or Inf")
    return arr


__all__ = ["WEIGHTINGS", "check_weighting", "population_size", "population_weight", "vr_aggregate"]
