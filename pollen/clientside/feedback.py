"""The client's half of exact error feedback: what it uploaded last, and what of it the server applied.

An error-fed client (FedCAMS's ``compression_mod``, the lazy family's ``lazy_mod``) keeps its last upload
``u`` and that upload's round ``R`` in its client state. The server's next train message says which of
the client's uploads it applied last (``pollen.applied-round``) and which fraction of it
(``pollen.applied-scale``, below 1 when central DP clipped it): :func:`settle` adds what was not applied
back into the residual,

    applied round == R:  e <- e + (1 - scale) u        (clipped by central DP: the remainder is owed)
    applied round <  R:  e <- e + u                    (lost, skipped or rolled back)

so the sum of what the server applied plus ``e`` equals the sum of the client's true updates, whatever
happened to a reply. An upload the server *refused* for its content (``pollen.refused-round`` is its round:
the outlier screen rejected it or clipped it, validation failed) is not owed: :func:`refused` tells the client
to drop it (what of it was not applied) and its residual, which would otherwise go out again inside every
later upload and be refused every round. A message without
``pollen.applied-round`` (a strategy that does not keep the ledger) means "applied in full", the behaviour
before the ledger existed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pollen.wire import protocol


def refused(config: Mapping[str, Any], pending_round: int | None) -> bool:
    """Whether the server refused the upload of ``pending_round`` for its content (drop it and the residual)."""
    value = config.get(protocol.CFG_REFUSED_ROUND)
    return (
        pending_round is not None and isinstance(value, int) and not isinstance(value, bool) and value == pending_round
    )


def owed(config: Mapping[str, Any], pending_round: int | None, server_round: int) -> float:
    """The fraction of the upload of ``pending_round`` the client still owes (0: nothing, 1: all of it)."""
    if pending_round is None or protocol.CFG_APPLIED_ROUND not in config or not 0 < pending_round < server_round:
        return 0.0
    applied_round = int(config[protocol.CFG_APPLIED_ROUND])
    if applied_round < pending_round:
        return 1.0
    if applied_round == pending_round:
        scale = float(config.get(protocol.CFG_APPLIED_SCALE, 1.0))
        return min(max(1.0 - scale, 0.0), 1.0) if np.isfinite(scale) else 0.0
    return 0.0


def settle(
    residual: np.ndarray | None,
    pending: np.ndarray | None,
    pending_round: int | None,
    config: Mapping[str, Any],
    server_round: int,
) -> np.ndarray | None:
    """``residual`` plus the part of the last upload ``pending`` the server did not apply (float32).

    Returns ``residual`` itself when nothing is owed; a new vector otherwise (the input is not written).
    """
    fraction = owed(config, pending_round, server_round) if pending is not None else 0.0
    if fraction == 0.0 or (residual is not None and residual.shape != pending.shape):
        return residual
    part = pending if fraction == 1.0 else np.float32(fraction) * pending
    return np.array(part, dtype=np.float32) if residual is None else np.add(residual, part, dtype=np.float32)
