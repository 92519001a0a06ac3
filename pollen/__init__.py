"""pollen: adaptive, communication-efficient federated optimisation for Flower.

The public API, importable from here (each name is loaded on first use, so ``import pollen.optim``
or ``import pollen.compression`` stays free of Flower and torch):

- strategies that drop in where Flower's ``FedAvg`` / ``FedAdam`` are used: :class:`FedAMS`,
  :class:`FedCAMS`, :class:`FedOpt`, :class:`FedAdaVR`, :class:`FedLAMB`, :class:`HAFed`,
  :class:`FedLazy`; what a new method is built from: :class:`AdaptiveStrategy`, :class:`Uplink`,
  :class:`ReplySpec`;
- the client side for any Flower ClientApp: :func:`compression_mod`, :func:`lazy_mod`,
  :class:`LocalLAMB`;
- the math: :func:`make_server_optimizer` (by name, :data:`SERVER_OPTIMIZERS`), :func:`make_codec`.

>>> from pollen import FedCAMS, compression_mod                     # doctest: +SKIP
>>> strategy = FedCAMS(fraction_train=0.5, compressor="sign")       # doctest: +SKIP
"""

from __future__ import annotations

from importlib import metadata

from pollen.core.lazy_exports import lazy_exports

try:
    __version__ = metadata.version("flwr-pollen")
except metadata.PackageNotFoundError:  # a checkout on sys.path without an install: pyproject.toml's version
    __version__ = "0.1.0"

#: Public name -> the module that defines it.
_PUBLIC = {
    **dict.fromkeys(
        (
            "AdaptiveStrategy",
            "FedAMS",
            "FedCAMS",
            "FedOpt",
            "FedAdaVR",
            "FedLAMB",
            "HAFed",
            "FedLazy",
            "Uplink",
            "ReplySpec",
        ),
        "pollen.strategies",
    ),
    **dict.fromkeys(("compression_mod", "lazy_mod", "LocalLAMB"), "pollen.clientside"),
    **dict.fromkeys(("make_server_optimizer", "SERVER_OPTIMIZERS"), "pollen.optim"),
    "make_codec": "pollen.compression",
}

__all__ = ["__version__", *_PUBLIC]

__getattr__ = lazy_exports(__name__, _PUBLIC)


def __dir__() -> list[str]:
    return sorted(__all__)
