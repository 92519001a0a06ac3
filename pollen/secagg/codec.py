"""A summable codec: updates as integers that add up exactly under secure aggregation, with error feedback.

Secure aggregation sums vectors modulo ``2**W`` and the server sees only that sum, so every client must
encode its update the same way, with public settings, into integers whose sum cannot wrap:

- each coordinate is clipped to ``[-clip, clip]`` (the public range: it bounds what one honest client can
  move the sum, which is what replaces the server's norm screen under secure aggregation; a malicious
  client can send any integers, which the server cannot see, so the range does not bound it) and scaled
  to ``[-L, L]`` with ``L = 2**(bits-1) - 1``;
- stochastic rounding to an integer (unbiased: ``E[q] = x``), from the client's own random generator;
- two's complement modulo ``2**W``, where ``W`` is the smallest whole number of bytes that holds the sum of
  ``max_clients`` such integers (``2 * max_clients * L + 1`` values) without overflow: the bytes on the
  wire are ``W / 8`` per coordinate, whatever the masks add;
- on the client, what the integers miss (clipping and rounding) goes to an error-feedback residual, added
  to the next round's update, as pollen's compressors do.

The server decodes the sum of ``n`` clients (``n <= max_clients``) into their mean: reinterpret the sum as
signed, times ``clip / L``, over ``n``. Reference: the spec's summable codec (``papers/privacy.md`` §10.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Unsigned lane types by wire width in bits.
_LANES = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
MAX_BITS = 24
MAX_CLIENTS = 1 << 20


@dataclass(frozen=True)
class SummableCodec:
    """Shared-range stochastic integer quantisation, ``bits`` per coordinate, summable over ``max_clients``."""

    clip: float
    bits: int = 8
    max_clients: int = 1024

    def __post_init__(self) -> None:
        if not (isinstance(self.clip, (int, float)) and math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"secagg clip={self.clip!r} is invalid; allowed: a finite number > 0")
        if not (isinstance(self.bits, int) and 2 <= self.bits <= MAX_BITS):
            raise ValueError(f"secagg bits={self.bits!r} is invalid; allowed: an integer from 2 to {MAX_BITS}")
        if not (isinstance(self.max_clients, int) and 1 <= self.max_clients <= MAX_CLIENTS):
            raise ValueError(
                f"secagg max_clients={self.max_clients!r} is invalid; allowed: an integer from 1 to {MAX_CLIENTS}"
            )

    @property
    def levels(self) -> int:
        """``L``: the integers run from ``-L`` to ``L``."""
        return (1 << (self.bits - 1)) - 1

    @property
    def sum_bits(self) -> int:
        """Bits the sum of ``max_clients`` integers needs: ``ceil(log2(2 * max_clients * L + 1))``."""
        return math.ceil(math.log2(2 * self.max_clients * self.levels + 1))

    @property
    def wire_bits(self) -> int:
        """``W``: the sum's bits rounded up to a whole lane (8, 16, 32 or 64); masks are uniform modulo ``2**W``."""
        return next(width for width in _LANES if width >= self.sum_bits)

    @property
    def dtype(self) -> np.dtype:
        """The unsigned integer type of a wire vector (little-endian on the wire)."""
        return np.dtype(_LANES[self.wire_bits]).newbyteorder("<")

    def wire_bytes(self, dim: int) -> int:
        """Bytes of one client's masked vector of ``dim`` coordinates."""
        return dim * self.wire_bits // 8

    def quantize(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Integers in ``[-L, L]`` (int64): ``values`` clipped to the range, scaled, stochastically rounded."""
        scaled = np.clip(np.asarray(values, dtype=np.float64), -self.clip, self.clip) * (self.levels / self.clip)
        low = np.floor(scaled)
        return (low + (rng.random(scaled.shape) < (scaled - low))).astype(np.int64)

    def dequantize(self, integers: np.ndarray) -> np.ndarray:
        """What integers in ``[-L, L]`` stand for, as float32."""
        return (np.asarray(integers, dtype=np.float64) * (self.clip / self.levels)).astype(np.float32)

    def to_wire(self, integers: np.ndarray) -> np.ndarray:
        """Signed integers as lanes modulo ``2**W`` (two's complement)."""
        lanes = np.ascontiguousarray(integers, dtype=np.int64).view(np.uint64)
        if self.wire_bits < 64:
            lanes = lanes & np.uint64((1 << self.wire_bits) - 1)
        return lanes.astype(self.dtype)

    def encode(
        self, update: np.ndarray, residual: np.ndarray | None, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(wire vector, new residual)`` of one client's update with error feedback.

        The update plus the last residual is quantised; what the integers do not carry (the part beyond the
        range, the rounding) is the new residual, float32, flat (the update is flattened).
        """
        update = np.asarray(update, dtype=np.float32).ravel()
        corrected = update if residual is None else update + np.asarray(residual, dtype=np.float32).ravel()
        if not np.all(np.isfinite(corrected)):
            raise ValueError("secagg: the update (with its error-feedback residual) is not finite")
        integers = self.quantize(corrected, rng)
        return self.to_wire(integers), corrected - self.dequantize(integers)

    def signed_sum(self, total: np.ndarray, count: int) -> np.ndarray:
        """The sum modulo ``2**W`` of ``count`` wire vectors, back to signed int64 (two's complement)."""
        if not (isinstance(count, int) and 1 <= count <= self.max_clients):
            raise ValueError(
                f"secagg: a sum of {count!r} updates cannot be decoded; allowed: 1 to max_clients={self.max_clients}"
            )
        total = np.asarray(total)
        if total.dtype != self.dtype:
            raise ValueError(f"secagg: the sum is {total.dtype}, not this codec's {self.dtype}")
        signed = total.astype(np.int64) if self.wire_bits < 64 else total.view(np.int64)
        if self.wire_bits < 64:
            half = 1 << (self.wire_bits - 1)
            signed = np.where(signed >= half, signed - (1 << self.wire_bits), signed)
        return signed

    def decode_mean(self, total: np.ndarray, count: int) -> np.ndarray:
        """The mean update (float32) of ``count`` clients from the sum of their wire vectors."""
        signed = self.signed_sum(total, count)
        return (signed.astype(np.float64) * (self.clip / self.levels) / count).astype(np.float32)


__all__ = ["MAX_BITS", "MAX_CLIENTS", "SummableCodec"]
