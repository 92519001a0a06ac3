"""What clients upload: a codec, error feedback and its granularity, given to a strategy as one part.

GRACE's ``Communicator(compressor, memory)`` composes compression; pollen does the same on the
server side: any strategy receives an :class:`Uplink` (``FedAMS(uplink=Uplink("sign"))`` is FedCAMS,
``FedAdaVR(uplink=Uplink("topk", topk_ratio=1/64))`` is FedAdaVR with error-fed top-k uploads),
tells clients through the train config which codec to upload with (pollen's ``compression_mod`` and
ClientApp read it), and decodes whatever comes back (the reply reader understands every codec).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pollen.compression import CODECS, GRANULARITIES
from pollen.wire import protocol


@dataclass(frozen=True)
class Uplink:
    """Compressed, optionally error-fed client uploads.

    Parameters
    ----------
    codec : str (default: "sign")
        ``"sign"`` (scaled sign, ceil(d/8)+4 bytes), ``"topk"``, ``"fp16"`` or ``"none"`` (dense
        float32 through the same path).
    topk_ratio : float (default: 1/64)
        Fraction of entries top-k keeps, in (0, 1].
    error_feedback : bool (default: True)
        Keep each client's residual ``e_i`` and add it to the next upload (FedCAMS Algorithm 2).
    granularity : str (default: "model")
        ``"model"``: one scale / one top-k over all layers (FedCAMS's code); ``"tensor"``: one per tensor.
    """

    codec: str = "sign"
    topk_ratio: float = 1 / 64
    error_feedback: bool = True
    granularity: str = "model"

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"uplink codec={self.codec!r} is unknown; allowed: {', '.join(CODECS)}")
        if (
            isinstance(self.topk_ratio, bool)
            or not isinstance(self.topk_ratio, (int, float))
            or not 0.0 < self.topk_ratio <= 1.0
        ):
            raise ValueError(f"topk_ratio={self.topk_ratio!r} is out of range; allowed: a number in (0, 1]")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback={self.error_feedback!r} is not a bool; allowed: True or False")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r} is unknown; allowed: {', '.join(GRANULARITIES)}")
        object.__setattr__(self, "topk_ratio", float(self.topk_ratio))

    @property
    def decodes(self) -> str:
        """What a reply's update is a decoding of: the codec (the aggregator's codec check reads it)."""
        return self.codec

    def train_config(self) -> dict[str, Any]:
        """The train-config entries that ask a client for this upload."""
        return {
            protocol.CFG_CODEC: self.codec,
            protocol.CFG_TOPK_RATIO: self.topk_ratio,
            protocol.CFG_ERROR_FEEDBACK: self.error_feedback,
            protocol.CFG_GRANULARITY: self.granularity,
        }

    def describe(self) -> str:
        """One line for ``summary()``."""
        return (
            f"{self.codec} (top-k ratio {self.topk_ratio:g}) granularity={self.granularity} "
            f"error feedback={'on' if self.error_feedback else 'off'}"
        )
