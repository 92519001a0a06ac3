"""Lazy (NLA) and accelerated (AA) aggregation with compression both ways (FedNLAA ... FedBACA).

:mod:`pollen.lazy.rules` holds the rules both sides run; the server side is
:class:`pollen.strategies.lazy.FedLazy`, the client side the Flower mod
:func:`pollen.clientside.lazy_mod.lazy_mod`.
"""

from .rules import (
    DOWNLINK_MODES,
    EF_MODES,
    KINDS,
    REF_MODES,
    RULES,
    DownlinkStep,
    Judgement,
    apply_downlink,
    checksum,
    downlink_step,
    judge,
    norm64,
    replay,
    uplink_residual,
)

__all__ = [
    "DOWNLINK_MODES",
    "EF_MODES",
    "KINDS",
    "REF_MODES",
    "RULES",
    "DownlinkStep",
    "Judgement",
    "apply_downlink",
    "checksum",
    "downlink_step",
    "judge",
    "norm64",
    "replay",
    "uplink_residual",
]
