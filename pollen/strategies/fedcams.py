"""FedCAMS (Algorithm 2 of Wang, Lin & Chen, ICML 2022) as a Flower strategy.

The server is FedAMS; each sampled client uploads ``C(Delta_i + e_i)`` with its
error-feedback residual ``e_i`` kept in its own ``context.state``. The strategy tells
clients which codec to use through the train config (pollen's ``compression_mod``
reads it) and decodes whatever comes back. With ``compressor="none"`` it is FedAMS
bit for bit.
"""

from __future__ import annotations

from typing import Any

from pollen.wire import protocol
from pollen.compression import CODECS, GRANULARITIES
from pollen.strategies.fedams import FedAMS


class FedCAMS(FedAMS):
    """FedAMS with error-feedback-compressed uploads.

    The server settings default to :class:`FedAMS`'s drop-in values, ``eta=0.003, eps=1e-8``
    (chosen for drop-in use, measured in tests/e2e/test_dropin_defaults.py with this class and
    ``compression_mod``); the paper's values are ``eta=1.0, eps=1e-3``.

    Parameters
    ----------
    compressor : str (default: "sign")
        Upload codec: ``"sign"`` (scaled sign, ceil(d/8)+4 bytes), ``"topk"``,
        ``"fp16"`` or ``"none"``.
    topk_ratio : float (default: 1/64)
        Fraction of entries top-k keeps, in (0, 1].
    error_feedback : bool (default: True)
        Keep the client residual ``e_i`` (Algorithm 2); False is the no-EF ablation.
    granularity : str (default: "model")
        ``"model"``: one scale / one global top-k over all layers (the authors' code);
        ``"tensor"``: one per tensor.
    **kwargs
        Everything :class:`FedAMS` takes (``eta``, ``eps``, ``option``, ...).
    """

    def __init__(
        self,
        *,
        compressor: str = "sign",
        topk_ratio: float = 1 / 64,
        error_feedback: bool = True,
        granularity: str = "model",
        **kwargs: Any,
    ) -> None:
        if compressor not in CODECS:
            raise ValueError(f"compressor={compressor!r} is unknown; allowed: {', '.join(CODECS)}")
        if not 0.0 < topk_ratio <= 1.0:
            raise ValueError(f"topk_ratio={topk_ratio!r} is out of range; allowed: a number in (0, 1]")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity={granularity!r} is unknown; allowed: {', '.join(GRANULARITIES)}")
        super().__init__(**kwargs)
        self.compressor = compressor
        self.topk_ratio = float(topk_ratio)
        self.error_feedback = bool(error_feedback)
        self.granularity = granularity

    def extra_summary(self) -> dict[str, Any]:
        summary = super().extra_summary()
        summary["uplink"] = (
            f"{self.compressor} (top-k ratio {self.topk_ratio:g}) granularity={self.granularity} "
            f"error feedback={'on' if self.error_feedback else 'off'}"
        )
        return summary

    def train_config(self, server_round: int) -> dict[str, Any]:
        return {
            protocol.CFG_CODEC: self.compressor,
            protocol.CFG_TOPK_RATIO: self.topk_ratio,
            protocol.CFG_ERROR_FEEDBACK: self.error_feedback,
            protocol.CFG_GRANULARITY: self.granularity,
        }

