"""What a strategy logs about itself when a run starts (Flower's ``Strategy.summary``)."""

from __future__ import annotations

from logging import INFO
from typing import Any

from flwr.common import log


def log_summary(strategy: Any) -> None:
    """Log ``strategy``'s server optimiser, uplink, method settings, aggregation and sampling, as Flower's do."""
    log(INFO, "\t├──> %s settings:", type(strategy).__name__)
    if strategy.optimizer is not None:
        log(INFO, "\t│\t├── server optimiser: %s %s", strategy.optimizer.name, strategy.optimizer.hyperparameters())
    if strategy.uplink is not None:
        log(INFO, "\t│\t├── uplink: %s", strategy.uplink.describe())
    if getattr(strategy, "privacy", None) is not None:
        log(INFO, "\t│\t├── privacy: %s", strategy.privacy.describe())
    if getattr(strategy, "secagg", None) is not None:
        log(INFO, "\t│\t├── secure aggregation: %s", strategy.secagg.summary())
    for key, value in strategy.extra_summary().items():
        log(INFO, "\t│\t├── %s: %s", key, value)
    log(INFO, "\t│\t├── aggregation: %s (weight key '%s')", strategy.aggregation, strategy.weighted_by_key)
    log(INFO, "\t│\t├── aggregator: %s", strategy.aggregator.describe())
    log(INFO, "\t│\t├── round: %s", strategy.transaction.describe())
    log(
        INFO,
        "\t│\t└── sampling: train %.2f (min %d) | evaluate %.2f (min %d) | seed %d",
        strategy.fraction_train,
        strategy.min_train_nodes,
        strategy.fraction_evaluate,
        strategy.min_evaluate_nodes,
        strategy.seed,
    )


def optimiser_words(strategy: Any) -> str:
    """How a refusal names ``strategy``'s server optimiser ("its server optimiser (amsgrad)")."""
    optimizer = strategy.optimizer
    return "its server optimiser" + (f" ({optimizer.name})" if optimizer is not None else "")
