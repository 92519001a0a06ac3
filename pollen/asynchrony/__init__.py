"""The arithmetic of asynchronous aggregation, without Flower: staleness weights, FADAS's delay-adaptive
learning rate, and seeded client speeds for a virtual clock (``../shared/papers/async.md``)."""

from pollen.asynchrony.speed import ClientSpeed, parse_speed
from pollen.asynchrony.staleness import StalenessWeight, delay_adaptive_scale

__all__ = ["ClientSpeed", "StalenessWeight", "delay_adaptive_scale", "parse_speed"]
