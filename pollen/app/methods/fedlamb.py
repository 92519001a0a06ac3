"""Fed-LAMB, Mime-LAMB and their baselines (Fed-AMS, Mime, Adp-Fed, Fed-SGD): run-config keys, values, builders.

Keys: how often the server synchronises ``v_hat`` (``sync-every``, Z) and which rounds those are
(``sync-phase``); the local step's denominator before the first ``v_hat`` (``round1-denominator``:
``local-v``, the authors' code, or ``eps``, the paper's literal ``v_hat_0``); LocalLAMB's zero-norm guard
(``lamb-zero-norm-guard``, the spec's recommended guard: on) and weight-norm scaling ``phi``
(``lamb-phi``: ``identity``, the paper's experiments, or ``clip`` to ``[lamb-phi-min, lamb-phi-max]``).
The local step's weight decay is run-config ``weight-decay``; Adp-Fed's server lr
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
from pollen.app.spec import choice, flag, non_negative, pos_int, positive


def _sync_phases() -> tuple[str, ...]:
    """The rounds :class:`pollen.strategies.FedLAMB` can synchronise on (read on the server only)."""
    from pollen.strategies.fedlamb import SYNC_PHASES

    return SYNC_PHASES


def _round1_denominators() -> tuple[str, ...]:
    from pollen.strategies.fedlamb import ROUND1_DENOMINATORS

    return ROUND1_DENOMINATORS


def _server_v_readings() -> tuple[str, ...]:
    from pollen.strategies.fedlamb import SERVER_V_READINGS

    return SERVER_V_READINGS


#: LocalLAMB's weight-norm scalings (``pollen.clientside.lamb.PHIS``, which imports torch; the config is
#: checked without it, and a test keeps the two equal).
PHIS = ("identity", "clip")


KEYS = {
    "sync-every": pos_int(1),
    "sync-phase": choice(_sync_phases, "first", server_side=True),
    "round1-denominator": choice(_round1_denominators, "eps", server_side=True),
    "mime-server-v": choice(_server_v_readings, "plain", server_side=True),
    "lamb-zero-norm-guard": flag(True),
    "lamb-phi": choice(PHIS, "identity"),
    "lamb-phi-min": non_negative(0.0),
    "lamb-phi-max": positive(10.0),
}

VARIANTS = ("fed-lamb", "mime-lamb", "fed-ams", "mime", "adp-fed", "fed-sgd")

_PAPER = {
    "beta-1": 0.9,
    "beta-2": 0.999,
    "eps": 1e-8,
    "fraction-train": 0.5,
    "local-epochs": 1,
    "batch-size": 128,
    "sync-every": 1,
}

#: Fed-AMS and Mime follow the authors' code in round 1 (the client's own running v): the paper's literal
#: v_hat_0 = eps makes their plain AMSGrad step a 10^4-fold jump (spec §9 B5); run-config
#: ``round1-denominator = "eps"`` is the literal reading. The LAMB variants normalise the jump away.
_AUTHORS_ROUND1 = {"round1-denominator": "local-v"}
#: Mime's server v without bias correction (the paper's lines 22-23) makes its AMSGrad steps ~30x an Adam
#: step for the first rounds and the baseline collapses (docs/results/fedlamb-round1.md); Mime corrects it
#: by default, ``mime-server-v = "plain"`` is the paper's reading (Mime-LAMB's default).
_MIME_FAIR = {"mime-server-v": "bias-corrected"}

DEFAULTS: dict[str, Mapping[str, Any]] = {
    variant: {
        **_PAPER,
        **(_AUTHORS_ROUND1 if variant in ("fed-ams", "mime") else {}),
        **(_MIME_FAIR if variant == "mime" else {}),
    }
    for variant in VARIANTS
}


def builder(variant: str) -> Callable[[Mapping[str, Any]], Any]:
    """The run-config builder of one variant of :class:`pollen.strategies.FedLAMB`."""

    def build(cfg: Mapping[str, Any]) -> Any:
        from pollen.strategies.fedlamb import FedLAMB

        return FedLAMB(
            **adaptive_kwargs(cfg),
            variant=variant,
            beta_1=cfg["beta-1"],
            beta_2=cfg["beta-2"],
            eps=cfg["eps"],
            weight_decay=cfg["weight-decay"],
            sync_every=cfg["sync-every"],
            sync_phase=cfg["sync-phase"],
            round1_denominator=cfg["round1-denominator"],
            server_v=cfg["mime-server-v"],
            eta=cfg["server-lr"],
        )

    build.__name__ = build.__qualname__ = f"build_{variant.replace('-', '_')}"
    return build
