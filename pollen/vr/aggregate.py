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

from pollen.compression import quant
from pollen.vr.table import ClientKey, EncodedRow, UpdateTable, client_key

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
    if not updates:
        raise ValueError("vr_aggregate needs at least one update (all sampled clients failed?)")
    dim = table.dim if table is not None else np.asarray(next(iter(updates.values()))).shape[-1]
    wmap = None if weights is None else {client_key(k): float(v) for k, v in weights.items()}
    missing = [client_key(k) for k in updates if wmap is not None and client_key(k) not in wmap]
    if missing:
        raise KeyError(f"no weight for client(s) {missing}")
    round_ = VRRound(table, dim, weighting=weighting, stage=False)
    for key, y in updates.items():
        round_.add(key, _as_vector(y, dim), 1.0 if wmap is None else wmap[client_key(key)])
    return round_.delta(num_clients=num_clients, client_lr=client_lr, total_weight=total_weight).copy()


class VRRound:
    """One round of the variance-reduced aggregate, fed one update at a time (the streaming form).

    :meth:`add` takes ``y_i`` as soon as a reply is read and keeps no float vector of it: it adds
    ``n_i (y_i - D(y_i_old))`` (``n_i y_i`` for a client without a row, or with ``weighting="none"``) to the
    round's sum and, with ``stage=True``, encodes ``y_i`` into the table's storage format, to be written by
    :meth:`commit` after the server step; both happen block by block (:meth:`UpdateTable.blocks`), so each block
    of ``y_i`` and of the decoded old row is read while it is in cache. :meth:`delta` applies the
    weighting's coefficient, which needs every ``n_i`` of the round, once at the end:

        r = running_sum_old / W  +  k * sum_i n_i (y_i - D(y_i_old)),   k = 1 / sum_S n  |  N / (M W)  |  1 / W

    Memory beyond the table: the sum (one float32 vector, like FedAMS's running mean; the last step is in
    float64), one block's buffers and the staged rows in the table's precision (an int4 row is 1/8 of a
    float32 vector). The table is not touched before :meth:`commit`.
    """

    def __init__(
        self, table: UpdateTable | None, dim: int, *, weighting: str = "sampled-normalised", stage: bool = True
    ) -> None:
        self.table = table
        self.dim = int(dim)
        self.weighting = check_weighting(weighting)
        self.stage = stage and table is not None
        self.total = np.zeros(self.dim, dtype=np.float32)
        self.weights: dict[str, float] = {}
        self.staged: dict[str, EncodedRow] = {}
        self._delta: np.ndarray | None = None

    def add(self, key: ClientKey, y: np.ndarray, weight: float = 1.0) -> None:
        """Take client ``key``'s ``y`` (float32, length ``dim``) with weight ``n_i``; ``y`` is not kept.

        ``y`` must be finite: the caller checks it (:func:`vr_aggregate` does; a strategy's reply reader has).
        """
        if self._delta is not None:
            raise RuntimeError("this round's delta was taken; start a new VRRound")
        k = client_key(key)
        if k in self.weights:
            raise ValueError(f"client {k!r} already has an update in this round (duplicate client key)")
        n = float(weight)
        if not np.isfinite(n) or n < 0:
            raise ValueError(f"client weight must be finite and >= 0, got {weight!r}")
        if np.shape(y) != (self.dim,):
            raise ValueError(f"update has shape {np.shape(y)}, expected ({self.dim},)")
        old = self.table.row_of(k) if self.weighting != "none" and self.table is not None else None
        work = np.empty(min(quant.CHUNK, self.dim), dtype=np.float32)
        reader = self.table.row_reader(old.data, old.absmax) if old is not None else None

        def visit(t: int, a: int, lo: int, hi: int, block: np.ndarray) -> None:
            old_values = reader.values(t, lo, hi, work) if reader is not None else None
            accumulate(self.total[a + lo : a + hi], block, old_values, n, work)

        staged = None
        if self.stage:  # each block of y is encoded and added to the sum while it is in cache
            staged = self.table.encode(y, check_finite=False, visit=visit)
        elif reader is None:
            accumulate(self.total, y, None, n, work)
        else:
            for t, a, lo, hi in self.table.blocks():
                visit(t, a, lo, hi, y[a + lo : a + hi])
        self.weights[k] = n
        if staged is not None:
            self.staged[k] = staged

    def __len__(self) -> int:
        return len(self.weights)

    def delta(self, *, num_clients: int, client_lr: float = 1.0, total_weight: float | None = None) -> np.ndarray:
        """``client_lr * r`` as float32; the round's sum becomes it (so :meth:`add` is closed afterwards)."""
        if self._delta is not None:
            return self._delta
        if not self.weights:
            raise ValueError("vr_aggregate needs at least one update (all sampled clients failed?)")
        n = np.array(list(self.weights.values()), dtype=np.float64)
        if n.sum() <= 0:
            raise ValueError(f"client weights must be finite, >= 0 and not all 0, got {n.tolist()}")
        stored = None
        if self.weighting == "none":
            k, W = 1.0 / n.sum(), 1.0
        else:
            if int(num_clients) < 1:
                raise ValueError(f"num_clients={num_clients} must be >= 1")
            if total_weight is None:
                W = population_weight(self.table, self.weights, num_clients)
            else:
                W = float(total_weight)
                if not np.isfinite(W) or W <= 0:
                    raise ValueError(f"total_weight={total_weight!r} must be finite and > 0")
            if self.weighting == "sampled-normalised":
                k = 1.0 / n.sum()
            elif self.weighting == "horvitz-thompson":
                k = population_size(self.table, self.weights, num_clients) / (len(n) * W)
            else:  # literal
                k = 1.0 / W
            stored = self.table.running_sum if self.table is not None else None
        work = np.empty(min(quant.CHUNK, self.dim), dtype=np.float64)
        for lo in range(0, self.dim, quant.CHUNK):
            hi = min(self.dim, lo + quant.CHUNK)
            part = np.multiply(self.total[lo:hi], k, out=work[: hi - lo], dtype=np.float64)
            if stored is not None:
                part += stored[lo:hi] / W
            part *= client_lr
            self.total[lo:hi] = part
        self._delta = self.total
        return self._delta

    def commit(self) -> None:
        """Write the staged rows into the table (after the server step), with their weights."""
        if self.table is None:
            return
        self.table.store_many([(key, row, self.weights[key]) for key, row in self.staged.items()])
        self.staged.clear()


