"""Error feedback (EF) for biased compressors, FedCAMS Algorithm 2 line 12 (fedcams §3.6).

For client ``i`` in round ``t``::

    p     = Delta + e          # error-compensated message
    Delta_hat = C(p)           # what is sent
    e_new = p - Delta_hat      # what was not sent, added back next time

The state is a small object owned by the caller (as in PyTorch's PowerSGD DDP hook): on a Flower client it
lives in ``context.state`` across rounds. A client that is not sampled simply does not call
:func:`compress_with_feedback`, so its residual stays as it was (the paper's "stale error").

Sign convention: ``Delta = x_local - x_global`` (DESIGN.md); EF does not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .codecs import Codec
from .payload import Payload

__all__ = ["ErrorFeedback", "compress_with_feedback"]


@dataclass
class ErrorFeedback:
    """Error-feedback state of one client.

    Parameters
    ----------
    residual : np.ndarray or None (default: None)
        ``e``, the float32 compression error carried to the next round; ``None`` means zero (``e_1 = 0``).
    enabled : bool (default: True)
        ``False`` sends ``C(Delta)`` and leaves the residual untouched (plain biased compression).
    """

    residual: np.ndarray | None = None
    enabled: bool = True


def compress_with_feedback(codec: Codec, delta: np.ndarray, feedback: ErrorFeedback) -> tuple[Payload, ErrorFeedback]:
    """Compress ``delta`` with error feedback; return the payload and the new state.

    ``p = delta + e``; ``payload = C(p)``; ``e_new = p - decode(payload)``, all in float32, so that
    ``sum of decoded payloads + e_final == sum of deltas`` up to float32 rounding. With
    ``feedback.enabled == False`` the payload is ``C(delta)`` and ``feedback`` is returned as is.

    The input state is not modified: a new :class:`ErrorFeedback` is returned, so a failed compression
    (e.g. NaN in ``delta``, which raises ``ValueError``) leaves the caller's state as it was.
    """
    d = np.asarray(delta)
    if d.ndim != 1:
        raise ValueError(f"delta must be a 1-D vector, got shape {d.shape}")
    if not feedback.enabled:
        return codec.encode(d), feedback
    e = feedback.residual
    if e is None:
        p = d.astype(np.float32)  # a fresh copy: e_new is computed in place in it
    else:
        e = np.asarray(e)
        if e.shape != d.shape:
            raise ValueError(
                f"error-feedback residual has shape {e.shape} but delta has shape {d.shape}; "
                "the model's size changed, start again from ErrorFeedback()"
            )
        p = np.add(d, e, dtype=np.float32, casting="unsafe")
    payload = codec.encode(p)
    p -= codec.decode(payload, p.size)  # p becomes e_new
    return payload, ErrorFeedback(residual=p, enabled=True)
