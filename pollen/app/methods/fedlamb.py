"""Fed-LAMB, Mime-LAMB and their baselines (Fed-AMS, Mime, Adp-Fed, Fed-SGD): run-config keys, values, builders.

Keys: how often the server synchronises ``v_hat`` (``sync-every``, Z) and which rounds those are
(``sync-phase``). The local step's weight decay is run-config ``weight-decay``; Adp-Fed's server lr
is ``server-lr`` (the others average models).

Recommended values (``papers/fedlamb.md`` sections 6.2 and 10): beta 0.9 / 0.999, eps 1e-8 (``v_hat``'s
start and floor), half of the clients per round, one local epoch of batch 128, ``v_hat`` synchronised
every round. The paper tunes the learning rates on its Table 2 grid and does not report the chosen
ones, so they stay as set (the ``fedlamb-*`` presets carry a CPU grid's choice).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pollen.app.methods.common import adaptive_kwargs
from pollen.app.spec import choice, pos_int


def _sync_phases() -> tuple[str, ...]:
    """The rounds :class:`pollen.strategies.FedLAMB` can synchronise on (read on the server only)."""
    from pollen.strategies.fedlamb import SYNC_PHASES

    return SYNC_PHASES


KEYS = {
    "sync-every": pos_int(1),
    "sync-phase": choice(_sync_phases, "first", server_side=True),
}

VARIANTS = ("fed-lamb", "mime-lamb", "fed-ams", "mime", "adp-fed", "fed-sgd")

_PAPER = {
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "fraction-train": 0.5,
    "local-epochs": 1,
    "batch-size": 128,
    "sync-every": 1,
}

DEFAULTS: dict[str, Mapping[str, Any]] = {variant: _PAPER for variant in VARIANTS}


def builder(variant: str) -> Callable[[Mapping[str, Any]], Any]:
    """The run-config builder of one variant of :class:`pollen.strategies.FedLAMB`."""

    def build(cfg: Mapping[str, Any]) -> Any:
        from pollen.strategies.fedlamb import FedLAMB

        return FedLAMB(
            **adaptive_kwargs(cfg),
            variant=variant,
            beta_1=cfg["beta1"],
            beta_2=cfg["beta2"],
            eps=cfg["eps"],
            weight_decay=cfg["weight-decay"],
            sync_every=cfg["sync-every"],
            sync_phase=cfg["sync-phase"],
            eta=cfg["server-lr"],
        )

    build.__name__ = build.__qualname__ = f"build_{variant.replace('-', '_')}"
    return build
