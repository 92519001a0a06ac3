"""HA-Fed and its FedAMSGrad baselines (stratified, uniform): run-config keys, recommended values, builders.

Keys: the clusters (``cluster-size``: in simulation client i is in cluster i // n; node-config
``cluster-id`` wins), each cluster's gossip (``topology``, ``gossip-lambda``, ``gossip-offsets``,
``gossip-every``, ``active-prob``) and the uploaders per cluster (``uploaders-per-cluster``). The
number of local iterations tau is run-config ``local-steps``; 0 (the app's "epochs" default) means the
paper's tau = 48.

Recommended values (``papers/hafed.md`` sections 5.1 and 9, the Fashion-MNIST CNN row of Table 1):
server AMSGrad lr 0.01 with beta 0.9 / 0.99 and eps 1e-8 inside the sqrt (``eps-mode`` = ``paper``),
no bias correction; local SGD at 0.1 with batch 50, no momentum, no weight decay; a ring in each
cluster, a gossip after every iteration, m = 2 uploaders per cluster. The FedAMSGrad baselines use the
same rates (the paper's CNN row gives both 0.01); the uniform one samples p = 1/4 of all clients.

One value is not the paper's: clusters of ``DEFAULT_CLUSTER_SIZE`` = 5 (the paper has 32 clients in 4
clusters of 8, which the ``hafed-*`` presets set). Clusters must tile the clients, and 5 tiles the 10
simulated SuperNodes of the README's main job (2 rings of 5; 20 and 100 too), so ``strategy=hafed`` runs
there with no other key. Another number of clients needs a ``cluster-size`` that divides it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pollen.app.methods.common import adaptive_kwargs
from pollen.app.spec import Key, choice, non_neg_int, pos_int, unit_closed, unit_open
from pollen.gossip import TOPOLOGIES

#: The paper's local iterations per round (section 9), used when run-config ``local-steps`` is 0.
PAPER_TAU = 48

#: The clustered methods' cluster size when none is given: a ring of 5 holds m = 2 uploaders, and 5
#: divides the 10 SuperNodes the README's main job simulates (module docstring).
DEFAULT_CLUSTER_SIZE = 5


def _offsets_ok(text: str) -> bool:
    return all(part.strip().isdigit() for part in text.split(",")) if text.strip() else True


KEYS = {
    "cluster-size": non_neg_int(0),
    "topology": choice(TOPOLOGIES, "ring"),
    "gossip-every": pos_int(1),
    "active-prob": unit_open(1.0),
    "gossip-lambda": unit_closed(1.0),
    "gossip-offsets": Key(str, "1,3", _offsets_ok, 'comma-separated positive integers, e.g. "1,3" (or empty)'),
    "uploaders-per-cluster": pos_int(2),
}

_PAPER = {
    "server-lr": 0.01,
    "beta-1": 0.9,
    "beta-2": 0.99,
    "eps": 1e-8,
    "eps-mode": "paper",
    "bias-correction": False,
    "local-lr": 0.1,
    "batch-size": 50,
    "momentum": 0.0,
    "weight-decay": 0.0,
}

DEFAULTS: dict[str, Mapping[str, Any]] = {
    "hafed": {
        **_PAPER,
        "cluster-size": DEFAULT_CLUSTER_SIZE,
        "topology": "ring",
        "gossip-every": 1,
        "uploaders-per-cluster": 2,
    },
    "fedamsgrad-stratified": {**_PAPER, "cluster-size": DEFAULT_CLUSTER_SIZE, "uploaders-per-cluster": 2},
    "fedamsgrad-uniform": {**_PAPER, "fraction-train": 0.25},
}


def builder(topology: str | None, clustered: bool) -> Callable[[Mapping[str, Any]], Any]:
    """A builder of HA-Fed (``topology=None``: the run-config's) or of one of its baselines."""

    def build(cfg: Mapping[str, Any]) -> Any:
        from pollen.strategies.hafed import HAFed

        mode = cfg["eps-mode"]
        offsets = tuple(int(o) for o in str(cfg["gossip-offsets"]).split(",") if o.strip())
        chosen = topology or cfg["topology"]
        return HAFed(
            **adaptive_kwargs(cfg),
            eta=cfg["server-lr"],
            beta_1=cfg["beta-1"],
            beta_2=cfg["beta-2"],
            eps=cfg["eps"],
            eps_mode="inside" if mode == "paper" else mode,
            bias_correction=cfg["bias-correction"],
            local_steps=cfg["local-steps"] or PAPER_TAU,  # 0 (the app's "epochs" default): the paper's tau
            gossip_every=cfg["gossip-every"],
            active_prob=cfg["active-prob"],
            topology=chosen,
            lam=cfg["gossip-lambda"] if chosen == "interpolated" else None,
            offsets=offsets if chosen == "circulant" else None,
            uploaders_per_cluster=cfg["uploaders-per-cluster"],
            clustered=clustered,
        )

    return build


build_hafed = builder(None, clustered=True)
build_fedamsgrad_stratified = builder("identity", clustered=True)
build_fedamsgrad_uniform = builder("identity", clustered=False)
