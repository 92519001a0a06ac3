"""Every method the app runs: one module per family, one explicit table.

Each family module declares

- its run-config keys (``KEYS``, a :mod:`pollen.app.spec` fragment the schema is assembled from),
- each method's recommended values (``DEFAULTS``: its paper's; :func:`pollen.app.config.effective_run_config`
  applies them where neither the user nor a preset set the key),
- its builders (run-config -> strategy; the strategy classes are imported inside them, so checking a
  run-config never imports the server-side strategies).

:data:`METHODS` names every run-config ``strategy`` value, in the order the app lists them. Nothing
registers itself by being imported: a method is in the app when it is in this table. (The test
harness serves a larger table, with its demo: :data:`pollen.testing.apps.METHODS`.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from pollen.app.methods import baselines, fedadavr, fedams, fedlamb, fedopt, hafed, lazy
from pollen.app.registry import Builder, Method

#: The families whose keys make up the schema, in the order of ``pyproject.toml``'s config table.
FAMILIES = (fedams, fedadavr, fedlamb, hafed, lazy, baselines, fedopt)


def _row(
    family: ModuleType,
    name: str,
    build: Builder,
    implementation: str,
    codecs: Callable[[Mapping[str, Any]], str] | None = None,
) -> tuple[str, Method]:
    """One entry: ``name``, its builder, what it builds, its family and the family's recommended values for it."""
    family_name = family.__name__.rpartition(".")[2]
    if codecs is None:
        return name, Method(build, implementation, family_name, family.DEFAULTS[name])
    return name, Method(build, implementation, family_name, family.DEFAULTS[name], codecs)


_FLOWER = "flwr.serverapp.strategy"
_FEDADAVR = "pollen.strategies.FedAdaVR"
_FEDLAMB = "pollen.strategies.FedLAMB"
_HAFED = "pollen.strategies.HAFed"
_LAZY = "pollen.strategies.FedLazy"

