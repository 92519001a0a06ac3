"""Secure aggregation (SecAgg+) for pollen's mean-based methods: the server learns the sum, never one update.

- :mod:`pollen.secagg.codec`: the summable codec (shared-range stochastic integers, error feedback);
- :mod:`pollen.secagg.crypto`: key agreement, sealed shares, masks, Shamir sharing (``cryptography``, Flower);
- :mod:`pollen.secagg.graph`: SecAgg+'s sparse neighbour graph and its default threshold;
- :mod:`pollen.secagg.protocol`: the client's and the server's state machines over the four exchanges.
"""

from pollen.secagg.codec import SummableCodec
from pollen.secagg.crypto import SecAggError
from pollen.secagg.protocol import SecAggAbort, SecAggClient, SecAggServer

__all__ = ["SecAggAbort", "SecAggClient", "SecAggError", "SecAggServer", "SummableCodec"]
