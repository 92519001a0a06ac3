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

from pollen.app.methods import baselines, fedadavr, fedams, fedlamb, hafed, lazy
from pollen.app.registry import Method

#: The families whose keys make up the schema, in the order of ``pyproject.toml``'s config table.
FAMILIES = (fedams, fedadavr, fedlamb, hafed, lazy, baselines)

_FEDADAVR = "pollen.strategies.FedAdaVR"
_FEDLAMB = "pollen.strategies.FedLAMB"
_LAZY = "pollen.strategies.FedLazy"

METHODS: dict[str, Method] = {
    # Flower's own, metered
    "fedavg": Method(baselines.build_fedavg, "flwr.serverapp.strategy.FedAvg (Flower's own, metered)", "baselines", baselines.DEFAULTS["fedavg"]),
    "fedadam": Method(baselines.build_fedadam, "flwr.serverapp.strategy.FedAdam (Flower's own, metered)", "baselines", baselines.DEFAULTS["fedadam"]),
    "fedyogi": Method(baselines.build_fedyogi, "flwr.serverapp.strategy.FedYogi (Flower's own, metered)", "baselines", baselines.DEFAULTS["fedyogi"]),
    "fedadagrad": Method(baselines.build_fedadagrad, "flwr.serverapp.strategy.FedAdagrad (Flower's own, metered)", "baselines",
                         baselines.DEFAULTS["fedadagrad"]),
    # FedAdaVR (papers/fedadavr.md)
    "fedadavr": Method(fedadavr.builder("fedadavr"), f"{_FEDADAVR} (table-precision != fp32 is FedAdaVR-Quant)", "fedadavr",
                       fedadavr.DEFAULTS["fedadavr"]),
    "mifa": Method(fedadavr.builder("mifa"), f"{_FEDADAVR}(variant='mifa')", "fedadavr", fedadavr.DEFAULTS["mifa"]),
    "fedvarp": Method(fedadavr.builder("fedvarp"), f"{_FEDADAVR}(variant='fedvarp')", "fedadavr", fedadavr.DEFAULTS["fedvarp"]),
    "fedadavr-novr": Method(fedadavr.builder("fedadavr-novr"), f"{_FEDADAVR}(variant='novr')", "fedadavr", fedadavr.DEFAULTS["fedadavr-novr"]),
    "fedadavr-noopt": Method(fedadavr.builder("fedadavr-noopt"), f"{_FEDADAVR}(variant='noopt')", "fedadavr",
                             fedadavr.DEFAULTS["fedadavr-noopt"]),
    # FedAMS / FedCAMS (papers/fedcams.md)
    "fedams": Method(fedams.build_fedams, "pollen.strategies.FedAMS (Option 1 unless eps-mode=add)", "fedams", fedams.DEFAULTS["fedams"]),
    "fedamsgrad": Method(fedams.build_fedamsgrad, "pollen.strategies.FedAMS(option=2)", "fedams", fedams.DEFAULTS["fedamsgrad"]),
    "fedcams": Method(fedams.build_fedcams, "pollen.strategies.FedCAMS", "fedams", fedams.DEFAULTS["fedcams"], fedams.uplink_codec),
    # Fed-LAMB (papers/fedlamb.md)
    "fed-lamb": Method(fedlamb.builder("fed-lamb"), f"{_FEDLAMB} (LAMB local steps, v_hat = max(v_hat, mean v_i))", "fedlamb",
                       fedlamb.DEFAULTS["fed-lamb"]),
    "mime-lamb": Method(fedlamb.builder("mime-lamb"), f"{_FEDLAMB}(variant='mime-lamb') (full-batch gradients make v_hat)", "fedlamb",
                        fedlamb.DEFAULTS["mime-lamb"]),
    "fed-ams": Method(fedlamb.builder("fed-ams"), f"{_FEDLAMB}(variant='fed-ams') (local AMSGrad with the shared v_hat)", "fedlamb",
                      fedlamb.DEFAULTS["fed-ams"]),
    "mime": Method(fedlamb.builder("mime"), f"{_FEDLAMB}(variant='mime') (Mime with AMSGrad)", "fedlamb", fedlamb.DEFAULTS["mime"]),
    "adp-fed": Method(fedlamb.builder("adp-fed"), f"{_FEDLAMB}(variant='adp-fed') (local SGD, server Adam of Algorithm 2)", "fedlamb",
                      fedlamb.DEFAULTS["adp-fed"]),
    "fed-sgd": Method(fedlamb.builder("fed-sgd"), f"{_FEDLAMB}(variant='fed-sgd') (local SGD, x <- mean x_i)", "fedlamb",
                      fedlamb.DEFAULTS["fed-sgd"]),
    # HA-Fed (papers/hafed.md)
    "hafed": Method(hafed.build_hafed, "pollen.strategies.HAFed (gossip in clusters, relayed through the server; server AMSGrad)", "hafed",
                    hafed.DEFAULTS["hafed"]),
    "fedamsgrad-stratified": Method(hafed.build_fedamsgrad_stratified,
                                    "pollen.strategies.HAFed(topology='identity') (HA-Fed without gossip: m per cluster)", "hafed",
                                    hafed.DEFAULTS["fedamsgrad-stratified"]),
    "fedamsgrad-uniform": Method(hafed.build_fedamsgrad_uniform,
                                 "pollen.strategies.HAFed(topology='identity', clustered=False) (HA-Fed's baseline)", "hafed",
                                 hafed.DEFAULTS["fedamsgrad-uniform"]),
    # lazy / accelerated aggregation (papers/fedbaca.md)
    "fednlaa": Method(lazy.builder("fednlaa"), f"{_LAZY}(up_rule='nla') (Algorithm 1: lazy uplink, uncompressed)", "lazy",
                      lazy.DEFAULTS["fednlaa"], lazy.codecs("fednlaa")),
    "fedaa": Method(lazy.builder("fedaa"), f"{_LAZY}(up_rule='aa') (Algorithm 1: accelerated uplink, uncompressed)", "lazy",
                    lazy.DEFAULTS["fedaa"], lazy.codecs("fedaa")),
    "fednlaca": Method(lazy.builder("fednlaca"), f"{_LAZY}(up_rule='nla', compressor=...) (Algorithm 3: lazy, compressed, error feedback)",
                       "lazy", lazy.DEFAULTS["fednlaca"], lazy.codecs("fednlaca")),
    "fedaca": Method(lazy.builder("fedaca"), f"{_LAZY}(up_rule='aa', compressor=...) (Algorithm 3: accelerated, compressed)", "lazy",
                     lazy.DEFAULTS["fedaca"], lazy.codecs("fedaca")),
    "fedbnlaca": Method(lazy.builder("fedbnlaca"), f"{_LAZY}(..., down_compressor=..., down_rule='nla') (Algorithm 2: both ways)", "lazy",
                        lazy.DEFAULTS["fedbnlaca"], lazy.codecs("fedbnlaca")),
    "fedbaca": Method(lazy.builder("fedbaca"), f"{_LAZY}(..., down_compressor=..., down_rule='aa') (Algorithm 2: both ways)", "lazy",
                      lazy.DEFAULTS["fedbaca"], lazy.codecs("fedbaca")),
}

__all__ = ["FAMILIES", "METHODS"]
