"""HA-Fed's clusters: formed once from the nodes' cluster ids, each with its mixing matrix, mixed in place.

:class:`ClusterPlan` is HA-Fed's rule for who trains, plugged into the engine's sampler
(``sampler.plan``): the sampler draws, the plan says from which groups.

The server relays every gossip step, so a cluster is a list of nodes and a ``W`` (:mod:`pollen.gossip`);
:func:`form_clusters` checks the layout against the topology once per run (one line if it cannot work) and
:func:`mix` applies ``x_i <- sum_j W'_ij x_j`` to the server's copies of a cluster's models, with the
absent-client rule for nodes that did not answer the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.common import log
from flwr.serverapp import Grid

from pollen.gossip import gossip_step, mixing_matrix, spectral_gap_rho, validate_clusters, without_absent
from pollen.strategies.engine.replies import ClientUpdate, ReplySpec, record_norms
from pollen.strategies.engine.rounds import SetupError

#: Topologies that need at least three clients per cluster to mean anything.
NEEDS_NEIGHBOURS = ("ring", "bipartite", "circulant", "interpolated")


@dataclass
class Cluster:
    """One cluster of a round: its nodes in a fixed order and its mixing matrix."""

    name: str
    nodes: list[int]
    w: np.ndarray


def form_clusters(  # noqa: PLR0913 - the topology's settings
    sampler: Any,
    grid: Grid,
    *,
    topology: str,
    uploaders: int,
    lam: float,
    offsets: tuple[int, ...] | None,
    gossip_steps: int,
) -> list[Cluster]:
    """Group the connected nodes into clusters by the ids they report and build their ``W``; ``SetupError``
    with one line if the layout cannot work (unequal clusters, too small for the topology, m > n)."""
    try:
        groups = sampler.clusters(grid)
    except ValueError as err:
        raise SetupError(
            f"HA-Fed needs a cluster id from every node (node-config cluster-id or run-config cluster-size): {err}"
        ) from None
    try:  # equal, non-empty clusters: the one rule of pollen.gossip
        validate_clusters({str(node): index for index, nodes in enumerate(groups.values()) for node in nodes})
    except ValueError as err:
        sizes = {name: len(nodes) for name, nodes in groups.items()}
        raise SetupError(f"HA-Fed cannot use clusters of sizes {sizes}: {err}") from None
    n = len(next(iter(groups.values())))
    if n == 1 and topology in NEEDS_NEIGHBOURS:
        raise SetupError(
            f"a cluster of one client has no neighbours for topology {topology!r}; "
            "allowed: clusters of >= 3 or topology identity/full"
        )
    if uploaders > n:
        raise SetupError(f"uploaders per cluster m={uploaders} exceeds the cluster size n={n}; allowed: 1 <= m <= n")
    try:
        w = mixing_matrix(topology, n, lam=lam, offsets=offsets)
    except ValueError as err:
        raise SetupError(f"topology {topology!r} cannot be built for clusters of {n}: {err}") from None
    clusters = [Cluster(name, nodes, w) for name, nodes in groups.items()]
    log(
        INFO,
        "HA-Fed: %d clusters of %d, topology %s, rho = %.5f, m = %d uploaders each, %d gossip steps per round",
        len(groups),
        n,
        topology,
        spectral_gap_rho(w),
        uploaders,
        gossip_steps,
    )
    return clusters


def mix(cluster: Cluster, current: dict[int, ClientUpdate], present: set[int]) -> None:
    """``x_i <- sum_j W'_ij x_j`` in place for one cluster (``W'``: the absent-client rule)."""
    mask = np.array([node in present for node in cluster.nodes])
    w = without_absent(cluster.w, mask)
    rows = [i for i, node in enumerate(cluster.nodes) if mask[i]]
    if len(rows) < 2:
        return
    nodes = [cluster.nodes[i] for i in rows]
    sub = w[np.ix_(rows, rows)]  # absent clients have zero weight in present rows
    mixed = gossip_step(sub, np.stack([current[node].delta for node in nodes]))
    names = list(current[nodes[0]].buffers)
    mixed_buffers = {
        name: gossip_step(sub, np.stack([current[node].buffers[name].astype(np.float64).reshape(-1) for node in nodes]))
        for name in names
    }
    for k, node in enumerate(nodes):
        update = current[node]
        update.delta = mixed[k]
        update.norm = float(np.sqrt(np.dot(mixed[k], mixed[k])))  # what the outlier screen judges
        for name in names:
            old = update.buffers[name]
            value = mixed_buffers[name][k].reshape(old.shape)
            update.buffers[name] = (np.rint(value) if np.issubdtype(old.dtype, np.integer) else value).astype(old.dtype)
        update.record_norms = record_norms(update, ReplySpec())  # the mixed buffers are what is judged next


def peer_bytes(clusters: list[Cluster], relayed_starts: int, model_bytes: int, steps: int) -> int:
    """Bytes the round's gossip would cost on a peer network: a model per directed edge per step."""
    if not clusters:
        return 0
    edges = sum(int(np.count_nonzero(c.w - np.diag(np.diag(c.w)))) for c in clusters)
    return model_bytes * (edges * steps + relayed_starts)


