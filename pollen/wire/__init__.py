"""The wire both sides of Flower share: record and config names, records <-> numpy.

- :mod:`pollen.wire.protocol`: every record, config and flag name a strategy and a ClientApp exchange;
- :mod:`pollen.wire.records`: ``ArrayRecord`` <-> named numpy arrays, compressed payloads <-> records.
"""
