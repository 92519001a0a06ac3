"""From strategy name (run-config ``strategy``) to the method: its builder, what it is, its family, its defaults.

The product's table is :data:`pollen.app.methods.METHODS`, written out name by name (no registration by
import). A table of another app (the test harness adds its demo methods: :mod:`pollen.testing.apps`)
is passed as ``methods``; without it the product's table is used. A builder takes the validated
run-config (a mapping of kebab-case keys) and returns a Flower ``Strategy``; the table's modules import
the strategy classes only inside the builders, so a ClientApp that checks its run-config never imports
the server-side strategies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Builder = Callable[[Mapping[str, Any]], Any]


def _no_codec(cfg: Mapping[str, Any]) -> str:
    return "-"


@dataclass(frozen=True)
class Method:
    """One run-config strategy name.

    Attributes
    ----------
    build : Builder
        Makes the strategy from the validated run-config.
    implementation : str
        What it builds, in words (the docs' method tables, error messages).
    family : str
        The module of :mod:`pollen.app.methods` that declares its keys and builders.
    defaults : Mapping[str, Any]
        The method's recommended run-config values (its paper's), used where neither the user nor a
        preset set the key (:func:`pollen.app.config.effective_run_config`).
    codecs : Callable
        The run's codecs in words from its run-config, e.g. ``"sign"`` or ``"topk / down topk"``;
        ``"-"`` for a method that sends dense updates.
    """

    build: Builder
    implementation: str
    family: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    codecs: Callable[[Mapping[str, Any]], str] = _no_codec


Table = Mapping[str, Method]


def _table(methods: Table | None) -> Table:
    if methods is not None:
        return methods
    from pollen.app.methods import METHODS

    return METHODS


def strategy_names(methods: Table | None = None) -> tuple[str, ...]:
    """Every name of the table, in its order."""
    return tuple(_table(methods))


def implementations(methods: Table | None = None) -> dict[str, str]:
    """Name -> what it builds, for the docs and ``--help``-style listings."""
    return {name: method.implementation for name, method in _table(methods).items()}


def method_defaults(name: Any, methods: Table | None = None) -> Mapping[str, Any]:
    """The recommended run-config values of method ``name`` (empty for a name the table lacks)."""
    method = _table(methods).get(name) if isinstance(name, str) else None
    return method.defaults if method is not None else {}


def codecs_of(config: Mapping[str, Any], methods: Table | None = None) -> str:
    """The codecs a run used, in words, from its run-config (``-``: dense, or a strategy the table lacks)."""
    method = _table(methods).get(config.get("strategy")) if isinstance(config.get("strategy"), str) else None
    return method.codecs(config) if method is not None else "-"


def build_strategy(cfg: Mapping[str, Any], methods: Table | None = None) -> Any:
    """The strategy that ``cfg["strategy"]`` names, built from the run-config."""
    table = _table(methods)
    name = cfg["strategy"]
    if name not in table:
        raise ValueError(f"strategy {name!r} is unknown; allowed: {', '.join(table)}")
    return table[name].build(cfg)
