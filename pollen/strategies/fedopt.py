"""Any server optimiser on the mean of client updates, with any uplink: a method without a class.

``FedOpt(optimizer="adabelief", eta=0.01, uplink=Uplink("sign"))`` is AdaBelief on the server with
scaled-sign, error-fed uploads; ``FedOpt(optimizer="amsgrad", eps_mode="max")`` is FedAMS. The
server optimiser is picked by name from :func:`pollen.optim.make_server_optimizer` (one way for every
strategy); the strategy's spelling of the settings (``eta``, ``beta_1``, ``beta_2``, ``eps``, as
Flower's ``FedAdam``) is handed to the optimiser under the names it takes, and a setting the chosen
optimiser has no use for is refused with its name.
"""

from __future__ import annotations

import inspect
from typing import Any

from pollen.core.layout import ModelLayout
from pollen.optim import BY_NAME, SERVER_OPTIMIZERS, Transform, make_server_optimizer
from pollen.strategies.base import AdaptiveStrategy

#: The strategy's spelling of each optimiser setting -> the optimiser's.
_SPELLING = {
    "eta": "eta",
    "beta_1": "beta1",
    "beta_2": "beta2",
    "eps": "eps",
    "bias_correction": "bias_correction",
    "eps_mode": "eps_mode",
    "layerwise": "layerwise",
}


class FedOpt(AdaptiveStrategy):
    """A named server optimiser on the (weighted) mean of client deltas, with an optional uplink.

    Parameters
    ----------
    optimizer : str (default: "adam")
        One of :data:`pollen.optim.SERVER_OPTIMIZERS` (sgd, adam, amsgrad, yogi, adagrad,
        adabelief, lamb).
    eta : float (default: 0.01)
        Server learning rate.
    **kwargs
        The optimiser's settings in the strategy's spelling (``beta_1``, ``beta_2``, ``eps``,
        ``bias_correction``, ``eps_mode`` for amsgrad, ``layerwise`` for lamb); everything else goes
        to :class:`AdaptiveStrategy` (sampling, ``aggregation``, ``uplink``, screening, ...).
    """

    def __init__(self, *, optimizer: str = "adam", eta: float = 0.01, **kwargs: Any) -> None:
        if optimizer not in SERVER_OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is unknown; allowed: {', '.join(SERVER_OPTIMIZERS)}")
        settings = {"eta": eta, **{key: kwargs.pop(key) for key in list(kwargs) if key in _SPELLING}}
        self.optimizer_name = optimizer
        self.settings = settings
        super().__init__(optimizer=None, **kwargs)
        self._optimizer_for(None)  # a bad setting fails here, not in round 1

    def _optimizer_for(self, layout: ModelLayout | None) -> Transform:
        hyper = {_SPELLING[key]: value for key, value in self.settings.items()}
        accepted = self._accepted()
        refused = sorted(key for key in self.settings if _SPELLING[key] not in accepted)
        if refused:
            raise ValueError(
                f"{self.optimizer_name} takes no setting {refused[0]}; allowed: "
                + ", ".join(k for k, v in _SPELLING.items() if v in accepted)
            )
        if self.optimizer_name == "lamb":
            layerwise = hyper.get("layerwise", True) and layout is not None
            hyper.update(layerwise=layerwise, segments=layout.segments if layerwise else None)
        return make_server_optimizer(self.optimizer_name, **hyper)

    def _accepted(self) -> set[str]:
        return set(inspect.signature(BY_NAME[self.optimizer_name]).parameters)

    @staticmethod
    def settings_of(optimizer: str) -> tuple[str, ...]:
        """The settings (in the strategy's spelling) that the named optimiser takes."""
        accepted = set(inspect.signature(BY_NAME[optimizer]).parameters)
        return tuple(key for key, name in _SPELLING.items() if name in accepted)

    def build_optimizer(self, layout: ModelLayout) -> Transform:
        return self._optimizer_for(layout)

    def extra_summary(self) -> dict[str, Any]:
        return {"server optimiser": f"{self.optimizer_name} {self.settings}"}
