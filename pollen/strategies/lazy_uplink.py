"""The lazy family's uplink (FedNLAA ... FedBACA): the engine's :class:`Uplink` part with the upload rule.

A lazy client judges its candidate upload against its reference and skips it (NLA) or sends it to be
added to the copy the server stores (AA); it compresses with the family's own mod
(:func:`pollen.clientside.lazy_mod.lazy_mod`), which reads the ``pollen.lazy.*`` train-config entries,
not the ``pollen.codec`` ones ``compression_mod`` answers. So this part overrides what the base's
uplink says to clients (:meth:`train_config`) and what a reply's update is a decoding of (:attr:`decodes`,
which the aggregator's codec check reads); the per-round threshold stays with
:meth:`pollen.strategies.lazy.FedLazy.train_config`, since it depends on the round's sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pollen.lazy import EF_MODES, RULES
from pollen.strategies.engine.uplink import Uplink
from pollen.wire import protocol


@dataclass(frozen=True)
class LazyUplink(Uplink):
    """Lazy or accelerated uploads, compressed and optionally error-fed.

    Parameters
    ----------
    codec, topk_ratio, error_feedback, granularity
        As :class:`Uplink` (default codec ``"none"``, top-k ratio 1/8: FedLazy's).
    rule : str (default: "nla")
        ``"nla"`` (skip), ``"aa"`` (merge into the stored copy) or ``"none"``.
    ef_mode : str (default: "applied")
        What the residual is kept against (:data:`pollen.lazy.EF_MODES`).
    """

    codec: str = "none"
    topk_ratio: float = 1 / 8
    rule: str = "nla"
    ef_mode: str = "applied"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rule not in RULES:
            raise ValueError(f"up_rule={self.rule!r} is unknown; allowed: {', '.join(RULES)}")
        if self.ef_mode not in EF_MODES:
            raise ValueError(f"ef_mode={self.ef_mode!r} is unknown; allowed: {', '.join(EF_MODES)}")
        object.__setattr__(self, "error_feedback", bool(self.error_feedback) and self.codec != "none")

    @property
    def decodes(self) -> str:
        """An accelerated (aa) reply adds the stored copy to its decoding, so it is no plain decoding of the codec."""
        return self.codec if self.rule != "aa" else f"{self.codec} added to the stored copy (aa)"

    def train_config(self) -> dict[str, Any]:
        """The ``pollen.lazy.*`` entries ``lazy_mod`` reads (not ``pollen.codec``: ``compression_mod`` stays out)."""
        return {
            protocol.CFG_LAZY_UP_RULE: self.rule,
            protocol.CFG_LAZY_UP_CODEC: self.codec,
            protocol.CFG_LAZY_UP_TOPK: self.topk_ratio,
            protocol.CFG_LAZY_EF_MODE: self.ef_mode,
            protocol.CFG_ERROR_FEEDBACK: self.error_feedback,
            protocol.CFG_GRANULARITY: self.granularity,
        }

    def describe(self) -> str:
        feedback = f"on ({self.ef_mode})" if self.error_feedback else "off"
        return f"{self.rule}, {self.codec} (top-k {self.topk_ratio:g}), error feedback {feedback}"
