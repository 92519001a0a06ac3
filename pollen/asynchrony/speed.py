"""Seeded client speeds: how long a client's job takes on the virtual clock of an asynchronous simulation.

Every duration is a pure function of ``(seed, client id, job number)``: a counter-based generator
(``numpy.random.default_rng([seed, stream, client, job])``) draws it, so nothing needs checkpointing, a
resumed run draws the same durations, and adding a client or a job does not shift anyone else's. Models
(``async.md`` §7.1), written as run-config strings:

- ``constant`` (every job 1.0) or ``constant:<d>``;
- ``uniform:<lo>:<hi>``: each job ``U(lo, hi)``;
- ``exponential:<mean>``: each job ``Exp(mean)``;
- ``lognormal:<sigma>``: a client factor ``LogNormal(0, sigma^2)`` drawn once, times a per-job jitter
  ``LogNormal(-jitter^2/2, jitter^2)`` (``lognormal:<sigma>:<jitter>``, jitter 0.1 by default);
- ``stragglers:<fraction>:<k_lo>:<k_hi>``: each client is a straggler with probability ``fraction`` (drawn
  once), ``k ~ U(k_lo, k_hi)`` times slower (drawn once); base jobs ``U(0.9, 1.1)``;
- ``fadas-mild`` / ``fadas-large``: FADAS's three speed classes (argmax of a Dirichlet([3, 2, 1]) draw per
  client), jobs ``U(1,2)``, ``U(3,5)`` and ``U(5,8)`` (mild) or ``U(50,80)`` (large).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

_JOB_STREAM, _CLIENT_STREAM = 0x5EED_0001, 0x5EED_0002
SPEED_KINDS = ("constant", "uniform", "exponential", "lognormal", "stragglers", "fadas-mild", "fadas-large")
_ARITY = {
    "constant": (0, 1),
    "uniform": (2, 2),
    "exponential": (1, 1),
    "lognormal": (1, 2),
    "stragglers": (3, 3),
    "fadas-mild": (0, 0),
    "fadas-large": (0, 0),
}


def client_number(client: str) -> int:
    """A stable 32-bit number for a client id (the same on every machine and Python run)."""
    return zlib.crc32(client.encode("utf-8"))


@dataclass(frozen=True)
class ClientSpeed:
    """A seeded model of job durations (module docstring); ``duration(client, job)`` is deterministic."""

    kind: str = "constant"
    params: tuple[float, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SPEED_KINDS:
            raise ValueError(f"client speed {self.kind!r} is unknown; allowed: {', '.join(SPEED_KINDS)}")
        low, high = _ARITY[self.kind]
        if not low <= len(self.params) <= high:
            raise ValueError(f"client speed {self.kind!r} takes {low}..{high} numbers, got {len(self.params)}")
        if any(not math.isfinite(p) or p < 0 for p in self.params):
            raise ValueError(f"client speed {self.kind!r}: {self.params} holds a negative or non-finite number")
        if self.kind == "uniform" and not 0 < self.params[0] <= self.params[1]:
            raise ValueError(f"client speed uniform:{self.params[0]}:{self.params[1]}: allowed 0 < lo <= hi")
        if self.kind == "stragglers":
            fraction, k_lo, k_hi = self.params
            if not (0 <= fraction <= 1 and 1 <= k_lo <= k_hi):
                raise ValueError(
                    f"client speed stragglers:{fraction}:{k_lo}:{k_hi}: allowed 0 <= fraction <= 1, 1 <= k_lo <= k_hi"
                )
        if self.kind in ("constant", "exponential") and self.params and self.params[0] <= 0:
            raise ValueError(f"client speed {self.kind}:{self.params[0]}: allowed a duration > 0")

    def _rng(self, stream: int, client: str, job: int = 0) -> np.random.Generator:
        return np.random.default_rng([self.seed & 0xFFFFFFFF, stream, client_number(client), job])

    def factor(self, client: str) -> float:
        """The client's own slowness, drawn once per client (1.0 for models without one)."""
        rng = self._rng(_CLIENT_STREAM, client)
        if self.kind == "lognormal":
            return float(rng.lognormal(0.0, self.params[0]))
        if self.kind == "stragglers":
            fraction, k_lo, k_hi = self.params
            straggler, k = rng.random() < fraction, rng.uniform(k_lo, k_hi)
            return float(k) if straggler else 1.0
        if self.kind.startswith("fadas"):
            return float(np.argmax(rng.dirichlet([3.0, 2.0, 1.0])))  # the speed class 0, 1 or 2
        return 1.0

    def duration(self, client: str, job: int) -> float:
        """How long ``client``'s ``job``-th job (0, 1, ...) takes, in virtual time units (> 0)."""
        rng = self._rng(_JOB_STREAM, client, job)
        kind, p = self.kind, self.params
        if kind == "constant":
            return p[0] if p else 1.0
        if kind == "uniform":
            return float(rng.uniform(p[0], p[1]))
        if kind == "exponential":
            return float(rng.exponential(p[0])) + 1e-9
        if kind == "lognormal":
            jitter = p[1] if len(p) > 1 else 0.1
            noise = float(rng.lognormal(-(jitter**2) / 2, jitter)) if jitter else 1.0
            return self.factor(client) * noise
        if kind == "stragglers":
            return self.factor(client) * float(rng.uniform(0.9, 1.1))
        speed_class = int(self.factor(client))
        slowest = (5.0, 8.0) if kind == "fadas-mild" else (50.0, 80.0)
        return float(rng.uniform(*((1.0, 2.0), (3.0, 5.0), slowest)[speed_class]))

    def describe(self) -> str:
        return ":".join([self.kind, *(f"{p:g}" for p in self.params)])


def parse_speed(text: str, seed: int = 0) -> ClientSpeed:
    """A :class:`ClientSpeed` from its run-config string (``"stragglers:0.2:5:10"``); ``ValueError`` naming what
    is allowed when it does not parse."""
    kind, *rest = str(text).strip().split(":")
    try:
        params = tuple(float(value) for value in rest)
    except ValueError:
        raise ValueError(
            f"client speed {text!r}: {rest} are not all numbers; allowed e.g. constant, uniform:1:2, "
            "exponential:1, lognormal:0.5, stragglers:0.2:5:10, fadas-mild, fadas-large"
        ) from None
    return ClientSpeed(kind, params, seed)
