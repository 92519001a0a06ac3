"""The constructor arguments every strategy takes, read from the validated run-config.

Sampling, screening and the :class:`pollen.strategies.AdaptiveStrategy` basics come from the common
keys of :mod:`pollen.app.config`; each family's builders add their own on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def sampling_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling arguments every strategy takes, from the run-config."""
    return {
        "fraction_train": cfg["fraction-train"],
        "fraction_evaluate": cfg["fraction-evaluate"],
        "min_train_nodes": cfg["min-train-nodes"],
        "min_evaluate_nodes": cfg["min-evaluate-nodes"] if cfg["fraction-evaluate"] > 0 else 0,
        "min_available_nodes": cfg["min-train-nodes"],
    }


#: The ranges of the evaluation metrics pollen's own ClientApp reports (a reply outside is skipped with the reason).
OWN_METRIC_BOUNDS = {"accuracy": (0.0, 1.0), "loss": (0.0, float("inf"))}


def screen_of(cfg: Mapping[str, Any], *, per_client_bound: bool = False) -> Any:
    """The outlier screen the run-config asks for (every strategy, Flower's own included); with central DP or
    secure aggregation (``per_client_bound``: each client's own clip bounds its influence) the norm screen is off
    whatever ``outlier-rule`` says, the metric ranges stay."""
    from pollen.strategies.engine.screening import UpdateScreen

    rule = "off" if per_client_bound else cfg["outlier-rule"]
    return UpdateScreen(rule=rule, factor=cfg["outlier-factor"], metric_bounds=OWN_METRIC_BOUNDS)


def engine_parts(cfg: Mapping[str, Any]) -> Any:
    """The engine's parts from the run-config: a sampler with the run's seed that asks nodes for their client
    ids (and plays ``population`` clients), the outlier screen, and the round's minimum of replies."""
    from pollen.strategies.engine.parts import EngineParts
    from pollen.strategies.engine.sampling import ClientSampler
    from pollen.strategies.engine.transaction import RoundTransaction

    privacy, secagg = privacy_of(cfg), secagg_of(cfg)
    return EngineParts(
        sampler=ClientSampler(seed=cfg["seed"], identify_clients=True, population=cfg["population"]),
        screen=screen_of(
            cfg, per_client_bound=(privacy is not None and privacy.mode == "central") or secagg is not None
        ),
        transaction=RoundTransaction(min_replies=cfg["min-replies"]),
        driver=driver_of(cfg),
        privacy=privacy,
        secagg=secagg,
    )


def secagg_of(cfg: Mapping[str, Any]) -> Any:
    """The secure-aggregation part the run-config asks for (``secagg`` and its keys), or ``None``; the clients'
    stochastic rounding is seeded with the run's ``seed`` (the masks never are)."""
    from pollen.strategies.engine.secure import SecureAggregation

    if not cfg["secagg"]:
        return None
    return SecureAggregation(
        bits=cfg["secagg-bits"],
        clip=cfg["secagg-clip"],
        degree=cfg["secagg-degree"] or None,
        threshold=cfg["secagg-threshold"] or None,
        seed=cfg["seed"],
    )


def privacy_of(cfg: Mapping[str, Any]) -> Any:
    """The privacy part the run-config asks for (``dp`` and its keys), or ``None`` (with central DP the outlier screen
    is off: :func:`screen_of`)."""
    from pollen.strategies.engine.local_privacy import LocalPrivacy
    from pollen.strategies.engine.private import CentralPrivacy

    seed = None if cfg["dp-noise-seed"] < 0 else cfg["dp-noise-seed"]
    if cfg["dp"] == "local":
        return LocalPrivacy(
            clip=cfg["dp-clip"], noise_multiplier=cfg["dp-noise-multiplier"], delta=cfg["dp-delta"], seed=seed
        )
    if cfg["dp"] != "central":
        return None
    sampling = cfg["dp-sampling"]
    if sampling == "auto":
        sampling = "none" if cfg["driver"] == "async" else "without-replacement"
    return CentralPrivacy(
        clip=cfg["dp-clip"],
        noise_multiplier=cfg["dp-noise-multiplier"],
        delta=cfg["dp-delta"],
        sampling=sampling,
        target_epsilon=cfg["dp-target-epsilon"] or None,
        adaptive=cfg["dp-adaptive-clip"],
        target_quantile=cfg["dp-target-quantile"],
        clip_lr=cfg["dp-clip-lr"],
        count_noise=cfg["dp-count-noise"] or None,
        seed=seed,
    )


def driver_of(cfg: Mapping[str, Any]) -> Any:
    """The round driver the run-config asks for: lock-step rounds (with a virtual clock when ``client-speed`` is
    given) or the buffered asynchronous driver with its rule (``driver``, ``async-rule`` and their keys)."""
    from pollen.asynchrony import parse_speed
    from pollen.strategies.engine.buffered import AsyncRule, BufferedAsync
    from pollen.strategies.engine.rounds import SyncRounds

    speed = parse_speed(cfg["client-speed"], cfg["seed"]) if cfg["client-speed"] else None
    if cfg["driver"] == "sync":
        return SyncRounds(speed=speed)
    exponent = cfg["staleness-exponent"]
    rules = {
        "fadas": lambda: AsyncRule.fadas(
            delay_adaptive=cfg["delay-adaptive"], tau_c=cfg["tau-c"], da_form=cfg["da-form"]
        ),
        "fedbuff": lambda: AsyncRule.fedbuff(exponent=exponent),
        "fedasync": lambda: AsyncRule.fedasync(alpha=cfg["fedasync-alpha"], a=exponent),
    }
    return BufferedAsync(
        concurrency=cfg["concurrency"] or None,
        buffer_size=cfg["buffer-size"] or None,
        rule=rules[cfg["async-rule"]](),
        max_staleness=None if cfg["max-staleness"] < 0 else cfg["max-staleness"],
        refill=cfg["refill"],
        clock=cfg["async-clock"],
        speed=speed,
    )


def aggregator_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The aggregator (``aggregator``, and ``trim-fraction`` for the trimmed mean) every pollen strategy takes."""
    from pollen.aggregate import make_aggregator

    name = cfg["aggregator"]
    return {"aggregator": make_aggregator(name, cfg["trim-fraction"] if name == "trimmed-mean" else None)}


def refuse_robust(cfg: Mapping[str, Any], method: str, reason: str) -> None:
    """``ValueError`` when the run-config asks ``method`` (which aggregates its own way) for a robust aggregator."""
    if cfg["aggregator"] != "mean":
        raise ValueError(
            f"run-config 'aggregator' = {cfg['aggregator']!r} does not fit {method}: {reason}; allowed: mean"
        )


def adaptive_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Sampling plus what every pollen ``AdaptiveStrategy`` takes from the run-config."""
    return {
        **sampling_kwargs(cfg),
        **aggregator_kwargs(cfg),
        "aggregation": cfg["aggregation"],
        "parts": engine_parts(cfg),
    }