METHODS: dict[str, Method] = dict(
    [
        # Flower's own, metered
        _row(baselines, "fedavg", baselines.build_fedavg, f"{_FLOWER}.FedAvg (Flower's own, metered)"),
        _row(baselines, "fedadam", baselines.build_fedadam, f"{_FLOWER}.FedAdam (Flower's own, metered)"),
        _row(baselines, "fedyogi", baselines.build_fedyogi, f"{_FLOWER}.FedYogi (Flower's own, metered)"),
        _row(baselines, "fedadagrad", baselines.build_fedadagrad, f"{_FLOWER}.FedAdagrad (Flower's own, metered)"),
        # FedAdaVR (papers/fedadavr.md)
        _row(
            fedadavr,
            "fedadavr",
            fedadavr.builder("fedadavr"),
            f"{_FEDADAVR} (table-precision != fp32 is FedAdaVR-Quant)",
            fedopt.uplink_codec,
        ),
        _row(fedadavr, "mifa", fedadavr.builder("mifa"), f"{_FEDADAVR}(variant='mifa')", fedopt.uplink_codec),
        _row(fedadavr, "fedvarp", fedadavr.builder("fedvarp"), f"{_FEDADAVR}(variant='fedvarp')", fedopt.uplink_codec),
        _row(
            fedadavr,
            "fedadavr-novr",
            fedadavr.builder("fedadavr-novr"),
            f"{_FEDADAVR}(variant='novr')",
            fedopt.uplink_codec,
        ),
        _row(
            fedadavr,
            "fedadavr-noopt",
            fedadavr.builder("fedadavr-noopt"),
            f"{_FEDADAVR}(variant='noopt')",
            fedopt.uplink_codec,
        ),
        # FedAMS / FedCAMS (papers/fedcams.md)
        _row(fedams, "fedams", fedams.build_fedams, "pollen.strategies.FedAMS (Option 1 unless eps-mode=add)"),
        _row(fedams, "fedamsgrad", fedams.build_fedamsgrad, "pollen.strategies.FedAMS(option=2)"),
        _row(fedams, "fedcams", fedams.build_fedcams, "pollen.strategies.FedCAMS", fedams.uplink_codec),
        # a composition no paper ran: any server optimiser x any uplink x mean / weighted mean
        _row(
            fedopt,
            "fedopt",
            fedopt.build_fedopt,
            "pollen.strategies.FedOpt(optimizer=server-optimizer, uplink=Uplink(compressor))",
            fedopt.uplink_codec,
        ),
        # Fed-LAMB (papers/fedlamb.md)
        _row(
            fedlamb,
            "fed-lamb",
            fedlamb.builder("fed-lamb"),
            f"{_FEDLAMB} (LAMB local steps, v_hat = max(v_hat, mean v_i))",
        ),
        _row(
            fedlamb,
            "mime-lamb",
            fedlamb.builder("mime-lamb"),
            f"{_FEDLAMB}(variant='mime-lamb') (full-batch gradients make v_hat)",
        ),
        _row(
            fedlamb,
            "fed-ams",
            fedlamb.builder("fed-ams"),
            f"{_FEDLAMB}(variant='fed-ams') (local AMSGrad with the shared v_hat)",
        ),
        _row(fedlamb, "mime", fedlamb.builder("mime"), f"{_FEDLAMB}(variant='mime') (Mime with AMSGrad)"),
        _row(
            fedlamb,
            "adp-fed",
            fedlamb.builder("adp-fed"),
            f"{_FEDLAMB}(variant='adp-fed') (local SGD, server Adam of Algorithm 2)",
        ),
        _row(
            fedlamb, "fed-sgd", fedlamb.builder("fed-sgd"), f"{_FEDLAMB}(variant='fed-sgd') (local SGD, x <- mean x_i)"
        ),
        # HA-Fed (papers/hafed.md)
        _row(
            hafed,
            "hafed",
            hafed.build_hafed,
            f"{_HAFED} (gossip in clusters, relayed through the server; server AMSGrad)",
        ),
        _row(
            hafed,
            "fedamsgrad-stratified",
            hafed.build_fedamsgrad_stratified,
            f"{_HAFED}(topology='identity') (HA-Fed without gossip: m per cluster)",
        ),
        _row(
            hafed,
            "fedamsgrad-uniform",
            hafed.build_fedamsgrad_uniform,
            f"{_HAFED}(topology='identity', clustered=False) (HA-Fed's baseline)",
        ),
        # lazy / accelerated aggregation (papers/fedbaca.md)
        _row(
            lazy,
            "fednlaa",
            lazy.builder("fednlaa"),
            f"{_LAZY}(up_rule='nla') (Algorithm 1: lazy uplink, uncompressed)",
            lazy.codecs("fednlaa"),
        ),
        _row(
            lazy,
            "fedaa",
            lazy.builder("fedaa"),
            f"{_LAZY}(up_rule='aa') (Algorithm 1: accelerated uplink, uncompressed)",
            lazy.codecs("fedaa"),
        ),
        _row(
            lazy,
            "fednlaca",
            lazy.builder("fednlaca"),
            f"{_LAZY}(up_rule='nla', compressor=...) (Algorithm 3: lazy, compressed, error feedback)",
            lazy.codecs("fednlaca"),
        ),
        _row(
            lazy,
            "fedaca",
            lazy.builder("fedaca"),
            f"{_LAZY}(up_rule='aa', compressor=...) (Algorithm 3: accelerated, compressed)",
            lazy.codecs("fedaca"),
        ),
        _row(
            lazy,
            "fedbnlaca",
            lazy.builder("fedbnlaca"),
            f"{_LAZY}(..., down_compressor=..., down_rule='nla') (Algorithm 2: both ways)",
            lazy.codecs("fedbnlaca"),
        ),
        _row(
            lazy,
            "fedbaca",
            lazy.builder("fedbaca"),
            f"{_LAZY}(..., down_compressor=..., down_rule='aa') (Algorithm 2: both ways)",
            lazy.codecs("fedbaca"),
        ),
    ]
)

__all__ = ["FAMILIES", "METHODS"]
