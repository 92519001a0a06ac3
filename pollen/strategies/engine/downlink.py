"""What the server sends down: a codec with error feedback against per-client mirrors, given as one part.

The counterpart of :class:`~pollen.strategies.engine.uplink.Uplink` for the other direction (FedBACA's
Algorithm 2, the spec's increment reading): the server keeps a mirror ``x_i`` of each client's model,
the last increment ``c_prev_i`` and the downlink error ``e_i`` (:data:`Downlink.MIRRORS`, one
per-client table each), and sends ``C(theta_t - x_i + e_i)`` judged by NLA / AA against
``c_prev_i``; both sides add what was sent to ``x_i`` (:func:`pollen.lazy.downlink_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from pollen.compression import CODECS, GRANULARITIES, make_codec
from pollen.lazy.rules import DOWNLINK_MODES, RULES, check_choice, check_tau, downlink_step


@dataclass(frozen=True)
class Downlink:
    """A compressed, error-fed downlink with per-client mirrors.

    Parameters
    ----------
    codec : str (default: "topk")
        Codec of the increments: ``"topk"``, ``"sign"``, ``"fp16"`` or ``"none"``.
    topk_ratio : float (default: 1/8)
        Fraction of entries top-k keeps, in (0, 1].
    rule : str (default: "none")
        ``"nla"`` (skip an increment close to the last one), ``"aa"`` (merge) or ``"none"``.
    tau : float (default: 0.0)
        Effective threshold of the rule, >= 0.
    mode : str (default: "increment")
        ``"increment"`` (recommended), ``"model-keep"`` (Variant B; NLA only) or ``"literal"``
        (Variant C, the negative control).
    granularity : str (default: "model")
        One scale / one top-k over the model, or per tensor (``"tensor"``).
    """

    #: The per-client vectors the server keeps for this downlink.
    MIRRORS: ClassVar[tuple[str, ...]] = ("x", "c-prev", "error")

    codec: str = "topk"
    topk_ratio: float = 1 / 8
    rule: str = "none"
    tau: float = 0.0
    mode: str = "increment"
    granularity: str = "model"

    def __post_init__(self) -> None:
        check_choice("down_compressor", self.codec, CODECS)
        check_choice("down_rule", self.rule, RULES)
        check_choice("downlink_mode", self.mode, DOWNLINK_MODES)
        check_choice("granularity", self.granularity, GRANULARITIES)
        if isinstance(self.topk_ratio, bool) or not 0.0 < self.topk_ratio <= 1.0:
            raise ValueError(f"down_topk_ratio={self.topk_ratio!r} is out of range; allowed: a number in (0, 1]")
        if self.mode == "model-keep" and self.rule == "aa":
            raise ValueError("downlink_mode='model-keep' (Variant B) has no AA reading; allowed down_rule: nla or none")
        object.__setattr__(self, "tau", check_tau("down_tau", self.tau))
        object.__setattr__(self, "topk_ratio", float(self.topk_ratio))

    def make_codec(self, segments: Any) -> Any:
        """The codec of the increments for a model with these tensor ``segments``."""
        return make_codec(self.codec, topk_ratio=self.topk_ratio, segments=segments, granularity=self.granularity)

    def step(
        self,
        codec: Any,
        theta: np.ndarray,
        x: np.ndarray,
        c_prev: np.ndarray | None,
        error: np.ndarray | None,
        *,
        tau: float | None = None,
    ) -> Any:
        """The decision for one client (``(DownlinkStep, payload or None)``, :func:`pollen.lazy.downlink_step`);
        ``tau`` replaces the part's threshold for this round (the paper's ``D / (alpha |S_t|)`` scaling)."""
        tau = self.tau if tau is None else tau
        return downlink_step(theta, x, c_prev, error, codec, rule=self.rule, tau=tau, mode=self.mode)

    def describe(self) -> str:
        """One line for ``summary()``."""
        return f"{self.rule} tau={self.tau:g}, {self.codec} (top-k {self.topk_ratio:g}), {self.mode} reading"
