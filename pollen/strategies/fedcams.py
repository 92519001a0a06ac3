"""FedCAMS (Algorithm 2 of Wang, Lin & Chen, ICML 2022) as a Flower strategy.

The server is FedAMS; each sampled client uploads ``C(Delta_i + e_i)`` with its
error-feedback residual ``e_i`` kept in its own ``context.state``. The strategy tells
clients which codec to use through the train config (pollen's ``compression_mod``
reads it) and decodes whatever comes back. With ``compressor="none"`` it is FedAMS
bit for bit.
"""

from __future__ import annotations

from typing import Any

from pollen.compression import CODECS
from pollen.strategies.fedams import FedAMS
from pollen.strategies.uplink import Uplink


class FedCAMS(FedAMS):
    """FedAMS with error-feedback-compressed uploads: ``FedAMS(uplink=Uplink(compressor, ...))``.

    Kept as a class for the drop-in name; everything it adds is the :class:`Uplink` it hands to
    :class:`FedAMS`. The server settings default to FedAMS's drop-in values, ``eta=0.003, eps=1e-8``
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
        uplink = Uplink(codec=compressor, topk_ratio=topk_ratio, error_feedback=error_feedback, granularity=granularity)
        super().__init__(uplink=uplink, **kwargs)

    @property
    def compressor(self) -> str:
        return self.uplink.codec

    @property
    def topk_ratio(self) -> float:
        return self.uplink.topk_ratio

    @property
    def error_feedback(self) -> bool:
        return self.uplink.error_feedback

    @property
    def granularity(self) -> str:
        return self.uplink.granularity
