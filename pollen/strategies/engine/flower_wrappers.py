"""Flower's differential-privacy strategy wrappers around a pollen strategy: refused, with the reason.

Flower's four wrappers (``DifferentialPrivacy{Server,Client}Side{Fixed,Adaptive}Clipping`` in
``flwr.serverapp.strategy``) call the wrapped strategy's ``aggregate_train`` and add Gaussian noise to the
model it returns. Around FedAvg that is DP-FedAvg: the returned model is the old one plus the mean of
clipped updates, and noise on it is noise on that mean. Around a server optimiser (pollen's strategies,
Flower's FedAdam / FedYogi / FedAdagrad) the optimiser has already stepped on the noiseless mean: its
moments (and FedAdaVR's stored-update table, a lazy method's book) keep every client's exact update, and
later rounds' models are computed from them, so no privacy statement holds for the run. The wrappers
also drive the rounds with Flower's ``Strategy.start``, which skips pollen's mid-round exchanges, setup
checks and checkpoints.

A strategy calls :func:`refuse_dp_wrapper` from the methods a wrapper calls into (``summary``, which
Flower's ``start`` calls first, and ``configure_train``): it looks at the caller that is not the strategy
itself, and when that is one of Flower's DP wrappers holding this strategy it raises
:class:`~pollen.strategies.engine.rounds.SetupError` with one line, before a message is sent. Nothing else is
inspected, so a strategy driven by its own ``start``, a test or any other caller runs as before.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from pollen.strategies.engine.rounds import SetupError

try:  # Flower's Message API DP wrappers (flwr >= 1.21); a Flower without them has nothing to refuse
    from flwr.serverapp.strategy import (
        DifferentialPrivacyClientSideAdaptiveClipping,
        DifferentialPrivacyClientSideFixedClipping,
        DifferentialPrivacyServerSideAdaptiveClipping,
        DifferentialPrivacyServerSideFixedClipping,
    )

    DP_WRAPPERS: tuple[type, ...] = (
        DifferentialPrivacyClientSideAdaptiveClipping,
        DifferentialPrivacyClientSideFixedClipping,
        DifferentialPrivacyServerSideAdaptiveClipping,
        DifferentialPrivacyServerSideFixedClipping,
    )
except ImportError:  # pragma: no cover - an older or newer Flower that moved them
    DP_WRAPPERS = ()

#: How far up the call stack the wrapper may be (the strategy's own frames first: subclass overrides).
_MAX_DEPTH = 16


def wrapping_strategy(strategy: object, frame: FrameType | None = None) -> Any | None:
    """The object whose method called into ``strategy`` when it holds ``strategy`` as its ``.strategy``, else None.

    From ``frame`` (default: the caller's) up, frames whose ``self`` is ``strategy`` (its own methods, a
    subclass's ``super()`` calls) are passed over; the first frame with another ``self`` (or none) decides.
    """
    frame = sys._getframe(1) if frame is None else frame
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if caller is not strategy:
            return caller if caller is not None and getattr(caller, "strategy", None) is strategy else None
        frame = frame.f_back
    return None


def refuse_dp_wrapper(strategy: object, optimiser: str) -> None:
    """``SetupError`` when one of Flower's DP wrappers is calling into ``strategy`` (whose server step is
    ``optimiser``, as the line names it); call it from the strategy's own method."""
    wrapper = wrapping_strategy(strategy, sys._getframe(1))
    if wrapper is None or not isinstance(wrapper, DP_WRAPPERS):
        return
    name = type(strategy).__name__
    raise SetupError(
        f"{name} cannot run inside Flower's {type(wrapper).__name__}: the wrapper adds its noise to the model "
        f"{name} returns, after {optimiser} stepped on the noiseless mean, so the optimiser's state keeps every "
        "client's exact update and no privacy guarantee holds; allowed: pollen's own DP part, which clips and "
        f"noises before the optimiser ({name}(parts=EngineParts(privacy=CentralPrivacy(clip=..., "
        "noise_multiplier=...))), run-config dp='central', docs/guides/privacy.md), Flower's DP wrappers around "
        "FedAvg (flwr's, or pollen.strategies.MeteredFedAvg), or local DP on the clients"
    )
