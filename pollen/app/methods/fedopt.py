"""FedOpt: any server optimiser on the mean of client updates, with any uplink (a composition, not a paper).

``strategy=fedopt`` builds :class:`pollen.strategies.FedOpt` from keys other families own:
``server-optimizer`` (any name of :data:`pollen.optim.SERVER_OPTIMIZERS`), ``server-lr``, ``beta-1``,
``beta-2``, ``eps``, ``bias-correction`` and ``eps-mode`` (for amsgrad), and the uplink keys
``compressor``, ``topk-ratio``, ``error-feedback``, ``compression-granularity``; ``compressor = "none"``
asks clients for nothing (full models, any Flower ClientApp). ``aggregation`` picks the mean or the
example-weighted mean. So "AdaBelief with scaled-sign uploads" is
``--run-config "strategy='fedopt' server-optimizer='adabelief' compressor='sign'"``.

Recommended values: no paper ran these points, so they are the adaptive federated optimisation
defaults of Reddi et al. (ICLR 2021) for Adam-type servers on small models: server lr 0.01, beta
0.9 / 0.99, eps 1e-3, no bias correction, and dense uploads unless a codec is named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pollen.app.methods.common import adaptive_kwargs
from pollen.app.methods.fedams import uplink_kwargs

KEYS: dict[str, Any] = {}  # every key it reads belongs to another family

DEFAULTS: dict[str, Mapping[str, Any]] = {
    "fedopt": {
        "server-optimizer": "adam",
        "server-lr": 0.01,
        "beta-1": 0.9,
        "beta-2": 0.99,
        "eps": 0.001,
        "bias-correction": False,
        "compressor": "none",
    },
}

#: ``eps-mode`` of the run-config -> :func:`pollen.optim.amsgrad`'s ``eps_mode`` (``paper`` is FedAMS's max).
_AMSGRAD_EPS = {"paper": "max", "max": "max", "add": "add", "inside": "inside"}


def uplink_of(cfg: Mapping[str, Any]) -> Any:
    """The :class:`pollen.strategies.Uplink` the run-config asks for, or ``None`` for ``compressor = "none"``."""
    from pollen.strategies.engine.uplink import Uplink

    if cfg["compressor"] == "none":
        return None
    settings = uplink_kwargs(cfg)
    return Uplink(codec=settings.pop("compressor"), **settings)


def uplink_codec(cfg: Mapping[str, Any]) -> str:
    """The uplink codec of a run (for ``pollen-compare``): ``-`` when clients upload full models."""
    return "-" if cfg.get("compressor", "none") == "none" else str(cfg["compressor"])


def build_fedopt(cfg: Mapping[str, Any]) -> Any:
    """FedOpt with the named server optimiser, given the settings it takes, and the uplink."""
    from pollen.optim import settings_of
    from pollen.strategies.fedopt import FedOpt

    name = cfg["server-optimizer"]
    given = {
        "beta_1": cfg["beta-1"],
        "beta_2": cfg["beta-2"],
        "eps": cfg["eps"],
        "bias_correction": cfg["bias-correction"],
        "eps_mode": _AMSGRAD_EPS[cfg["eps-mode"]],
    }
    takes = settings_of(name)
    settings = {key: value for key, value in given.items() if key in takes}
    return FedOpt(optimizer=name, eta=cfg["server-lr"], uplink=uplink_of(cfg), **settings, **adaptive_kwargs(cfg))