class ClusterPlan:
    """HA-Fed's rule for who trains in a round: everyone in every cluster when clusters gossip, ``m`` uploaders
    drawn per cluster (stratified), or without clusters ``fraction_train`` of all clients uniformly.

    It is the sampler's plan (``ClientSampler.plan``): :meth:`check_setup` forms the clusters once per run from
    the connected nodes, :meth:`train_nodes` picks a round's nodes with the sampler's generator and keeps the
    round's uploaders (:meth:`uploaders`) for the server step.
    """

    def __init__(  # noqa: PLR0913 - the topology's settings
        self,
        *,
        clustered: bool,
        topology: str,
        uploaders: int,
        lam: float,
        offsets: tuple[int, ...] | None,
        gossip_steps: int,
    ) -> None:
        self.clustered, self.topology, self.uploaders_per_cluster = clustered, topology, uploaders
        self.lam, self.offsets, self.gossip_steps = lam, offsets, gossip_steps
        self.clusters: list[Cluster] = []
        self._uploaders: dict[int, list[int]] = {}

    def check_setup(self, sampler: Any, grid: Grid) -> None:
        """Form the clusters (``SetupError`` with one line if the layout cannot work); nothing without clusters."""
        if self.clustered:
            self.clusters = form_clusters(
                sampler,
                grid,
                topology=self.topology,
                uploaders=self.uploaders_per_cluster,
                lam=self.lam,
                offsets=self.offsets,
                gossip_steps=self.gossip_steps,
            )

    def train_nodes(self, sampler: Any, server_round: int, grid: Grid, fraction: float, minimum: int) -> list[int]:
        """Everyone trains when clusters gossip; only the uploaders without gossip (W = I)."""
        if not self.clustered:
            self._uploaders[server_round] = sampler.sample(grid, fraction, minimum)
            return self._uploaders[server_round]
        if not self.clusters:
            self.check_setup(sampler, grid)
        connected = set(grid.get_node_ids())  # a node that left is absent for the whole round
        uploaders = []
        for cluster in self.clusters:
            members = [node for node in cluster.nodes if node in connected]
            if members:
                picked = sampler.sample_per_cluster(
                    {cluster.name: members}, min(self.uploaders_per_cluster, len(members))
                )
                uploaders += picked[cluster.name]
        self._uploaders[server_round] = sorted(uploaders)
        if self.topology == "identity":
            return self._uploaders[server_round]
        return sorted(node for cluster in self.clusters for node in cluster.nodes if node in connected)

    def uploaders(self, server_round: int) -> list[int]:
        """The nodes whose models the server step of ``server_round`` takes."""
        return self._uploaders.get(server_round, [])

    def forget(self, server_round: int) -> None:
        """Drop what ``server_round`` kept (its server step is over)."""
        self._uploaders.pop(server_round, None)

    def gossiping(self) -> list[Cluster]:
        """The clusters that gossip (none without gossip)."""
        return [] if self.topology == "identity" or not self.clustered else self.clusters
