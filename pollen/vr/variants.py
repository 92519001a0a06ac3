"""FedAdaVR, its ablations and its table-based baselines as configurations of one aggregate.

Every method below is "aggregate with :func:`pollen.vr.vr_aggregate` (optionally with an
:class:`pollen.vr.UpdateTable`), then step a server optimiser". A variant fixes

* ``weighting``: the ``vr_aggregate`` weighting (``"none"`` = no variance reduction);
* ``equal_weights``: if True pass ``weights=None`` to both ``vr_aggregate`` and ``replace_many`` (every client
  weight 1: ``1/M`` over the sampled, ``1/N`` over the table); if False pass ``num_examples``;
* ``uses_table`` and the default table ``precision``;
* ``optimizer``: the name (a key of ``pollen.optim.BY_NAME``) for ``pollen.optim.make_server_optimizer`` the
  lead should pair it with, and ``server_lr``: its default learning rate eta_s (``FedAdaVR(eta=...)``, run-config
  ``server-lr``; the paper's grid is in ``note``).

``"sgd"`` below is ``pollen.optim.sgd`` (``make_server_optimizer("sgd", eta=server_lr)``, momentum 0): the
plain step ``x <- x + server_lr * delta``. The others take ``eta=server_lr`` too. The spec: section
3.8 (ablations), 3.9 (baselines), 8 (checklist).
"""

from __future__ import annotations

from dataclasses import dataclass

from pollen.compression.quant import check_precision
from pollen.vr.aggregate import check_weighting


@dataclass(frozen=True)
class VRVariant:
    """One method expressed as a configuration of the VR aggregate plus a server optimiser."""

    name: str
    weighting: str
    equal_weights: bool
    uses_table: bool
    precision: str
    optimizer: str
    server_lr: float | None
    note: str

    def __post_init__(self) -> None:
        check_weighting(self.weighting)
        check_precision(self.precision)


VARIANTS: dict[str, VRVariant] = {
    v.name: v
    for v in (
        VRVariant(
            name="fedadavr",
            weighting="sampled-normalised",
            equal_weights=False,
            uses_table=True,
            precision="fp32",
            optimizer="adam",
            server_lr=0.01,
            note="FedAdaVR (Alg. 2): SAGA table + adaptive server optimiser, any of adagrad | adam | adabelief | "
            "yogi | lamb with the paper's settings (beta_1 0.9, beta_2 0.999, eps 1e-8 outside the sqrt, bias "
            "correction by round count); eta_s in {0.001, 0.005, 0.01}.",
        ),
        VRVariant(
            name="fedadavr-quant",
            weighting="sampled-normalised",
            equal_weights=False,
            uses_table=True,
            precision="fp16",
            optimizer="adam",
            server_lr=0.01,
            note="FedAdaVR-Quant (Eq. 5/7): as fedadavr with the table stored in fp16 (the paper's default) "
            "or int8 / int4; the aggregate always works on dequantised float32.",
        ),
        VRVariant(
            name="fedvarp",
            weighting="sampled-normalised",
            equal_weights=True,
            uses_table=True,
            precision="fp32",
            optimizer="sgd",
            server_lr=1.0,
            note="FedVARP (Jhunjhunwala et al. 2022): 1/M sum_S (y_i - y_i_old) + 1/N sum_j y_j, fixed server "
            "learning rate: x <- x + eta_s * eta_c * v; eta_s in {0.01, 0.1, 1.0} (1.0 best in most cells).",
        ),
        VRVariant(
            name="mifa",
            weighting="literal",
            equal_weights=True,
            uses_table=True,
            precision="fp32",
            optimizer="sgd",
            server_lr=1.0,
            note="MIFA (Gu et al. 2021) with zero-initialised memory: 1/N sum_j y_j after replacement (SAG, "
            "= literal Eq. 6 with equal weights); x <- x + eta_c * that (server lr 1).",
        ),
        VRVariant(
            name="novr",
            weighting="none",
            equal_weights=False,
            uses_table=False,
            precision="fp32",
            optimizer="adagrad",
            server_lr=0.01,
            note="FedAdaVR-NoVR ablation (App. E): FedAvg's aggregate eta_c sum_S q_i y_i fed to the paper's "
            "Adagrad (no momentum, eps 1e-8); no table.",
        ),
        VRVariant(
            name="noopt",
            weighting="sampled-normalised",
            equal_weights=False,
            uses_table=True,
            precision="fp32",
            optimizer="sgd",
            server_lr=0.01,
            note="FedAdaVR-NoOPT ablation (App. E): the VR aggregate with a plain step x <- x + eta_s * G "
            "(FedVARP with data-size weights and server lr eta_s; the ablation uses eta_s = 0.01).",
        ),
    )
}
"""The named configurations; keys are the run-config method names."""


def get_variant(name: str) -> VRVariant:
    """Look up a variant by name, or raise ``ValueError`` naming the allowed ones."""
    if name not in VARIANTS:
        raise ValueError(f"vr variant {name!r} is not known; allowed: {', '.join(VARIANTS)}")
    return VARIANTS[name]


__all__ = ["VARIANTS", "VRVariant", "get_variant"]
