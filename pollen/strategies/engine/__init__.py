"""The server engine every pollen strategy is built on: the base and its parts, one module each.

- :mod:`~pollen.strategies.engine.strategy`: ``AdaptiveStrategy``, Flower's ``Strategy`` API and the order of a round;
- :mod:`~pollen.strategies.engine.rounds`: the round driver (Flower's ``start`` loop, mid-round exchanges, resume);
- :mod:`~pollen.strategies.engine.model`: the global model as one flat vector plus buffers;
- :mod:`~pollen.strategies.engine.sampling`: seeded client sampling keyed by stable client ids;
- :mod:`~pollen.strategies.engine.messages`: train, evaluate and mid-round messages, and their bytes;
- :mod:`~pollen.strategies.engine.collector` and :mod:`~pollen.strategies.engine.replies`: every reply read once;
- :mod:`~pollen.strategies.engine.screening` and :mod:`~pollen.strategies.engine.sinks`: outliers out, the aggregate in;
- :mod:`~pollen.strategies.engine.aggregation`: the mean or a robust aggregate of a round's updates;
- :mod:`~pollen.strategies.engine.step`: the server optimiser, stepped double-buffered;
- :mod:`~pollen.strategies.engine.uplink` / :mod:`~pollen.strategies.engine.downlink`: what is compressed each way;
- :mod:`~pollen.strategies.engine.ledger`: what the server applied of each client's upload;
- :mod:`~pollen.strategies.engine.accounting`: per-round numbers measured on the wire;
- :mod:`~pollen.strategies.engine.declared` and :mod:`~pollen.strategies.engine.resume`: saved state and resume.

The methods (``FedAMS``, ``HAFed``, ...) live beside this folder, in :mod:`pollen.strategies`.
"""