def accumulate(total: np.ndarray, y: np.ndarray, old: np.ndarray | None, n: float, work: np.ndarray) -> None:
    """``total += float32(n) * (y - old)`` in place, ``CHUNK`` elements at a time (``old`` None: ``n * y``;
    ``n == 1``: no product). ``work`` is a float32 scratch of ``min(CHUNK, total.size)`` elements at least,
    and may be ``old`` itself."""
    scale = np.float32(n)
    for lo in range(0, y.size, quant.CHUNK):
        hi = min(y.size, lo + quant.CHUNK)
        target = total[lo:hi]
        if old is None and n == 1.0:
            target += y[lo:hi]
            continue
        part = work[: hi - lo]
        if old is None:
            np.multiply(y[lo:hi], scale, out=part)
        else:
            np.subtract(y[lo:hi], old[lo:hi], out=part)
            if n != 1.0:
                part *= scale
        target += part


def _as_vector(v: Any, dim: int) -> np.ndarray:
    arr = np.asarray(v)
    if arr.ndim != 1 or arr.shape[0] != dim:
        raise ValueError(f"update has shape {arr.shape}, expected ({dim},)")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"update has dtype {arr.dtype}, expected a float array")
    if not np.all(np.isfinite(arr)):
        raise ValueError("update contains NaN or Inf")
    return arr


__all__ = ["WEIGHTINGS", "VRRound", "check_weighting", "population_size", "population_weight", "vr_aggregate"]
