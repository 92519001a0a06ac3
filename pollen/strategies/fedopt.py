"""Any server optimiser on the mean of client updates, with any uplink: a method without a class.

``FedOpt(optimizer="adabelief", eta=0.01, uplink=Uplink("sign"))`` is AdaBelief on the server with
scaled-sign, error-fed uploads; ``FedOpt(optimizer="amsgrad", eps_mode="max")`` is FedAMS. The
server optimiser is picked by name from :func:`pollen.optim.make_server_optimizer` (one way for every
strategy); its settings have one spelling from here down to the optimiser (``eta``, ``beta_1``,
``beta_2``, as Flower's ``FedAdam``; ``eps``), and a setting the chosen optimiser has no use for is
refused with its name.
"""

from __future__ import annotations

from typing import Any

from pollen.core.layout import ModelLayout
from pollen.optim import SERVER_OPTIMIZERS, Transform, make_server_optimizer, refuse_unused, settings_of
from pollen.strategies.engine.aggregation import Aggregator
from pollen.strategies.engine.parts import EngineParts
from pollen.strategies.engine.strategy import (
    AdaptiveStrategy,
    MetricsAggregationFn,
)
from pollen.strategies.engine.uplink import Uplink
from pollen.wire import protocol

#: The optimiser settings this strategy takes as arguments (named as the optimisers name them; lamb's
#: ``segments`` come from the model's layout, not from the user).
_SETTINGS = ("eta", "beta_1", "beta_2", "eps", "bias_correction", "eps_mode", "layerwise")

#: Where a strategy built with its defaults drops into a Flower project better than the optimiser's own
#: (the paper's) settings: AdaBelief with FedAMS's reading of the moments, ``beta_2`` 0.99 and no bias
#: correction. Measured in three of Flower's examples (docs/results/dropin.md): with the paper's 0.999 and
#: bias correction it was 10.6 points behind FedAvg after 5 rounds of quickstart-pytorch and 5.2 after 20 of
#: advanced-pytorch; with these, within 5 points in all three. An argument given wins.
DROP_IN_SETTINGS: dict[str, dict[str, Any]] = {"adabelief": {"beta_2": 0.99, "bias_correction": False}}


class FedOpt(AdaptiveStrategy):
    """A named server optimiser on the (weighted) mean of client deltas, with an optional uplink.

    Parameters
    ----------
    optimizer : str (default: "adam")
        One of :data:`pollen.optim.SERVER_OPTIMIZERS` (sgd, adam, amsgrad, yogi, adagrad,
        adabelief, lamb).
    eta : float (default: 0.01)
        Server learning rate.
    beta_1, beta_2, eps, bias_correction, eps_mode, layerwise : (default: None)
        The optimiser's settings, named as it names them (``eps_mode`` for amsgrad, ``layerwise`` for
        lamb); ``None`` keeps the optimiser's own default (for adabelief the drop-in's,
        :data:`DROP_IN_SETTINGS`: ``beta_2=0.99, bias_correction=False``), and a setting the chosen
        optimiser has no use for is refused with its name.
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes : float, int
        Sampling: Flower's ``FedAvg`` arguments, with its defaults and meaning (:class:`AdaptiveStrategy`).
    weighted_by_key, arrayrecord_key, configrecord_key : str
        Flower's weight metric and record names, with its defaults and meaning (:class:`AdaptiveStrategy`).
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : Callable[[list[RecordDict], str], MetricRecord] | None
        Flower's metric aggregation functions; ``None``: each metric's weighted mean (:class:`AdaptiveStrategy`).
    aggregation, aggregator, uplink, parts
        The engine's settings and parts (:class:`AdaptiveStrategy`,
        :class:`~pollen.strategies.engine.parts.EngineParts`).
    """

    def __init__(  # noqa: PLR0913 - Flower's FedAvg arguments, the method's, the engine's
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = protocol.NUM_EXAMPLES,
        arrayrecord_key: str = protocol.ARRAYS_RECORD,
        configrecord_key: str = protocol.CONFIG_RECORD,
        train_metrics_aggr_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregationFn | None = None,
        *,
        optimizer: str = "adam",
        eta: float = 0.01,
        beta_1: float | None = None,
        beta_2: float | None = None,
        eps: float | None = None,
        bias_correction: bool | None = None,
        eps_mode: str | None = None,
        layerwise: bool | None = None,
        aggregation: str = "mean",
        aggregator: str | Aggregator = "mean",
        uplink: Uplink | None = None,
        parts: EngineParts | None = None,
    ) -> None:
        if optimizer not in SERVER_OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is unknown; allowed: {', '.join(SERVER_OPTIMIZERS)}")
        given = {
            "beta_1": beta_1,
            "beta_2": beta_2,
            "eps": eps,
            "bias_correction": bias_correction,
            "eps_mode": eps_mode,
            "layerwise": layerwise,
        }
        self.optimizer_name = optimizer
        for key, value in DROP_IN_SETTINGS.get(optimizer, {}).items():
            given[key] = value if given[key] is None else given[key]
        self.settings = {"eta": eta, **{key: value for key, value in given.items() if value is not None}}
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=weighted_by_key,
            arrayrecord_key=arrayrecord_key,
            configrecord_key=configrecord_key,
            train_metrics_aggr_fn=train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
            optimizer=None,
            aggregation=aggregation,
            aggregator=aggregator,
            uplink=uplink,
            parts=parts,
        )
        self._optimizer_for(None)  # a bad setting fails here, not in round 1

    def _optimizer_for(self, layout: ModelLayout | None) -> Transform:
        """The named optimiser with this strategy's settings (one it has no use for is refused by name);
        lamb's trust ratio per tensor once the layout is known (whole-model norms until then)."""
        refuse_unused(self.optimizer_name, self.settings, offered=_SETTINGS)
        settings = dict(self.settings)
        if "segments" in settings_of(self.optimizer_name):
            layerwise = settings.get("layerwise", True) and layout is not None
            settings.update(layerwise=layerwise, segments=layout.segments if layerwise else None)
        return make_server_optimizer(self.optimizer_name, **settings)

    def build_optimizer(self, layout: ModelLayout) -> Transform:
        return self._optimizer_for(layout)

    def extra_summary(self) -> dict[str, Any]:
        return {"server optimiser": f"{self.optimizer_name} {self.settings}"}
