"""HA-Fed: clients in clusters gossip during local training; server AMSGrad (spec ``papers/hafed.md``).

Round t (Algorithms 1 and 2, §3.2-3.4):

1. every client of every cluster receives ``x_t`` (the train message) and runs the first segment
   of its ``tau`` local SGD iterations (a segment ends with a gossip step: after every
   ``gossip_every`` iterations and always after the last one; §3.6 for ``gossip_every > 1``);
2. **gossip, relayed**: Flower's transport is a star, so peers never talk to each other. Each
   client uploads its half-step model ``x_i^{1/2}``; the server mixes every cluster,
   ``x_i <- sum_j (W_k)_ij x_j^{1/2}``, and sends each client its own mixed model in a
   ``hafed-gossip`` message (:meth:`exchange`), which starts the next segment. One model up and
   one down per client and gossip step: the cheapest a star allows (forwarding the neighbours'
   models instead would cost a ring two models down per step);
3. after the last segment's mixing the server holds every client's ``x^i_{t,tau}``; the ``m``
   uploaders per cluster (sampled without replacement, stratified; all clients trained) give
   ``Delta_t = mean_i (x^i_{t,tau} - x_t)`` (uniform, §8 A6);
4. server AMSGrad: ``m, v`` as Adam, ``v_hat = max(v_hat, v)``, ``x += eta m / sqrt(v_hat + eps)``
   (eps inside the sqrt, no bias correction: eq. 3.2; ``eps_mode`` switches the placement).

**A client that misses a gossip step** (an error reply, a rejected reply: malformed, non-finite, or
a move more than ``outlier-factor`` times the median of the step's other moves; clients idle for
the whole segment, whose move is float round-off, are left out of that median) does not stop the
round: for that step its cluster mixes with :func:`pollen.gossip.without_absent` (the weight the
others gave it moves onto their own diagonal, so ``W`` stays doubly stochastic and the cluster mean is
kept); the server keeps its last model for it and sends it that model again with the next step, so a
transient failure costs it one step. A client that does not answer at all within the step's share of
the round timeout (``timeout / number of gossip steps``) is not asked again in that round, and a node
that is no longer connected is not asked at all. An uploader that misses the last step does not upload.

**Baselines on the same path**: ``topology="identity"`` (no gossip) trains only the uploaders,
in one message per round (mixing with ``I`` changes nothing): with ``clustered=True`` this is
FedAMSGrad with stratified sampling (spec's control), with ``clustered=False`` FedAMSGrad with
``fraction_train`` of all clients uniformly (the paper's 8 of 32).

Accounting per round (results, round log): bytes that crossed the SuperLink each way (``uplink`` /
``downlink``, by record and phase), ``relayed_bytes`` (the gossip's share of them: every
``hafed-gossip`` message and reply and the first segment's uploads), ``peer_bytes`` (what the same
gossip would have cost on a peer network: one model per directed edge of ``W`` per step, plus the
intra-cluster relay of ``x_t`` to non-uploaders, §3.4), gossip messages and gradient evaluations.
"""

from __future__ import annotations

import math
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from pollen.gossip import (
    TOPOLOGIES,
    mixing_matrix,
    segment_bounds,
)
from pollen.optim import amsgrad
from pollen.strategies.engine.accounting import grad_evals_of
from pollen.strategies.engine.aggregation import Aggregator
from pollen.strategies.engine.parts import EngineParts
from pollen.strategies.engine.replies import ClientUpdate, ReplySpec
from pollen.strategies.engine.sampling import ClientSampler
from pollen.strategies.engine.strategy import (
    TRAIN_PHASE,
    AdaptiveStrategy,
    MetricsAggregationFn,
)
from pollen.strategies.engine.uplink import Uplink
from pollen.strategies.hafed_clusters import ClusterPlan, mix, peer_bytes
from pollen.wire import protocol

#: ``eta`` and ``eps`` (by ``eps_mode``) when none is given, measured for drop-in use (docs/results/dropin.md):
#: the spec's 0.01 and 1e-8 were 10 points behind FedAvg after 5 rounds of advanced-pytorch over ten seeds, and 0.02
#: with 1e-8 7 behind after 5 rounds of quickstart-pytorch. ``eta=0.02`` with a floor of 1e-3 on ``sqrt(v_hat)``
#: (``eps=1e-6`` under the sqrt; measured with ``inside``, the same floor given to the others) is within 3 in both:
#: a coordinate whose update is well below the floor takes a step in proportion to it, not a whole eta.
DROP_IN_ETA = 0.02
DROP_IN_EPS = {"inside": 1e-6, "max": 1e-6, "add": 1e-3}


