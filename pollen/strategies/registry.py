"""One registry from strategy name (run-config ``strategy``) to the builder that makes it.

Each strategy module registers its names next to the class they build::

    @register("fedams", "pollen.strategies.FedAMS (Option 1 unless eps-mode=add)")
    def _build_fedams(cfg):
        return FedAMS(**sampling_kwargs(cfg), eta=cfg["server-lr"], ...)

so the names the run-config allows (``pollen.app.config``) and the README's table come from the modules
that define them, not from copies. A builder takes the validated run-config (a mapping of
kebab-case keys) and returns a Flower ``Strategy``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Builder = Callable[[Mapping[str, Any]], Any]


@dataclass(frozen=True)
class StrategyEntry:
    """A registered strategy: its run-config name, its builder and what it is, in words."""

    name: str
    build: Builder
    implementation: str


_REGISTRY: dict[str, StrategyEntry] = {}


def register(name: str, implementation: str) -> Callable[[Builder], Builder]:
    """Decorator: make ``builder`` the one that ``strategy=<name>`` uses."""

    def decorate(builder: Builder) -> Builder:
        if name in _REGISTRY and _REGISTRY[name].build is not builder:
            raise ValueError(f"strategy name {name!r} is registered twice")
        _REGISTRY[name] = StrategyEntry(name, builder, implementation)
        return builder

    return decorate


def strategy_names() -> tuple[str, ...]:
    """Every registered name, in registration order."""
    return tuple(_REGISTRY)


def implementations() -> dict[str, str]:
    """Name -> what it builds, for the README and ``--help``-style listings."""
    return {name: entry.implementation for name, entry in _REGISTRY.items()}


def build_strategy(cfg: Mapping[str, Any]) -> Any:
    """The strategy that ``cfg["strategy"]`` names, built from the run-config."""
    name = cfg["strategy"]
    if name not in _REGISTRY:
        raise ValueError(f"strategy {name!r} is unknown; allowed: {', '.join(_REGISTRY)}")
    return _REGISTRY[name].build(cfg)


def sampling_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling arguments every strategy takes, from the run-config."""
    return {
        "fraction_train": cfg["fraction-train"],
        "fraction_evaluate": cfg["fraction-evaluate"],
        "min_train_nodes": cfg["min-train-nodes"],
        "min_evaluate_nodes": cfg["min-evaluate-nodes"] if cfg["fraction-evaluate"] > 0 else 0,
        "min_available_nodes": cfg["min-train-nodes"],
    }


def screening_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The outlier screen's settings (every strategy, Flower's own included)."""
    return {"outlier_rule": cfg["outlier-rule"], "outlier_factor": cfg["outlier-factor"]}


def adaptive_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Sampling plus what every pollen ``AdaptiveStrategy`` takes from the run-config."""
    return {
        **sampling_kwargs(cfg),
        **screening_kwargs(cfg),
        "aggregation": cfg["aggregation"],
        "seed": cfg["seed"],
        "identify_clients": True,
        "min_replies": cfg["min-replies"],
    }
