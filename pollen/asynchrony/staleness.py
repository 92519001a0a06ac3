"""How much a late update counts, and how far FADAS shrinks its step when the buffer holds late ones.

Staleness ``tau`` is counted in server steps: the number of model versions stepped between the version a
client trained from and the one its update is applied to (never in seconds). Three weightings from the
literature (``async.md`` §3-4):

- ``constant``: ``s(tau) = 1`` (FADAS, CA2FL);
- ``polynomial``: ``s(tau) = (1 + tau) ** -a``; FedBuff's ``1 / sqrt(1 + tau)`` is ``a = 0.5``;
- ``hinge``: ``1`` while ``tau <= b``, then ``1 / (a * (tau - b) + 1)`` (FedAsync's, Plato's ``a=10, b=4``).

FedAsync's mixing weight ``alpha_t = alpha * s(tau)`` is a ``scale`` of ``alpha`` on top of any of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STALENESS_KINDS = ("constant", "polynomial", "hinge")
DA_FORMS = ("code", "paper")


@dataclass(frozen=True)
class StalenessWeight:
    """``scale * s(tau)`` for one of :data:`STALENESS_KINDS`; checked on construction."""

    kind: str = "constant"
    a: float = 0.5
    b: float = 4.0
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in STALENESS_KINDS:
            raise ValueError(f"staleness weight {self.kind!r} is unknown; allowed: {', '.join(STALENESS_KINDS)}")
        for name, value, low in (("a", self.a, 0.0), ("b", self.b, 0.0), ("scale", self.scale, 0.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"staleness weight {name}={value!r} is invalid; allowed: a finite number >= {low}")
            if value < low or (name == "scale" and value == 0):
                raise ValueError(
                    f"staleness weight {name}={value!r} is invalid; allowed: > 0"
                    if name == "scale"
                    else f"staleness weight {name}={value!r} is invalid; allowed: >= {low}"
                )

    def __call__(self, tau: int) -> float:
        """The weight of an update ``tau`` steps stale (``tau >= 0``)."""
        if tau < 0:
            raise ValueError(f"staleness {tau} is negative; a reply cannot be newer than the model")
        if self.kind == "constant":
            raw = 1.0
        elif self.kind == "polynomial":
            raw = (1.0 + tau) ** -self.a
        else:
            raw = 1.0 if tau <= self.b else 1.0 / (self.a * (tau - self.b) + 1.0)
        return self.scale * raw

    @property
    def is_one(self) -> bool:
        """Whether every update counts fully (no scaling needed)."""
        return self.kind == "constant" and self.scale == 1.0


def delay_adaptive_scale(tau_max: int, tau_c: float, lr: float, form: str = "code") -> float:
    """FADAS's delay-adaptive factor on the server learning rate for a buffer whose stalest update is ``tau_max``.

    ``1`` while ``tau_max <= tau_c``; beyond it the authors' code uses ``eta_t = eta / tau_max`` (``form="code"``,
    the default) and the paper's rendition ``eta_t = min(eta, 1 / tau_max)`` (``form="paper"``); the factor
    returned is ``eta_t / eta`` (``async.md`` §2.1, §10.1).
    """
    if form not in DA_FORMS:
        raise ValueError(f"delay-adaptive form {form!r} is unknown; allowed: {', '.join(DA_FORMS)}")
    if tau_max <= tau_c or tau_max <= 0:
        return 1.0
    if form == "code":
        return 1.0 / tau_max
    return min(lr, 1.0 / tau_max) / lr if lr > 0 else 1.0
