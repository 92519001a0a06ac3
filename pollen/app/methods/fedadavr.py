"""FedAdaVR / FedAdaVR-Quant, its ablations and its table-based baselines (MIFA, FedVARP): keys, values, builders.

Keys: the server optimiser FedAdaVR puts on the variance-reduced aggregate (``server-optimizer``, also
FedOpt's), the
stored-update table's precision, file and weighting (``table-precision``, ``table-path``,
``vr-weighting``) and the population size N (``num-clients``).

Recommended values (``papers/fedadavr.md`` Table 1 and section 8, the Fashion-MNIST column, the app's
default dataset): server optimiser beta 0.9 / 0.999, eps 1e-8, clients with SGD momentum 0.9, 3 local
epochs of batch 20; each variant's server optimiser and lr as :data:`pollen.vr.VARIANTS` pairs them
(FedAdaVR: adam at 0.01 of the paper's grid {0.001, 0.005, 0.01}; MIFA and FedVARP: plain steps at 1.0;
the ablations at 0.01). Uploads are dense (``compressor = "none"``) as in the paper; naming a codec gives
FedAdaVR with compressed, error-fed uploads (``compressor``, ``topk-ratio``, ``error-feedback``), which no
paper ran.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pollen.app.methods.common import aggregator_kwargs, engine_parts, sampling_kwargs
from pollen.app.methods.fedopt import uplink_of
from pollen.app.spec import choice, non_neg_int, text
from pollen.compression.quant import PRECISIONS
from pollen.vr import VARIANTS, WEIGHTINGS


def _server_optimizers() -> tuple[str, ...]:
    """Every server optimiser by name (FedOpt takes them all; FedAdaVR refuses the ones outside its paper)."""
    from pollen.optim import SERVER_OPTIMIZERS

    return SERVER_OPTIMIZERS


#: ``none`` is the weighting of the variants without variance reduction (fedadavr-novr), not a choice.
VR_WEIGHTINGS = tuple(w for w in WEIGHTINGS if w != "none")

KEYS = {
    "server-optimizer": choice(_server_optimizers, "adam", server_side=True),
    "table-precision": choice(PRECISIONS, "fp32"),
    "table-path": text(""),
    "vr-weighting": choice(VR_WEIGHTINGS, "sampled-normalised"),
    "num-clients": non_neg_int(0),
}

#: Run-config name -> :data:`pollen.vr.VARIANTS` name.
VARIANT_OF = {
    "fedadavr": "fedadavr",
    "mifa": "mifa",
    "fedvarp": "fedvarp",
    "fedadavr-novr": "novr",
    "fedadavr-noopt": "noopt",
}

_PAPER = {
    "beta-1": 0.9,
    "beta-2": 0.999,
    "eps": 1e-8,
    "momentum": 0.9,
    "batch-size": 20,
    "local-epochs": 3,
    "compressor": "none",
}


def _recommended(variant: str) -> dict[str, Any]:
    """The paper's values plus the variant's server lr (and, for FedAdaVR, its optimiser) from its owner."""
    values: dict[str, Any] = {**_PAPER, "server-lr": VARIANTS[variant].server_lr}
    if variant == "fedadavr":  # the others take no optimiser from the run-config
        values["server-optimizer"] = VARIANTS[variant].optimizer
    return values


DEFAULTS: dict[str, Mapping[str, Any]] = {name: _recommended(variant) for name, variant in VARIANT_OF.items()}


def builder(name: str) -> Callable[[Mapping[str, Any]], Any]:
    """The run-config builder of one FedAdaVR variant (``name`` is its run-config name)."""
    variant = VARIANT_OF[name]

    def build(cfg: Mapping[str, Any]) -> Any:
        from pollen.optim.schedule import schedule_factor
        from pollen.strategies.fedadavr import FedAdaVR

        if cfg["population"] and cfg["num-clients"] not in (0, cfg["population"]):
            raise ValueError(
                f"run-config 'num-clients' = {cfg['num-clients']} but 'population' = {cfg['population']}: the "
                "population is the number of clients; allowed: num-clients = 0 (from the population) or equal"
            )

        adaptive = variant == "fedadavr"
        own_table = variant in ("fedadavr", "noopt")
        return FedAdaVR(
            **sampling_kwargs(cfg),
            variant=variant,
            server_optimizer=cfg["server-optimizer"] if adaptive else None,
            eta=cfg["server-lr"],
            client_lr=cfg["local-lr"],
            client_lr_factor=lambda server_round: schedule_factor(cfg, server_round),
            beta_1=cfg["beta-1"],
            beta_2=cfg["beta-2"],
            eps=cfg["eps"],
            bias_correction=True,  # the paper's Appendix B (the constructor's default is the drop-in's)
            vr_weighting=cfg["vr-weighting"] if own_table else None,
            table_precision=cfg["table-precision"] if own_table else None,
            table_path=cfg["table-path"] or None,
            num_clients=cfg["num-clients"] or None,
            unseen_clients="zero",  # the papers' (the constructor's default is the drop-in's)
            uplink=uplink_of(cfg),
            parts=engine_parts(cfg),
            **aggregator_kwargs(cfg),
        )

    build.__name__ = build.__qualname__ = f"build_{name.replace('-', '_')}"
    return build
