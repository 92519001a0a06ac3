"""Compression of client updates: codecs with exact wire bytes, and error feedback (fedcams §3.6-3.7).

Pure numpy; no Flower imports. The Flower glue (``pollen.clientside``, ``pollen.strategies``) turns a
:class:`Payload` into a record and back.

Client side::

    codec = make_codec("sign")                        # or "topk", "fp16", "none"
    payload, ef = compress_with_feedback(codec, delta, ef)   # ef: ErrorFeedback kept in context.state

Server side::

    update = decode_payload(payload, dim)             # PayloadError if anything is off
"""

from __future__ import annotations

from collections.abc import Sequence

from .codecs import (
    CODECS,
    Codec,
    FP16Codec,
    IdentityCodec,
    PerTensorCodec,
    SignCodec,
    TopKCodec,
    decode_payload,
    index_dtype,
    normalize_segments,
    topk_count,
)
from .error_feedback import ErrorFeedback, compress_with_feedback
from .payload import Payload, PayloadError

__all__ = [
    "CODECS",
    "GRANULARITIES",
    "Codec",
    "ErrorFeedback",
    "FP16Codec",
    "IdentityCodec",
    "Payload",
    "PayloadError",
    "PerTensorCodec",
    "SignCodec",
    "TopKCodec",
    "compress_with_feedback",
    "decode_payload",
    "index_dtype",
    "make_codec",
    "normalize_segments",
    "topk_count",
]

GRANULARITIES: tuple[str, ...] = ("model", "tensor")


def make_codec(
    name: str,
    *,
    topk_ratio: float = 1 / 64,
    segments: Sequence[tuple[int, int] | slice] | None = None,
    granularity: str = "model",
) -> Codec:
    """Build a codec by name.

    Parameters
    ----------
    name : str
        One of ``CODECS``: ``"none"``, ``"sign"``, ``"topk"``, ``"fp16"``.
    topk_ratio : float (default: 1/64)
        Fraction of entries top-k keeps, in (0, 1]; ``k = max(floor(ratio * d), 1)``. Used by ``"topk"`` only.
    segments : list of (start, stop) pairs or slices, optional
        The tensors' slices of the flat vector, in order, tiling ``[0, d)``. Needed for
        ``granularity="tensor"``; ignored for ``"model"``.
    granularity : str (default: "model")
        ``"model"``: one sign scale / one global top-k over the whole vector, as the authors' code and the
        paper's bit counts (fedcams §8.C.12). ``"tensor"``: one per segment (:class:`PerTensorCodec`,
        codec name ``"sign/tensor"`` or ``"topk/tensor"``). ``"none"`` and ``"fp16"`` act entry by entry,
        so they are the same at both granularities and come back unwrapped.

    Raises
    ------
    ValueError
        Unknown name or granularity, ratio out of range, missing or malformed segments.
    """
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {list(CODECS)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; expected one of {list(GRANULARITIES)}")
    codec: Codec
    if name == "none":
        codec = IdentityCodec()
    elif name == "fp16":
        codec = FP16Codec()
    elif name == "sign":
        codec = SignCodec()
    else:
        codec = TopKCodec(topk_ratio)
    if granularity == "tensor":
        if segments is None:
            raise ValueError("granularity='tensor' needs segments: the (start, stop) slice of each tensor")
        if name in ("none", "fp16"):
            normalize_segments(segments)  # still reject malformed segments
            return codec
        return PerTensorCodec(codec, segments)
    return codec
