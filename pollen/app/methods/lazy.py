"""The lazy / accelerated family (FedNLAA, FedAA, FedNLACA, FedACA, FedBNLACA, FedBACA): keys, values, builders.

Keys: the thresholds of the lazy (NLA) or accelerated (AA) rule each way (``tau-up``, ``tau-down``; 0
never fires; effective thresholds, or with ``tau-scaling = paper`` the paper's C and D scaled each round
by ``1 / (tau-alpha |S_t|)``), the downlink codec of the bidirectional methods (``compressor-down``,
``topk-ratio-down``), the readings the spec leaves open (``downlink-mode``, ``ef-mode``, ``ref-mode``)
and where the per-client copies live (``bookkeeping-dir``). The uplink codec is FedCAMS's
(:mod:`pollen.app.methods.fedams`).

Recommended values (``papers/fedbaca.md`` section 12, the paper's setting with the FedCAMS lineage's
gaps filled): 3 local epochs of batch 32 at lr 0.01, server FedAMS (Option A, ``eps-mode`` = ``paper``:
eps 1e-3 as a floor) at lr 0.1 with beta 0.9 / 0.99 and no bias correction, top-k 1/8 with applied error
feedback each way; ``eps-mode = inside`` is the paper's Option B (``m / sqrt(v_hat + eps)``). The paper
gives no thresholds (its C, D and alpha do not recover them): each method's defaults (:data:`TAUS`) are
the spec's calibrated ones for its default codec, and the ``fedbaca-*`` presets carry the ones
calibrated on the CNN.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pollen.app.methods.fedams import fedams_kwargs
from pollen.app.spec import choice, non_negative, positive, text, unit_open
from pollen.compression import CODECS
from pollen.lazy.rules import DOWNLINK_MODES, EF_MODES, REF_MODES, TAU_SCALINGS

KEYS = {
    "tau-up": non_negative(0.0),
    "tau-down": non_negative(0.0),
    "compressor-down": choice(CODECS, "topk"),
    "topk-ratio-down": unit_open(0.125),
    "downlink-mode": choice(DOWNLINK_MODES, "increment"),
    "ef-mode": choice(EF_MODES, "applied"),
    "ref-mode": choice(REF_MODES, "last-transmitted"),
    "bookkeeping-dir": text(""),
    "tau-scaling": choice(TAU_SCALINGS, "effective", server_side=True),
    "tau-alpha": positive(1.0),
}

#: The six methods: (uplink rule, compressed uplink, bidirectional).
SHAPES = {
    "fednlaa": ("nla", False, False),
    "fedaa": ("aa", False, False),
    "fednlaca": ("nla", True, False),
    "fedaca": ("aa", True, False),
    "fedbnlaca": ("nla", True, True),
    "fedbaca": ("aa", True, True),
}

_PAPER = {
    "local-epochs": 3,
    "batch-size": 32,
    "local-lr": 0.01,
    "server-lr": 0.1,
    "beta-1": 0.9,
    "beta-2": 0.99,
    "eps": 0.001,
    "bias-correction": False,
    "ef-mode": "applied",
    "ref-mode": "last-transmitted",
    "downlink-mode": "increment",
}
_UP = {"compressor": "topk", "topk-ratio": 0.125, "error-feedback": True, "compression-granularity": "model"}
_DOWN = {"compressor-down": "topk", "topk-ratio-down": 0.125}


#: Thresholds that make each method do what its name says with its default codec. The relative change a rule
#: compares with tau, measured at threshold 0 (``docs/results/lazy.md``, ``bench_lazy_quality.py --rel``, seed
#: 1; the spec's numpy calibration, ``papers/fedbaca.md`` §9, agrees for the uncompressed and downlink cases):
#: uncompressed uploads change by 0.31-0.89 (10%-90%, MLP; CNN 0.38-0.83), so 0.5 fires in about 30% of
#: uploads in a run (NLA cost 1.8-4.5 points, AA within the spread); top-k 1/8 with error feedback by
#: 1.19-1.33 (MLP; CNN 1.29-1.40), so the spec's 1.1 never fires in pollen's runs (skip 0.2%) and 1.3 is
#: the lowest threshold that fires on both models (first decisions: MLP 79%, CNN 10%; its accuracy in a run
#: is not measured yet); downlink increments at 1/8 change by 0.17-2.27, so 0.65 skips or merges 20-30%.
#: The paper gives none (its C, D and alpha are unrecoverable); presets and users set others.
TAUS = {
    "fednlaa": {"tau-up": 0.5},
    "fedaa": {"tau-up": 0.5},
    "fednlaca": {"tau-up": 1.3},
    "fedaca": {"tau-up": 1.3},
    "fedbnlaca": {"tau-up": 1.3, "tau-down": 0.65},
    "fedbaca": {"tau-up": 1.3, "tau-down": 0.65},
}


def _recommended(method: str) -> dict[str, Any]:
    _, compressed, bidirectional = SHAPES[method]
    return {**_PAPER, **(_UP if compressed else {}), **(_DOWN if bidirectional else {}), **TAUS[method]}


DEFAULTS: dict[str, Mapping[str, Any]] = {method: _recommended(method) for method in SHAPES}


def builder(method: str) -> Callable[[Mapping[str, Any]], Any]:
    """The run-config builder of one of the six methods."""
    up_rule, compressed, bidirectional = SHAPES[method]

    def build(cfg: Mapping[str, Any]) -> Any:
        from pollen.strategies.lazy import FedLazy

        if compressed and cfg["compressor"] == "none":
            dense = {"fednlaca": "fednlaa", "fedaca": "fedaa"}.get(method, "fedams")
            raise ValueError(
                f"strategy '{method}' compresses its uploads: run-config 'compressor' must be one of "
                f"{', '.join(c for c in CODECS if c != 'none')} (uncompressed, it is '{dense}')"
            )
        return FedLazy(
            **fedams_kwargs(cfg, inside=True),
            up_rule=up_rule,
            up_tau=cfg["tau-up"],
            compressor=cfg["compressor"] if compressed else "none",
            topk_ratio=cfg["topk-ratio"],
            error_feedback=cfg["error-feedback"],
            granularity=cfg["compression-granularity"],
            down_compressor=cfg["compressor-down"] if bidirectional else None,
            down_rule=up_rule if bidirectional else "none",
            down_tau=cfg["tau-down"],
            down_topk_ratio=cfg["topk-ratio-down"],
            downlink_mode=cfg["downlink-mode"],
            ef_mode=cfg["ef-mode"],
            ref_mode=cfg["ref-mode"],
            bookkeeping_dir=cfg["bookkeeping-dir"] or None,
            tau_scaling=cfg["tau-scaling"],
            tau_alpha=cfg["tau-alpha"],
        )

    build.__name__ = build.__qualname__ = f"build_{method}"
    return build


def codecs(method: str) -> Callable[[Mapping[str, Any]], str]:
    """The codecs of one of the six methods in words, from a run's config (``-`` when it sends dense updates)."""
    _, compressed, bidirectional = SHAPES[method]

    def words(cfg: Mapping[str, Any]) -> str:
        if not compressed:
            return "-"
        up = str(cfg.get("compressor", ""))
        return f"{up} / down {cfg.get('compressor-down', '')}" if bidirectional else up

    return words
