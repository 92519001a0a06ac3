"""Error feedback (EF) for biased compressors, FedCAMS Algorithm 2 line 12 (fedcams §3.6).

For client ``i`` in round ``t``::

    p     = Delta + e          # error-compensated message
    Delta_hat = C(p)           # what is sent
    e_new = p - Delta_hat      # what was not sent, added back next time

The state is a small object owned by the caller (as in PyTorch's PowerSGD DDP hook): on a Flower client it
lives in ``context.state`` across rounds. A client that is not sampled simply does not call
:func:`compress_with_feedback`, so its residual stays as it was (the paper's "stale error").

With differential privacy the error-compensated vector is privatised (clipped, and noised under local DP)
before it is compressed, and the residual is measured from the privatised vector (privacy spec §6,
:mod:`pollen.privacy.mechanisms`)::

    q = privatize(Delta + e);   Delta_hat = C(q);   e_new = q - Delta_hat

Sign convention: ``Delta = x_local - x_global`` (DESIGN.md); EF does not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
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


def compress_with_feedback(
    codec: Codec,
    delta: np.ndarray,
    feedback: ErrorFeedback,
    privatize: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[Payload, ErrorFeedback]:
    """Compress ``delta`` with error feedback; return the payload and the new state.

    ``p = delta + e``; ``payload = C(p)``; ``e_new = p - decode(payload)``, all in float32, so that
    ``sum of decoded payloads + e_final == sum of deltas`` up to float32 rounding. With
    ``feedback.enabled == False`` the payload is ``C(delta)`` and ``feedback`` is returned as is.

    ``privatize`` (optional; e.g. :func:`pollen.privacy.mechanisms.privatize` with its settings bound) is
    applied to ``p`` (``delta`` without error feedback) before encoding: ``q = privatize(p)``,
    ``payload = C(q)``, ``e_new = q - decode(payload)``. The residual is measured from the privatised
    vector, so what clipping cut off is dropped rather than kept in ``e`` and sent later, and under local
    DP the residual holds only noised values (privacy spec §6). It must return a float vector of ``p``'s
    length and must not change ``p`` in place. ``None``: exactly the behaviour without it.

    The input state is not modified: a new :class:`ErrorFeedback` is returned, so a failed compression
    (e.g. NaN in ``delta``, which raises ``ValueError``) leaves the caller's state as it was.
    """
    d = np.asarray(delta)
    if d.ndim != 1:
        raise ValueError(f"delta must be a 1-D vector, got shape {d.shape}")
    if not feedback.enabled:
        return codec.encode(d if privatize is None else _privatized(privatize, d, d)), feedback
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
    if privatize is not None:
        q = _privatized(privatize, p, d)
        aliased = np.may_share_memory(q, d) or (e is not None and np.may_share_memory(q, e))
        if q is not p and (aliased or not q.flags.writeable):
            q = q.copy()  # e_new is computed in place in it: never in the caller's arrays
        p = q
    payload = codec.encode(p)
    p -= codec.decode(payload, p.size)  # p becomes e_new
    return payload, ErrorFeedback(residual=p, enabled=True)


def _privatized(privatize: Callable[[np.ndarray], np.ndarray], p: np.ndarray, d: np.ndarray) -> np.ndarray:
    q = privatize(p)
    q = np.asarray(q)
    if q.shape != d.shape or not np.issubdtype(q.dtype, np.floating):
        raise ValueError(
            f"privatize returned an array of shape {q.shape} and dtype {q.dtype}; expected floats of shape {d.shape}"
        )
    return q.astype(np.float32, copy=False)
