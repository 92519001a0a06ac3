"""Flower glue shared by strategies and client-side mods: records <-> numpy, payloads.

Everything that converts between Flower's records and pollen's numpy world lives
here once: named arrays to an ``ArrayRecord`` and back, a codec ``Payload`` to the
records that carry it and back, and the byte count of what goes on the wire
(``record.count_bytes()``, never a formula).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from pollen import protocol
from pollen.compression.payload import Payload, PayloadError


def arrays_to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Wrap named numpy arrays in an ``ArrayRecord``, keeping their order."""
    # np.require keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d).
    return ArrayRecord(OrderedDict((name, Array(np.require(a, requirements="C"))) for name, a in arrays.items()))


def record_to_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Unwrap an ``ArrayRecord``; raises ``ValueError`` when an array cannot be decoded."""
    out = {}
    for name, array in record.items():
        try:
            out[name] = array.numpy()
        except Exception as err:  # a malformed array from the wire, whatever numpy says
            raise ValueError(f"array '{name}' cannot be decoded: {err}") from err
    return out


def content_bytes(content: RecordDict) -> int:
    """Bytes of all records in a message content, as Flower counts them."""
    return int(sum(record.count_bytes() for record in content.values()))


def payload_to_records(payload: Payload, granularity: str) -> tuple[ArrayRecord, ConfigRecord]:
    """The records that carry a compressed update."""
    meta = ConfigRecord(
        {
            protocol.META_CODEC: payload.codec,
            protocol.META_DIM: int(payload.dim),
            protocol.META_GRANULARITY: granularity,
        }
    )
    return arrays_to_record(payload.arrays), meta


def records_to_payload(update: ArrayRecord, meta: ConfigRecord) -> Payload:
    """Rebuild a ``Payload`` from its records; ``PayloadError`` when the header is malformed."""
    codec = meta.get(protocol.META_CODEC)
    dim = meta.get(protocol.META_DIM)
    if not isinstance(codec, str):
        raise PayloadError(f"update meta has no codec name (got {codec!r})")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise PayloadError(f"update meta has no integer dim (got {dim!r})")
    try:
        arrays = record_to_arrays(update)
    except ValueError as err:
        raise PayloadError(str(err)) from err
    return Payload(codec=codec, dim=dim, arrays=arrays)
