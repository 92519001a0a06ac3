"""Who takes part in a round: seeded client sampling keyed by stable client ids, per cluster if asked.

Flower's node ids change when a SuperNode reconnects and differ between runs, so sampling by node id
is neither reproducible nor fair across reconnects. :class:`ClientSampler` asks each new node once for
its stable client id (pollen's ClientApp answers ``query.pollen_identify`` with node-config
``client-id``, else ``partition-<id>``, and optionally a ``cluster-id``), orders the connected nodes by
that id and draws from its own seeded generator. Its state (generator, known ids) is saved and loaded
with the strategy, so a resumed run samples the same clients as an uninterrupted one.

**Population mode** (``population`` = N > 0, run-config ``population``): the clients are N logical ones,
``partition-0`` .. ``partition-<N-1>``, known from the start (no identity round), and the connected nodes
are the workers that play them. Each round draws its clients from the N, exactly as the node mode draws
from N identified nodes (the same order by client id, the same generator), and binds them one to one to
connected nodes for that round; each message then names the partition its node plays
(:data:`pollen.wire.protocol.CFG_PARTITION`). A simulation of 10,000 clients then needs only as many
simulated SuperNodes as a round samples: Flower's simulation engine scans every node's queue each sweep, so
its cost grows with the number of nodes, not with the population.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from pollen.core import state_fields as fields
from pollen.wire import protocol

IDENTIFY_TIMEOUT_S = 60.0
MAX_CLIENT_ID_LENGTH = 256


class ClientSampler:
    """Seeded sampling over the connected nodes, ordered by their stable client ids.

    Parameters
    ----------
    seed : int
        Seed of the sampling generator.
    min_available_nodes : int | None
        Nodes that must be connected before a round samples; ``None``: the strategy's ``min_available_nodes``
        (Flower's argument; 0 when the sampler is used on its own).
    identify_clients : bool
        Ask new nodes for their client id (and cluster id) with ``query.pollen_identify``. Nodes that
        cannot answer are keyed ``node-<id>``.
    population : int
        0: one client per connected node. N > 0: N logical clients played by the connected nodes, bound
        anew each time clients are sampled (module docstring); no identity round.
    identify_batch : int (default: 8)
        New nodes asked for their identity at once: each query starts a ClientApp on its SuperNode, and on a
        small machine forty of them starting together (each importing torch) outlast Flower's start-up
        timeout; in batches, at most this many start at a time.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        min_available_nodes: int | None = None,
        identify_clients: bool = False,
        population: int = 0,
        identify_batch: int = 8,
    ) -> None:
        if isinstance(population, bool) or not isinstance(population, int) or population < 0:
            raise ValueError(
                f"population={population!r} is invalid; allowed: 0 (one client per node) or an integer > 0"
            )
        if isinstance(identify_batch, bool) or not isinstance(identify_batch, int) or identify_batch < 1:
            raise ValueError(f"identify_batch={identify_batch!r} is invalid; allowed: an integer >= 1")
        self.identify_batch = identify_batch
        self.seed = seed
        self.min_available_nodes = min_available_nodes
        self.identify_clients = identify_clients
        self.population = population
        self.rng = np.random.default_rng(seed)
        #: ``(population, sample size)`` of the last round's uniform train draw (what central DP's accountant
        #: checks); ``None`` when a plan chose (HA-Fed's clusters).
        self.last_draw: tuple[int, int] | None = None
        self._drawn: tuple[int, int] | None = None
        #: A method's own rule for who trains (HA-Fed's clusters: ``train_nodes`` and ``check_setup``);
        #: ``None``: ``fraction_train`` of the clients, uniformly.
        self.plan: Any = None
        self.node_keys: dict[int, str] = {}
        self.node_clusters: dict[int, str] = {}
        self.known_clients: set[str] = {protocol.partition_client_id(i) for i in range(population)}
        # Population mode: the partitions in client-id order (as the node mode orders identified nodes), and
        # the partition each node plays in the current binding.
        self._population_order: np.ndarray | None = None
        self.node_partitions: dict[int, int] = {}
        # The last connected node list and its order by client id: reused while neither changes (sorting
        # 100,000 nodes by a Python key each round was most of a round's server time).
        self._ordered: tuple[list[int], list[int]] | None = None

    # ------------------------------------------------------------------ identity
    def key(self, node: int) -> str:
        """The stable client id of ``node`` (``node-<id>`` until it is known)."""
        return self.node_keys.get(node, f"node-{node}")

    def cluster(self, node: int) -> str | None:
        """The cluster id ``node`` reported, or ``None``."""
        return self.node_clusters.get(node)

    def wait_for_nodes(self, grid: Grid, needed: int) -> list[int]:
        """The connected node ids, once at least ``needed`` are connected."""
        while len(nodes := sorted(grid.get_node_ids())) < needed:
            log(INFO, "Waiting for nodes to connect: %d connected (minimum required: %d).", len(nodes), needed)
            time.sleep(1.0)
        return nodes

    def partition(self, node: int) -> int | None:
        """The partition ``node`` plays in the current binding (population mode), else ``None``."""
        return self.node_partitions.get(node)

    def identify(self, grid: Grid, nodes: Iterable[int]) -> None:
        """Ask nodes seen for the first time for their stable client id (and cluster id)."""
        if self.population:
            return  # the clients are the population's, not the nodes'
        connected = set(nodes)
        unknown = sorted(node for node in connected if node not in self.node_keys)
        if not unknown:
            return
        self._ordered = None  # keys change below
        if self.identify_clients:
            replies = {}
            for start in range(0, len(unknown), self.identify_batch):  # a few ClientApps starting at a time
                queries = [
                    Message(content=RecordDict(), message_type=protocol.QUERY_IDENTIFY, dst_node_id=node)
                    for node in unknown[start : start + self.identify_batch]
                ]
                replies.update(
                    (reply.metadata.src_node_id, reply)
                    for reply in grid.send_and_receive(queries, timeout=IDENTIFY_TIMEOUT_S)
                )
            holders: dict[str, list[int]] = {}  # client id -> nodes keyed by it (one pass, not one per node)
            for other, key in self.node_keys.items():
                holders.setdefault(key, []).append(other)
            for node in unknown:  # in node order, so which of two claimants wins does not depend on timing
                if node in replies:
                    self._note_identity(node, replies[node], connected, holders)
        for node in unknown:
            self.node_keys.setdefault(node, f"node-{node}")
            self.known_clients.add(self.node_keys[node])

    def _note_identity(self, node: int, reply: Message, connected: set[int], holders_of: dict[str, list[int]]) -> None:
        """Key ``node`` by the client id its reply claims, unless a connected node holds it; ``holders_of``
        (client id -> nodes keyed by it) is kept up to date."""
        if reply.has_error() or protocol.IDENTITY_RECORD not in reply.content.config_records:
            return
        record = reply.content.config_records[protocol.IDENTITY_RECORD]
        client_id = record.get(protocol.IDENTITY_CLIENT_ID)
        if not (isinstance(client_id, str) and client_id) or len(client_id) > MAX_CLIENT_ID_LENGTH:
            return
        holders = [other for other in holders_of.get(client_id, ()) if other != node]
        if any(other in connected for other in holders):
            log(
                WARNING,
                "\t> node %d claims client id %r, held by connected node %d; it is keyed node-%d",
                node,
                client_id,
                holders[0],
                node,
            )
            return
        for other in holders:  # the same client came back under a new node id (a SuperNode reconnected)
            del self.node_keys[other]
            self.node_clusters.pop(other, None)
        self.node_keys[node] = client_id
        holders_of[client_id] = [node]
        cluster = record.get(protocol.IDENTITY_CLUSTER_ID)
        if isinstance(cluster, str) and len(cluster) > MAX_CLIENT_ID_LENGTH:
            log(WARNING, "\t> node %d reports a cluster id of %d characters (at most %d); it has none", node,
                len(cluster), MAX_CLIENT_ID_LENGTH)  # fmt: skip
        elif isinstance(cluster, str) and cluster:
            self.node_clusters[node] = cluster

    # ------------------------------------------------------------------ sampling
    def connected(self, grid: Grid, minimum: int = 0) -> list[int]:
        """Connected nodes (waiting for enough), identified and ordered by client id."""
        nodes = self.wait_for_nodes(grid, max(self.min_available_nodes or 0, minimum))
        self.identify(grid, nodes)
        if self._ordered is None or self._ordered[0] != nodes:
            self._ordered = (nodes, sorted(nodes, key=lambda node: (self.key(node), node)))
        return list(self._ordered[1])

    def train_nodes(self, server_round: int, grid: Grid, fraction: float, minimum: int) -> list[int]:
        """The nodes that train in ``server_round``: the plan's, or ``fraction`` of them uniformly (:meth:`sample`)."""
        self.last_draw = None
        if self.plan is not None:
            return self.plan.train_nodes(self, server_round, grid, fraction, minimum)
        nodes = self.sample(grid, fraction, minimum)
        self.last_draw = self._drawn
        return nodes

    def check_setup(self, grid: Grid) -> None:
        """Check what the plan needs of the connected nodes before a run's first round (``SetupError``)."""
        if self.plan is not None:
            self.plan.check_setup(self, grid)

    def sample(self, grid: Grid, fraction: float, minimum: int) -> list[int]:
        """``max(floor(fraction * n), minimum)`` nodes (at most all), uniformly without replacement.

        ``n`` is the number of connected nodes, or the population in population mode, where the sampled
        clients are bound to connected nodes (:meth:`bind`) and those nodes are returned.
        """
        if self.population:
            size = self.sample_size(fraction, minimum)
            picks = self.rng.choice(self.population, size=size, replace=False)
            self._drawn = (self.population, size)
            return self.bind(grid, [int(self._order()[i]) for i in sorted(picks)])
        ordered = self.connected(grid, minimum)
        size = min(max(int(len(ordered) * fraction), minimum), len(ordered))
        picks = self.rng.choice(len(ordered), size=size, replace=False)
        self._drawn = (len(ordered), size)
        return [ordered[i] for i in sorted(picks)]

    def sample_size(self, fraction: float, minimum: int) -> int:
        """How many clients :meth:`sample` draws in population mode: ``max(floor(fraction * N), minimum)``, at
        most N."""
        return min(max(int(self.population * fraction), minimum), self.population)

    def _order(self) -> np.ndarray:
        """The population's partitions ordered by client id (``partition-10`` before ``partition-2``, as the
        node mode orders identified nodes), so both modes draw the same clients from one seed."""
        if self._population_order is None:
            ids = np.array([protocol.partition_client_id(i) for i in range(self.population)])
            self._population_order = np.argsort(ids, kind="stable")
        return self._population_order

    def bind(self, grid: Grid, partitions: list[int]) -> list[int]:
        """Bind ``partitions`` (in this order) one to one to connected nodes for the current round; their nodes.

        The lowest node ids play the partitions, in order; every earlier binding is dropped, so a node's
        key is the client it plays now. Waits, as the node mode does, until a node per client is connected (the
        ServerApp refuses before round 1 a run that can never have them).
        """
        nodes = self.wait_for_nodes(grid, len(partitions))
        chosen = nodes[: len(partitions)]
        self.node_partitions = dict(zip(chosen, partitions, strict=True))
        self.node_keys = {node: protocol.partition_client_id(part) for node, part in self.node_partitions.items()}
        self._ordered = None
        return chosen

    def clusters(self, grid: Grid, minimum: int = 0) -> dict[str, list[int]]:
        """Connected nodes grouped by the cluster id they reported, each group ordered by client id."""
        if self.population:
            raise ValueError(
                "population mode binds clients to nodes per round, so nodes have no clusters; allowed: population=0 "
                "(one node per client) for clustered sampling"
            )
        groups: dict[str, list[int]] = {}
        for node in self.connected(grid, minimum):
            cluster = self.cluster(node)
            if cluster is None:
                raise ValueError(f"{self.key(node)} (node {node}) reported no cluster id; every node needs one")
            groups.setdefault(cluster, []).append(node)
        return dict(sorted(groups.items()))

    def sample_per_cluster(self, groups: dict[str, list[int]], per_cluster: int) -> dict[str, list[int]]:
        """Stratified sampling: ``per_cluster`` nodes from every cluster, without replacement."""
        picked = {}
        for cluster, members in groups.items():
            if per_cluster > len(members):
                raise ValueError(f"cannot sample {per_cluster} nodes from cluster {cluster!r} of {len(members)}")
            picks = self.rng.choice(len(members), size=per_cluster, replace=False)
            picked[cluster] = [members[i] for i in sorted(picks)]
        return picked

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Generator state and the identities seen (node id -> client id and cluster id).

        In population mode the known clients are the population's (not written) and ``node_keys`` is the
        last binding.
        """
        state = {
            "seed": self.seed,
            "rng": self.rng.bit_generator.state,
            "known_clients": [] if self.population else sorted(self.known_clients),
            "node_keys": {str(node): key for node, key in self.node_keys.items()},
            "node_clusters": {str(node): cluster for node, cluster in self.node_clusters.items()},
        }
        if self.population:
            state["population"] = self.population
        return state

    def load_state_dict(self, state: dict[str, Any], where: str = "sampler") -> None:
        """Restore what :meth:`state_dict` wrote (see :meth:`prepare_load`); nothing changes when it is refused.

        Node ids of a previous run that are not connected now are harmless: sampling only looks at
        connected nodes, and a client that comes back under a new node id is identified again.
        """
        self.prepare_load(state, where)()

    def prepare_load(self, state: Any, where: str = "sampler") -> Callable[[], None]:
        """Check a saved sampler state and return what makes it this sampler's.

        The generator state must be a well-formed PCG64 state, the seed a whole number, every id a
        non-empty string of at most :data:`MAX_CLIENT_ID_LENGTH` characters, the node -> client id map
        one to one (two nodes holding one client id would sample that client twice) and every node's
        cluster a node the map knows.
        """
        keys = ("seed", "rng", "known_clients", "node_keys", "node_clusters")
        fields.mapping(state, where, keys=(*keys, "population") if self.population else keys)
        if self.population:
            saved = fields.whole(state["population"], fields.join(where, "population"), high=2**63 - 1)
            if saved != self.population:
                raise fields.StateError(
                    fields.join(where, "population"), f"is {saved}; expected {self.population} (this run's population)"
                )
        seed = fields.whole(state["seed"], fields.join(where, "seed"), high=2**64 - 1)
        if seed != self.seed:
            raise fields.StateError(fields.join(where, "seed"), f"is {seed}; expected {self.seed} (the run's seed)")
        rng_state = fields.bit_generator_state(state["rng"], fields.join(where, "rng"))
        known_where = fields.join(where, "known_clients")
        known = {
            fields.text(key, fields.join(known_where, i), most=MAX_CLIENT_ID_LENGTH)
            for i, key in enumerate(fields.sequence(state["known_clients"], known_where))
        }
        if self.population:
            if known:
                raise fields.StateError(
                    known_where, "lists clients; expected [] (a population run's clients are its population's)"
                )
            known = self.known_clients
        node_keys = fields.one_to_one(state["node_keys"], fields.join(where, "node_keys"), most=MAX_CLIENT_ID_LENGTH)
        strangers = sorted(set(node_keys.values()) - known)
        if strangers:
            raise fields.StateError(known_where, f"lacks client id {strangers[0]!r} of 'node_keys'")
        clusters_where = fields.join(where, "node_clusters")
        clusters = fields.mapping(state["node_clusters"], clusters_where)
        node_clusters = {}
        for node, cluster in clusters.items():
            name = fields.join(clusters_where, node)
            if not (node.isascii() and node.isdigit()) or int(node) not in node_keys:
                raise fields.StateError(name, "is the cluster of a node 'node_keys' does not know")
            node_clusters[int(node)] = fields.text(cluster, name, most=MAX_CLIENT_ID_LENGTH)
        rng = np.random.Generator(getattr(np.random, rng_state["bit_generator"])())
        try:
            rng.bit_generator.state = rng_state
        except (TypeError, ValueError) as err:
            raise fields.StateError(fields.join(where, "rng"), f"is not a usable generator state ({err})") from None

        partitions = (
            {node: protocol.partition_of_client_id(key) for node, key in node_keys.items()} if self.population else {}
        )

        def commit() -> None:
            self.seed = seed
            self.rng = rng
            self.known_clients = known
            self.node_keys = node_keys
            self.node_clusters = node_clusters
            self.node_partitions = partitions
            self._ordered = None

        return commit
