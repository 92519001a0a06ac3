"""The round-protocol example (``relay-demo``): its builder, until the demo moves to :mod:`pollen.testing`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pollen.app.methods.common import adaptive_kwargs

KEYS: dict = {}
DEFAULTS: dict[str, Mapping[str, Any]] = {"relay-demo": {}}


def build_relay_demo(cfg: Mapping[str, Any]) -> Any:
    from pollen.strategies.relay_demo import RelayAverage

    return RelayAverage(**adaptive_kwargs(cfg), eta=cfg["server-lr"])
