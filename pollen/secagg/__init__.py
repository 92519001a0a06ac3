"""Secure aggregation (SecAgg+) for pollen's mean-based methods: the server learns the sum, never one update.

- :mod:`pollen.secagg.codec`: the summable codec (shared-range stochastic integers, error feedback);
- :mod:`pollen.secagg.crypto`: key agreement, sealed shares, masks, Shamir sharing (``cryptography``, Flower);
- :mod:`pollen.secagg.graph`: SecAgg+'s sparse neighbour graph and its default threshold;
- :mod:`pollen.secagg.protocol`: the client's and the server's state machines over the four exchanges.

The names below are looked up on first use (PEP 562), not imported here: Flower's simulation imports the
ServerApp and the ClientApps in threads of one process, and a package whose ``__init__`` imports its own
modules while another thread imports one of them directly deadlocks on the import locks (Python 3.11 then
hands one thread a partially initialised module; ``tests/unit/test_import_order.py``).
"""

from __future__ import annotations

from pollen.core.lazy_exports import lazy_exports

#: Each public name and the module that defines it.
_EXPORTS = {
    "SecAggAbort": "pollen.secagg.protocol",
    "SecAggClient": "pollen.secagg.protocol",
    "SecAggServer": "pollen.secagg.protocol",
    "SecAggError": "pollen.secagg.crypto",
    "SummableCodec": "pollen.secagg.codec",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
