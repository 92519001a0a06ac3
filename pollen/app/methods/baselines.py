"""Flower's own FedAvg, FedAdam, FedYogi and FedAdagrad, metered: builders and recommended values.

No keys of their own: they take the common server-optimiser keys (``server-lr`` is Flower's ``eta``,
``eps`` its ``tau``, ``local-lr`` its ``eta_l``). Recommended values: Flower's own constructor defaults,
which is how the papers ran them as baselines ("Flower's built-in strategies with default
hyper-parameter values", ``papers/fedadavr.md`` section 3.9); a test keeps them equal to the installed
Flower's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pollen.app.methods.common import refuse_robust, sampling_kwargs, screen_of

KEYS: dict = {}

DEFAULTS: dict[str, Mapping[str, Any]] = {
    "fedavg": {},
    "fedadam": {"server-lr": 0.1, "beta-1": 0.9, "beta-2": 0.99, "eps": 0.001},
    "fedyogi": {"server-lr": 0.01, "beta-1": 0.9, "beta-2": 0.99, "eps": 0.001},
    "fedadagrad": {"server-lr": 0.1, "eps": 0.001},
}


def _flower_kwargs(cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Sampling and screening; a robust ``aggregator`` is refused (Flower's code aggregates these)."""
    refuse_robust(cfg, f"Flower's own {name}", "Flower's strategy computes its weighted mean inside Flower")
    if cfg["population"]:
        raise ValueError(
            f"run-config 'population' = {cfg['population']} does not fit Flower's own {name}: it samples the "
            "connected nodes itself, one client each; allowed: population = 0, or one of pollen's strategies"
        )
    if cfg["dp"] != "none":
        raise ValueError(
            f"run-config 'dp' = {cfg['dp']!r} does not fit Flower's own {name}: Flower's aggregation weights replies "
            "by their num-examples and steps its optimiser inside Flower, so pollen cannot put clipping and noise "
            "before it; allowed: dp = 'none', or strategy = 'fedopt' (the same server optimisers, pollen's DP part)"
        )
    if cfg["secagg"]:
        raise ValueError(
            f"run-config 'secagg' = true does not fit Flower's own {name}: Flower's aggregation reads every reply's "
            "model; allowed: secagg = false, or strategy = 'fedopt' (the same server optimisers, pollen's secure sum)"
        )
    from pollen.strategies.engine.parts import EngineParts

    return {**sampling_kwargs(cfg), "parts": EngineParts(screen=screen_of(cfg))}


def _optimizer_kwargs(cfg: Mapping[str, Any], *, moments: bool = True) -> dict[str, Any]:
    kwargs = dict(eta=cfg["server-lr"], eta_l=cfg["local-lr"], tau=cfg["eps"])
    if moments:
        kwargs.update(beta_1=cfg["beta-1"], beta_2=cfg["beta-2"])
    return kwargs


def build_fedavg(cfg: Mapping[str, Any]) -> Any:
    from pollen.strategies.baselines import MeteredFedAvg

    return MeteredFedAvg(**_flower_kwargs(cfg, "FedAvg"))


def build_fedadam(cfg: Mapping[str, Any]) -> Any:
    from pollen.strategies.baselines import MeteredFedAdam

    return MeteredFedAdam(**_flower_kwargs(cfg, "FedAdam"), **_optimizer_kwargs(cfg))


def build_fedyogi(cfg: Mapping[str, Any]) -> Any:
    from pollen.strategies.baselines import MeteredFedYogi

    return MeteredFedYogi(**_flower_kwargs(cfg, "FedYogi"), **_optimizer_kwargs(cfg))


def build_fedadagrad(cfg: Mapping[str, Any]) -> Any:
    from pollen.strategies.baselines import MeteredFedAdagrad

    return MeteredFedAdagrad(**_flower_kwargs(cfg, "FedAdagrad"), **_optimizer_kwargs(cfg, moments=False))