def _reported_steps(metrics: Any) -> int | None:
    """The local steps a reply says it took in its segment (pollen's client reports ``num-steps``), if any."""
    value = metrics.get("num-steps") if metrics is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value)


class HAFed(AdaptiveStrategy):
    """HA-Fed with relayed gossip and server AMSGrad, and its FedAMSGrad baselines.

    Parameters
    ----------
    eta : float | None (default: None)
        Server learning rate; ``None`` takes the drop-in value :data:`DROP_IN_ETA` (0.02, measured with
        benchmarks/bench_dropin.py). The spec's Fashion-MNIST value is 0.01 (the app's run-config passes it).
    beta_1, beta_2 : float (default: 0.9, 0.99)
        AMSGrad settings (§9).
    eps : float | None (default: None)
        ``None`` takes the drop-in value of ``eps_mode`` (:data:`DROP_IN_EPS`: 1e-6 under the sqrt or in the max,
        1e-3 outside it; a floor of 1e-3 on ``sqrt(v_hat)``). The spec's value is 1e-8.
    eps_mode : str (default: "inside")
        ``inside`` (paper: ``sqrt(v_hat + eps)``), ``add`` (``sqrt(v_hat) + eps``, the related
        code) or ``max`` (FedAMS's floor).
    bias_correction : bool (default: False)
        The related code's Adam correction (§8 B2).
    local_steps : int (default: 48)
        tau, local iterations per round (>= 1).
    gossip_every : int (default: 1)
        G: a gossip step after every G iterations and after the last (``tau >= G``).
    active_prob : float (default: 1.0)
        p_c: each client is active in each iteration with this probability (§3.6), in (0, 1].
    topology : str (default: "ring")
        Each cluster's mixing matrix (:data:`pollen.gossip.TOPOLOGIES`).
    lam : float | None
        ``interpolated`` only: ``W = lam W_ring + (1 - lam) 11^T/n``.
    offsets : tuple[int, ...] | None
        ``circulant`` only, e.g. ``(1, 3)``.
    uploaders_per_cluster : int (default: 2)
        m, uploaders per cluster and round (stratified, without replacement).
    clustered : bool (default: True)
        False: no clusters (FedAMSGrad with ``fraction_train`` uniformly; needs ``topology="identity"``).
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes : float, int
        Sampling: Flower's ``FedAvg`` arguments, with its defaults and meaning (:class:`AdaptiveStrategy`).
    weighted_by_key, arrayrecord_key, configrecord_key : str
        Flower's weight metric and record names, with its defaults and meaning (:class:`AdaptiveStrategy`).
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : Callable[[list[RecordDict], str], MetricRecord] | None
        Flower's metric aggregation functions; ``None``: each metric's weighted mean (:class:`AdaptiveStrategy`).
    aggregation, aggregator, uplink, parts
        The engine's settings and parts (:class:`AdaptiveStrategy`,
        :class:`~pollen.strategies.engine.parts.EngineParts`); its default
        sampler asks each new node for its client id (clusters are formed from the client and cluster ids nodes report).
    """

    streaming = False  # the round's updates are the server's own mixed models
    robust_refusal = (
        "its round aggregate is the uploaders' models after gossip, so a bad client's update is already mixed "
        "into its neighbours' before any aggregator sees it (and only m per cluster upload)"
    )

    secagg_refusal = (
        "its clusters gossip models from client to client inside each round (peers see each other's models) and "
        "its server mixes the uploaders' models one by one"
    )
    privacy_refusal = (
        "its clusters gossip models from client to client inside each round, so the server's aggregate is not a "
        "sum of clipped client updates it could noise (and peers see each other's models)"
    )
    async_refusal = (
        "its clusters gossip with their neighbours in lock-step phases inside each round, so every member of a "
        "cluster must train from the same model at the same time"
    )

    @classmethod
    def default_parts(cls) -> EngineParts:
        """A sampler that asks each new node for its stable client id (see the class docstring)."""
        return EngineParts(sampler=ClientSampler(identify_clients=True))

    def __init__(  # noqa: PLR0913 - Flower's FedAvg arguments, the method's, the engine's
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = protocol.NUM_EXAMPLES,
        arrayrecord_key: str = protocol.ARRAYS_RECORD,
        configrecord_key: str = protocol.CONFIG_RECORD,
        train_metrics_aggr_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregationFn | None = None,
        *,
        eta: float | None = None,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        eps: float | None = None,
        eps_mode: str = "inside",
        bias_correction: bool = False,
        local_steps: int = 48,
        gossip_every: int = 1,
        active_prob: float = 1.0,
        topology: str = "ring",
        lam: float | None = None,
        offsets: tuple[int, ...] | None = None,
        uploaders_per_cluster: int = 2,
        clustered: bool = True,
        aggregation: str = "mean",
        aggregator: str | Aggregator = "mean",
        uplink: Uplink | None = None,
        parts: EngineParts | None = None,
    ) -> None:
        for name, value in (
            ("local_steps", local_steps),
            ("gossip_every", gossip_every),
            ("uploaders_per_cluster", uploaders_per_cluster),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is out of range; allowed: an integer >= 1")
        if gossip_every > local_steps:
            raise ValueError(
                f"gossip_every={gossip_every} is larger than local_steps (tau) = {local_steps}; "
                "allowed: gossip_every <= tau"
            )
        if not 0.0 < active_prob <= 1.0:
            raise ValueError(f"active_prob={active_prob!r} is out of range; allowed: a number in (0, 1]")
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology={topology!r} is unknown; allowed: {', '.join(TOPOLOGIES)}")
        if not clustered and topology != "identity":
            raise ValueError(
                f"clustered=False has no clusters to gossip in; allowed: topology='identity' (got {topology!r})"
            )
        optimizer = amsgrad(
            eta=DROP_IN_ETA if eta is None else eta,
            beta_1=beta_1,
            beta_2=beta_2,
            eps=DROP_IN_EPS.get(eps_mode, 1e-8) if eps is None else eps,
            eps_mode=eps_mode,
            bias_correction=bias_correction,
        )
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=weighted_by_key,
            arrayrecord_key=arrayrecord_key,
            configrecord_key=configrecord_key,
            train_metrics_aggr_fn=train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
            optimizer=optimizer,
            aggregation=aggregation,
            aggregator=aggregator,
            uplink=uplink,
            parts=parts,
        )
        if clustered and self.sampler.population:
            raise ValueError(
                f"population={self.sampler.population} does not fit HA-Fed's clusters: every client of every "
                "cluster trains and gossips within the round, so each needs a node of its own; allowed: "
                "population=0 (one SuperNode per client), or clustered=False (fedamsgrad-uniform)"
            )
        self.local_steps, self.gossip_every, self.active_prob = local_steps, gossip_every, float(active_prob)
        self.topology, self.lam, self.offsets = topology, lam, tuple(offsets) if offsets else None
        self.uploaders_per_cluster, self.clustered = uploaders_per_cluster, clustered
        self.segments = segment_bounds(local_steps, gossip_every) if topology != "identity" else [(0, local_steps)]
        self.sampler.plan = ClusterPlan(
            clustered=clustered,
            topology=topology,
            uploaders=uploaders_per_cluster,
            lam=lam,
            offsets=self.offsets,
            gossip_steps=len(self.segments) if topology != "identity" else 0,
        )
        self._final: dict[int, list[ClientUpdate]] = {}
        self._grad_evals: dict[int, int] = {}
        if topology == "interpolated":
            mixing_matrix(topology, 4, lam=lam)  # a bad lambda fails here, not in round 1
        elif topology == "circulant" and not self.offsets:
            raise ValueError("topology='circulant' needs offsets, e.g. (1, 3)")

    # ------------------------------------------------------------------ round
    def train_config(self, server_round: int) -> dict[str, Any]:
        tau = self.local_steps
        return {
            protocol.CFG_LOCAL_STEP: protocol.GOSSIP_LOCAL_STEP,
            protocol.CFG_GOSSIP_TAU: tau,
            protocol.CFG_GOSSIP_EVERY: self.gossip_every if self.topology != "identity" else tau,
            protocol.CFG_GOSSIP_ACTIVE: self.active_prob,
            protocol.CFG_GOSSIP_SEGMENT: 0,
            "momentum": 0.0,  # plain local SGD (spec §8 A5); a momentum buffer would not survive a gossip step
            "weight-decay": 0.0,
        }

    def mid_round(self, server_round: int, grid: Grid, replies: list[Message], timeout: float) -> list[Message]:
        """Relay every gossip step; keep the uploaders' final mixed models for :meth:`aggregate_train`."""
        stats = self.accounting.round(server_round)
        trained = self.replies.asked(server_round, TRAIN_PHASE)
        uploaders = set(self.sampler.plan.uploaders(server_round))
        down_per_start = stats.downlink_bytes / len(trained) if trained else 0.0
        current = {node: self._start_of_round(node) for node in trained}  # the server's copy of each model
        clusters = self.sampler.plan.gossiping()
        step_timeout = timeout / len(self.segments)  # the round's budget, shared by its gossip steps
        grad_evals, present, gone, moves = 0, set(), set(), []
        for index in range(len(self.segments)):
            if index > 0:
                contents = self._gossip_contents(
                    server_round, {n: u for n, u in current.items() if n not in gone}, index
                )
                replies = self.exchange(server_round, grid, contents, phase=protocol.GOSSIP_PHASE, timeout=step_timeout)
            phase = TRAIN_PHASE if index == 0 else protocol.GOSSIP_PHASE
            asked = set(self.replies.asked(server_round, phase))
            gone |= asked - {reply.metadata.src_node_id for reply in replies}  # silent: not asked again this round
            updates = self._screen_step(
                server_round, self.collect(server_round, replies, phase=phase, spec=ReplySpec()), current, moves, index
            )
            grad_evals += sum(grad_evals_of(u.metrics) for u in updates)
            present = {u.node_id for u in updates}
            current.update({u.node_id: u for u in updates})
            for cluster in clusters:
                mix(cluster, current, present)
        final = [current[node] for node in sorted(uploaders & present)]
        star = len(uploaders) * down_per_start + sum(sum(u.record_bytes.values()) for u in final)
        stats.method["relayed_bytes"] = int(round(stats.uplink_bytes + stats.downlink_bytes - star))
        model_bytes = 4 * self.layout.dim + sum(int(b.nbytes) for b in self.buffers.values())
        stats.method["peer_bytes"] = peer_bytes(
            clusters, len(trained) - len(uploaders), model_bytes, len(self.segments)
        )
        self._grad_evals[server_round] = grad_evals
        self._final[server_round] = final
        return []

    def _screen_step(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[int, ClientUpdate],
        earlier_moves: list[float],
        index: int,
    ) -> list[ClientUpdate]:
        """The outlier screen on one gossip step's moves, before they are mixed into anyone's model.

        The screen's one round-level call (:meth:`UpdateScreen.filter`) with HA-Fed's candidates and
        reference: each reply's move (its model minus the one the server sent it) is judged against the
        larger of ``factor`` x the median of the other *movers'* moves in the same step and ``factor`` x
        the median of the moves accepted in this round's earlier steps (``earlier_moves``, which grows by
        this step's); with neither, it passes. A client that
        was idle for the whole segment (``active-prob`` < 1) returns the model it got: its move is
        float round-off, and it is left out of the reference, so a step where most clients idle does
        not make every active one "10x the median". A reply that says it took no steps but moved is
        rejected. Each screened buffer is judged against its history, else (none, or a stale one: more
        than half of the step's replies exceed it) against the same buffer of the step's other replies.
        A move beyond its bound is clipped with the screen's ``rule="clip"`` (the constructor's default): the
        reply's model is pulled back along its move to the bound, so a client whose step diverged still
        gossips, its move bounded; with ``rule="reject"`` it is refused. A rejected reply is absent from this
        step's mix. (``index``: the gossip step, as logged.)
        """
        params_norm = float(np.linalg.norm(self.params))
        self.screen.set_model_norm(params_norm)
        moves: dict[int, float] = {}  # the movers' moves; an idle client (round-off only) is not judged
        candidates = []
        for update in updates:
            start = current.get(update.node_id)
            if start is None:
                self.replies.reject(server_round, update.node_id, "a reply from a node that does not train this round")
                continue
            move = float(np.linalg.norm(update.delta - start.delta))
            if move > self._round_off(start, params_norm):
                if _reported_steps(update.metrics) == 0:
                    why = f"reports no local steps but moved {move:.3g} (outlier screen)"
                    self.replies.reject(server_round, update.node_id, why)
                    continue
                moves[id(update)] = move
            candidates.append(update)
        earlier = [m for m in earlier_moves if m > 0]
        reference = self.screen.factor * self.screen.reference(float(np.median(earlier))) if earlier else None

        def pull_back(update: ClientUpdate, scale: float) -> None:
            """Clip a move: the reply's model moved ``scale`` of the way from the one it was sent to its own."""
            start = current[update.node_id].delta
            update.delta = start + np.float32(scale) * (update.delta - start)
            update.norm = float(np.linalg.norm(update.delta))
            self.screen.clipped += 1
            log(
                INFO,
                "round %d, gossip step %d: outlier screen clipped %s's move %.3g to %.3g",
                server_round,
                index,
                update.client_key,
                moves[id(update)],
                moves[id(update)] * scale,
            )
            moves[id(update)] *= scale

        kept = self.screen.filter(
            candidates,
            lambda update, why: self.replies.reject(server_round, update.node_id, why),
            f"round {server_round}, gossip step {index}",
            reorder=False,
            norm_of=lambda update: moves.get(id(update)),
            reference=reference,
            rescale=pull_back,
        )
        earlier_moves.extend(moves[id(u)] for u in kept if id(u) in moves)
        return kept

    def _round_off(self, start: ClientUpdate, params_norm: float) -> float:
        """The largest move that is only float round-off of sending a client ``start`` and reading it back
        (``params_norm``: ``||x||`` of the round's global model).

        The server sends ``x + d`` (rounded in float32, then in the model's dtype) and reads the reply as
        ``(x + d) - x``: each coordinate is off by at most about ``eps (|x_j| + 2 |d_j|)``, so the move of
        an idle client is below ``eps (||x|| + 2 ||d||)``; twice that is the tolerance.
        """
        eps = max([float(np.finfo(np.float32).eps)] + [float(np.finfo(t.dtype).eps) for t in self.layout.trainable])
        return 2.0 * eps * (params_norm + 2.0 * float(np.linalg.norm(start.delta)))

    def _start_of_round(self, node: int) -> ClientUpdate:
        """A client's model before its first reply: ``x_t`` and the global buffers."""
        return ClientUpdate(
            client_key=self.sampler.key(node),
            node_id=node,
            delta=np.zeros(self.layout.dim, dtype=np.float32),
            buffers={name: value.copy() for name, value in self.buffers.items()},
            num_examples=1.0,
            metrics=None,
        )

    def aggregate_train(self, server_round: int, replies: Any) -> tuple[ArrayRecord | None, Any]:
        """The server step on the uploaders' mixed models (the round's replies were read in :meth:`mid_round`)."""
        stats = self.accounting.round(server_round)
        updates = self.screened(server_round, self._final.pop(server_round, []))
        result = self.apply_updates(server_round, updates)
        stats.grad_evals = self._grad_evals.pop(server_round, stats.grad_evals)  # every client trained
        self.sampler.plan.forget(server_round)
        log(
            INFO,
            "HA-Fed round %d: %d gossip steps, %d gossip messages, relayed %.2f MB (a peer network: %.2f MB), "
            "%d gradient evaluations",
            server_round,
            len(self.segments) - 1 + (self.topology != "identity"),
            stats.exchange_messages,
            stats.method.get("relayed_bytes", 0) / 1e6,
            stats.method.get("peer_bytes", 0) / 1e6,
            stats.grad_evals,
        )
        return result

    def _gossip_contents(
        self, server_round: int, current: dict[int, ClientUpdate], index: int
    ) -> dict[int, RecordDict]:
        """Each client's mixed model (trainables and buffers) as the next segment's start."""
        contents = {}
        config = ConfigRecord({**self.train_config(server_round), protocol.CFG_GOSSIP_SEGMENT: index})
        if self.layout.buffer_keys:
            config[protocol.CFG_BUFFER_KEYS] = protocol.join_keys(self.layout.buffer_keys)
        for node, update in current.items():
            named = self.layout.unflatten(self.params + update.delta)
            named.update(update.buffers)
            arrays = self.model.record_of(named)
            contents[node] = RecordDict({protocol.ARRAYS_RECORD: arrays, protocol.CONFIG_RECORD: config})
        return contents

    def extra_summary(self) -> dict[str, Any]:
        if self.topology == "identity":
            what = "stratified" if self.clustered else f"{self.fraction_train:g} of all clients, uniformly"
            return {"gossip": f"none (FedAMSGrad, {what}); tau = {self.local_steps}"}
        return {
            "gossip": f"{self.topology} in each cluster, after every {self.gossip_every} of tau = {self.local_steps} "
            f"iterations ({len(self.segments)} steps), active-prob {self.active_prob:g}, "
            f"m = {self.uploaders_per_cluster} uploaders per cluster",
        }
