"""FedAMS, FedAMSGrad and FedCAMS (Wang, Lin & Chen, ICML 2022): run-config keys, recommended values, builders.

Keys: the epsilon placement of the server AMSGrad (``eps-mode``, also read by HA-Fed and the lazy
family, which run the same optimiser) and its bias correction, and FedCAMS's uplink compression
(``compressor``, ``topk-ratio``, ``error-feedback``, ``compression-granularity``, also the lazy
family's uplink).

Recommended values (``papers/fedcams.md`` sections 5.1 and 7.2): beta 0.9 / 0.99, eps 1e-3 inside the
max (Option 1), no bias correction, local lr 0.01; FedAMSGrad (Option 2) takes eps 0.1 outside the
sqrt, as the paper's baseline. The server lr is 0.1: the paper's eta = 1 belongs to deep CNNs (ResNet-18,
ConvMixer; the ``fedcams-full`` preset), the spec's re-tune on a small model found 0.1, and the app's
default model is the lineage's small CNN. These are the app's pyproject defaults (FedAMS is the default
method), so a run that names no method is this family's own. FedCAMS compresses with the scaled sign
and error feedback over the whole model, top-k keeping 1/64 (the paper's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pollen.app.methods.common import adaptive_kwargs
from pollen.app.spec import choice, flag, unit_open
from pollen.compression import CODECS, GRANULARITIES
from pollen.optim import EPS_MODES as AMSGRAD_EPS_MODES

#: ``paper``: each method's own placement (FedAMS: max, HA-Fed: inside); the rest as :class:`pollen.optim.AMSGrad`.
EPS_MODES = ("paper", *AMSGRAD_EPS_MODES)

KEYS = {
    "eps-mode": choice(EPS_MODES, "paper"),
    "bias-correction": flag(False),
    "compressor": choice(CODECS, "sign"),
    "topk-ratio": unit_open(0.015625),
    "error-feedback": flag(True),
    "compression-granularity": choice(GRANULARITIES, "model"),
}

_SERVER = {
    "server-lr": 0.1,
    "beta-1": 0.9,
    "beta-2": 0.99,
    "eps": 0.001,
    "eps-mode": "paper",
    "bias-correction": False,
    "local-lr": 0.01,
}
_UPLINK = {"compressor": "sign", "topk-ratio": 0.015625, "error-feedback": True, "compression-granularity": "model"}

DEFAULTS: dict[str, Mapping[str, Any]] = {
    "fedams": _SERVER,
    "fedamsgrad": {**_SERVER, "eps": 0.1},
    "fedcams": {**_SERVER, **_UPLINK},
}


def fedams_kwargs(cfg: Mapping[str, Any], option: int | None = None, *, inside: bool = False) -> dict[str, Any]:
    """FedAMS's arguments from the run-config (``option`` from ``eps-mode`` unless given); ``inside`` allows
    ``eps-mode = inside`` (Option 3, the lazy family's Option B)."""
    if cfg["eps-mode"] == "inside" and not inside:
        raise ValueError(
            "run-config 'eps-mode' = 'inside' is HA-Fed's and the lazy family's form; FedAMS and FedCAMS allow "
            "paper, max or add"
        )
    by_mode = {"add": 2, "inside": 3}
    return dict(
        **adaptive_kwargs(cfg),
        eta=cfg["server-lr"],
        beta_1=cfg["beta-1"],
        beta_2=cfg["beta-2"],
        eps=cfg["eps"],
        option=option or by_mode.get(cfg["eps-mode"], 1),
        bias_correction=cfg["bias-correction"],
    )


def uplink_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """FedCAMS's uplink compression from the run-config."""
    return dict(
        compressor=cfg["compressor"],
        topk_ratio=cfg["topk-ratio"],
        error_feedback=cfg["error-feedback"],
        granularity=cfg["compression-granularity"],
    )


def build_fedams(cfg: Mapping[str, Any]) -> Any:
    """FedAMS, Option 1 unless ``eps-mode`` = ``add`` (``paper`` and ``max`` are Option 1)."""
    from pollen.strategies.fedams import FedAMS

    return FedAMS(**fedams_kwargs(cfg))


def build_fedamsgrad(cfg: Mapping[str, Any]) -> Any:
    """FedAMSGrad: FedAMS with Option 2 (eps outside the sqrt)."""
    from pollen.strategies.fedams import FedAMS

    return FedAMS(**fedams_kwargs(cfg, option=2))


def build_fedcams(cfg: Mapping[str, Any]) -> Any:
    """FedCAMS: FedAMS with error-feedback-compressed uploads."""
    from pollen.strategies.fedcams import FedCAMS

    return FedCAMS(**fedams_kwargs(cfg), **uplink_kwargs(cfg))


def uplink_codec(cfg: Mapping[str, Any]) -> str:
    """FedCAMS's uplink codec, from its run-config."""
    return str(cfg.get("compressor", ""))
