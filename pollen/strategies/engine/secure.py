"""Secure aggregation as an engine part: SecAgg+ as three mid-round exchanges, the server step on the sum.

``EngineParts(secagg=SecureAggregation(bits=16, clip=0.05))`` (run-config ``secagg=true``) makes a round's
aggregate the mean the server decodes from the *sum* of the clients' encoded updates; the server never holds
one client's update (:mod:`pollen.secagg.protocol`, ``privacy.md`` §8-§10). A round:

1. **train** (the round's train message): each sampled client is sent its SecAgg+ setup (its neighbours on the
   round's graph, the threshold, the summable codec, the round's key) with the model; it trains, encodes
   ``x_local - x_global`` plus its error-feedback residual into integers (:class:`~pollen.secagg.codec.
   SummableCodec`) and keeps them; its reply carries its public keys and its metrics, no model;
2. **secagg-share-keys**: each client gets its neighbours' keys and answers with its Shamir shares, sealed
   for each neighbour; 3. **secagg-masked-input**: each gets the shares sealed for it and answers with its
   masked integers; 4. **secagg-unmask**: each survivor gets who survived and who dropped and answers with its
   shares of the survivors' seeds and the dropped clients' mask keys;
5. the server removes the masks, decodes the mean ``sum * clip / L / n`` and steps its optimiser on it.

A client that stops answering after its shares are out is recovered through its neighbours' shares as long as
``threshold`` of them answer; fewer, and the round is aborted: counted (``secagg_aborted`` in the round's
results, with the reason logged), no step, every part of the server's state unchanged. A
malformed reply drops its client at that stage, with the reason.

What must hold, checked before round 1 with a one-line refusal (:meth:`SecureAggregation.check_fits`): the
aggregate is a plain unweighted mean of the round's updates (each method that needs one client's update says
why in its ``secagg_refusal``: a stored-update table, per-client mirrors, gossip), the mean aggregator, the
outlier screen off (it needs every update's norm; the codec's public range bounds what an honest client
moves the sum instead), no differential privacy part, the synchronous driver; a model without floating-point
buffers (they would travel outside the sum: BatchNorm's statistics). FedCAMS's sign or top-k uplink cannot be
summed (per-client scales and supports): under secure aggregation its uplink *is* the summable codec, with
error feedback.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from pollen.secagg.codec import MAX_CLIENTS, SummableCodec
from pollen.secagg.crypto import KEY_BYTES
from pollen.secagg.protocol import SecAggAbort, SecAggServer
from pollen.strategies.engine.client_errors import client_error_text
from pollen.strategies.engine.replies import ClientUpdate, ReplySpec, count_records
from pollen.strategies.engine.round_aggregate import MeanAggregate
from pollen.strategies.engine.screening import UpdateScreen
from pollen.wire import protocol

#: The fewest clients a round aggregates securely: with two, each learns the other's update from the next model.
MIN_CLIENTS = 3
#: A train reply under secure aggregation: keys and metrics, no update.
KEYS_SPEC = ReplySpec(update="optional", buffers="off")
#: The per-coordinate range ``[-clip, clip]`` of the summable codec (in units of the model's parameters).
DEFAULT_CLIP = 0.05
DEFAULT_BITS = 16


class SecureMean:
    """The round's delta decoded from the secure sum (what the server step takes in place of a running mean)."""

    def __init__(self, delta: np.ndarray) -> None:
        self.delta = delta

    def mean(self) -> np.ndarray:
        """The decoded mean (the server step's delta)."""
        return self.delta


def _ints(value: Any) -> list[int] | None:
    """``value`` as a list of node ids when it is one (integers, not booleans); ``None`` otherwise."""
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _blobs(value: Any) -> list[bytes] | None:
    """``value`` as a list of byte strings when it is one; ``None`` otherwise."""
    if isinstance(value, list) and all(isinstance(v, bytes) for v in value):
        return list(value)
    return None


def _pairs(record: Any, ids_key: str, blobs_key: str) -> dict[int, bytes] | None:
    """``{id: blob}`` from a ConfigRecord's two parallel lists (both absent: empty); ``None`` if malformed."""
    if not isinstance(record, ConfigRecord):
        return None
    if ids_key not in record and blobs_key not in record:
        return {}
    ids, blobs = _ints(record.get(ids_key)), _blobs(record.get(blobs_key))
    if ids is None or blobs is None or len(ids) != len(blobs) or len(set(ids)) != len(ids):
        return None
    return dict(zip(ids, blobs))


def rounding_seed(run_seed: int, server_round: int) -> int:
    """The seed of a round's stochastic rounding (with the client's node id, its generator's): reproducible runs."""
    digest = hashlib.sha256(f"pollen-secagg-rounding/{run_seed}/{server_round}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


class SecureAggregation:
    """Secure aggregation (SecAgg+) of the round's updates, with a summable codec and client-side error feedback.

    Parameters
    ----------
    bits : int (default: 16)
        Bits per coordinate of the summable codec (2 to 24). The wire width is the sum's (a round of ``n`` clients
        needs ``ceil(log2(2 n (2**(bits-1) - 1) + 1))`` bits so that nothing overflows), rounded up to 8, 16, 32
        or 64: 8 bits with up to 128 clients a round travel in 16-bit lanes, half a float32 update.
    clip : float (default: 0.05)
        The codec's public per-coordinate range ``[-clip, clip]`` of an update (``x_local - x_global``): it bounds
        what one honest client moves the sum; what lies beyond goes to the client's error-feedback residual.
    degree : int | None (default: None)
        Neighbours per client on the round's graph (SecAgg+), an even number; ``None``: ``2 ceil(log2 n)``.
    threshold : int | None (default: None)
        Shares that rebuild a secret (2 to a client's neighbours + 1); ``None``: two thirds of the holders. A round
        whose sample leaves fewer holders than a fixed threshold is aborted with the reason.
    seed : int | None (default: None)
        Seeds the clients' stochastic rounding (with the round and the node), for reproducible simulations;
        ``None``: each client rounds with fresh randomness. The masks are always fresh.
    """

    mode = "secagg"

    def __init__(  # noqa: PLR0913 - the protocol's settings
        self,
        *,
        bits: int = DEFAULT_BITS,
        clip: float = DEFAULT_CLIP,
        degree: int | None = None,
        threshold: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.codec = SummableCodec(clip=clip, bits=bits)  # checks both; each round's is sized by its sample
        if degree is not None and not (
            isinstance(degree, int) and not isinstance(degree, bool) and degree >= 2 and degree % 2 == 0
        ):
            raise ValueError(
                f"secagg degree={degree!r} is invalid; allowed: an even integer >= 2 (the ring graph links each client "
                "to degree / 2 on each side), or None"
            )
        if threshold is not None and not (
            isinstance(threshold, int) and not isinstance(threshold, bool) and threshold >= 2
        ):
            raise ValueError(f"secagg threshold={threshold!r} is invalid; allowed: an integer >= 2, or None")
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool)):
            raise ValueError(f"secagg seed={seed!r} is invalid; allowed: an integer or None")
        self.degree, self.threshold, self.seed = degree, threshold, seed
        #: Each round's protocol (or why the round cannot run one) and its setup messages, until the round ends.
        self._servers: dict[int, SecAggServer | str] = {}
        self._setups: dict[int, dict[int, dict[str, Any]]] = {}
        self._results: dict[int, tuple[list[ClientUpdate], np.ndarray | None]] = {}

    # ------------------------------------------------------------------ before round 1
    def check_fits(self, strategy: Any, *, round_aggregate: Any, screen: UpdateScreen, privacy: Any) -> None:
        """``ValueError`` with the reason when ``strategy`` (with its parts) cannot aggregate securely."""
        name = type(strategy).__name__
        for part in (strategy, round_aggregate):
            if (why := getattr(part, "secagg_refusal", None)) is not None:
                raise ValueError(f"{name} does not take secure aggregation: {why}")
        if type(round_aggregate) is not MeanAggregate:
            raise ValueError(
                f"{name} does not take secure aggregation: its round aggregate ({type(round_aggregate).__name__}) "
                "is not the mean of the round's updates, the one thing the server can learn from their sum"
            )
        if strategy.aggregation != "mean":
            raise ValueError(
                f"{name}: secure aggregation needs aggregation='mean' (a weight would be one client's own number in "
                f"the clear); got aggregation={strategy.aggregation!r}"
            )
        if not strategy.aggregator.streams:
            raise ValueError(
                f"{name}: secure aggregation needs the mean aggregator (a robust one needs every update apart); "
                f"got aggregator={strategy.aggregator.name!r}"
            )
        if screen.rule != "off":
            raise ValueError(
                f"{name}: secure aggregation needs the outlier screen off (UpdateScreen(rule='off'): it judges each "
                "update's norm, which the server never sees; the codec's clip bounds an honest client instead); "
                f"got rule={screen.rule!r}"
            )
        if privacy is not None:
            raise ValueError(
                f"{name}: secure aggregation does not take a differential-privacy part yet (central DP needs each "
                "update to clip it; distributed noise under the sum is not built); allowed: one or the other"
            )

    def check_driver(self, driver: Any, name: str) -> None:
        """``ValueError`` unless ``driver`` runs lock-step rounds (the cohort's masks are set up before training)."""
        from pollen.strategies.engine.buffered import BufferedAsync  # the drivers import the parts
        from pollen.strategies.engine.rounds import SyncRounds

        if not isinstance(driver, SyncRounds) or isinstance(driver, BufferedAsync):
            raise ValueError(
                f"{name}: secure aggregation needs the synchronous round driver (a round's cohort sets up its masks "
                f"before training); got {type(driver).__name__}"
            )

    def check_layout(self, layout: Any, name: str) -> None:
        """``SetupError`` for a model with floating-point buffers: they would reach the server one client at a
        time, outside the sum."""
        from pollen.strategies.engine.rounds import SetupError  # rounds imports the parts

        floats = [spec.name for spec in layout.buffers if np.issubdtype(spec.dtype, np.floating)]
        if floats:
            raise SetupError(
                f"{name} with secure aggregation: the model's floating-point buffers ({', '.join(floats[:3])}"
                f"{', ...' if len(floats) > 3 else ''}) are computed from each client's data and would reach the "
                "server one client at a time, outside the secure sum; allowed: a model without them (GroupNorm "
                "instead of BatchNorm: run-config norm='gn')"
            )

    def summary(self) -> str:
        """One line for the strategy's summary."""
        codec = self.codec
        return (
            f"SecAgg+ over the round's sample: summable codec {codec.bits} bits in [-{codec.clip:g}, {codec.clip:g}] "
            "with error feedback, lanes as wide as the round's sum needs, "
            f"degree {self.degree or '2 ceil(log2 n)'}, threshold {self.threshold or 'two thirds of the holders'}"
        )

    # ------------------------------------------------------------------ a round
    def begin(self, server_round: int, nodes: list[int], dim: int) -> None:
        """Set up the round's protocol over ``nodes`` (the sampled ones), before their train messages are built."""
        self._results.pop(server_round, None)
        if not MIN_CLIENTS <= len(nodes) <= MAX_CLIENTS:
            self._servers[server_round] = (
                f"{len(nodes)} clients sampled; secure aggregation needs {MIN_CLIENTS} to {MAX_CLIENTS} (with two, "
                "each would learn the other's update from the next model)"
            )
            return
        try:
            server = SecAggServer(
                nodes,
                SummableCodec(clip=self.codec.clip, bits=self.codec.bits, max_clients=len(nodes)),
                dim,
                degree=self.degree,
                threshold=self.threshold,
                seed=int.from_bytes(
                    hashlib.sha256(f"graph/{self.seed}/{server_round}".encode()).digest()[:4], "little"
                ),
            )
        except ValueError as err:  # a fixed threshold this round's sample cannot meet
            self._servers[server_round] = f"this round's {len(nodes)} clients cannot run it: {err}"
            return
        self._servers[server_round], self._setups[server_round] = server, server.setup_messages()

    def node_config(self, server_round: int, node: int) -> dict[str, Any]:
        """What ``node``'s train message of ``server_round`` adds to its config: its part of the setup."""
        server = self._servers.get(server_round)
        setup = self._setups.get(server_round, {}).get(node)
        if not isinstance(server, SecAggServer) or setup is None:
            return {protocol.CFG_SECAGG_OFF: True}
        config: dict[str, Any] = {
            protocol.CFG_SECAGG_NEIGHBOURS: list(setup["neighbours"]),
            protocol.CFG_SECAGG_THRESHOLD: int(setup["threshold"]),
            protocol.CFG_SECAGG_CLIP: float(server.codec.clip),
            protocol.CFG_SECAGG_BITS: int(server.codec.bits),
            protocol.CFG_SECAGG_MAX_CLIENTS: int(server.codec.max_clients),
            protocol.CFG_SECAGG_DIM: int(setup["dim"]),
            protocol.CFG_SECAGG_ROUND: bytes(setup["round"]),
        }
        if self.seed is not None:
            config[protocol.CFG_SECAGG_SEED] = rounding_seed(self.seed, server_round)
        return config

    def run(self, strategy: Any, server_round: int, grid: Grid, replies: list[Message], timeout: float) -> None:
        """The round's three exchanges after the train replies; the result is kept for :meth:`finish`."""
        server = self._servers.pop(server_round, "the round was not set up (no train message was built)")
        self._setups.pop(server_round, None)
        stats = strategy.accounting.round(server_round)
        try:
            if not isinstance(server, SecAggServer):
                raise SecAggAbort(server)
            key = server.round_key
            updates, advertised = self._read_keys(strategy, server_round, replies)
            keys = server.receive_keys(advertised)
            self._refuse(strategy, server_round, server)
            answers = self._ask(
                strategy, server_round, grid, timeout, protocol.SECAGG_SHARE_PHASE, keys, _keys_record, key
            )
            shares = {node: _pairs(record, "to", "sealed") for node, record in answers.items()}
            forwarded = server.receive_shares(shares)
            self._refuse(strategy, server_round, server)
            answers = self._ask(
                strategy, server_round, grid, timeout, protocol.SECAGG_MASKED_PHASE, forwarded, _sealed_record, key
            )
            requests = server.receive_masked({node: _masked_vector(record) for node, record in answers.items()})
            self._refuse(strategy, server_round, server)
            stats.uplink_update_bytes += sum(int(answers[node].count_bytes()) for node in server.u3)  # as measured
            stats.uplink_fp32_bytes += 4 * server.dim * len(server.u3)
            answers = self._ask(
                strategy, server_round, grid, timeout, protocol.SECAGG_UNMASK_PHASE, requests, _unmask, key
            )
            total, count = server.receive_unmask({node: _revealed(record) for node, record in answers.items()})
            self._refuse(strategy, server_round, server)
            if count < MIN_CLIENTS:
                raise SecAggAbort(f"{count} survivors; releasing the sum of fewer than {MIN_CLIENTS} would show each "
                                  "its other's update")  # fmt: skip
        except SecAggAbort as err:
            if isinstance(server, SecAggServer):
                self._refuse(strategy, server_round, server)
            log(WARNING, "round %d: secure aggregation aborted, no step: %s", server_round, err)
            stats.method["secagg_aborted"] = 1
            self._results[server_round] = ([], None)
            return
        survivors = set(server.u3)
        kept = [u for u in updates if u.node_id in survivors]
        stats.method["secagg_dropped"] = len(server.dropped)
        stats.method["secagg_survivors"] = count
        log(
            INFO,
            "round %d: secure sum of %d clients (%d dropped after sharing)",
            server_round,
            count,
            len(server.dropped),
        )
        self._results[server_round] = (kept, server.codec.decode_mean(total, count))

    def finish(self, server_round: int) -> tuple[list[ClientUpdate], SecureMean | None]:
        """The round's surviving clients (keys and metrics, no update) and the decoded mean (``None``: aborted)."""
        updates, delta = self._results.pop(server_round, ([], None))
        return updates, (SecureMean(delta) if delta is not None else None)

    # ------------------------------------------------------------------ the exchanges
    @staticmethod
    def _read_keys(
        strategy: Any, server_round: int, replies: list[Message]
    ) -> tuple[list[ClientUpdate], dict[int, dict[str, bytes]]]:
        """The train replies read as metrics (no update) and each one's advertised keys, by node; a reply that
        carries arrays (an update in the clear) or no keys is refused."""
        clean = []
        for reply in replies:
            if not reply.has_error() and reply.content.array_records:
                strategy.replies.reject(
                    server_round,
                    reply.metadata.src_node_id,
                    "under secure aggregation a train reply carries its keys, not arrays (is the ClientApp missing "
                    "pollen's secagg_mod?)",
                )
                continue
            clean.append(reply)
        updates, advertised = [], {}
        for update in strategy.collect(server_round, clean, spec=KEYS_SPEC):
            record = update.reply.get(protocol.SECAGG_RECORD) if update.reply is not None else None
            keys = _keys_of(record)
            if keys is None:
                strategy.replies.reject(
                    server_round,
                    update.node_id,
                    f"train reply without its secure-aggregation keys ('{protocol.SECAGG_RECORD}': c_pk, s_pk, "
                    f"b_commit, {KEY_BYTES} bytes each); is the ClientApp missing pollen's secagg_mod?",
                )
                continue
            advertised[update.node_id] = keys
            updates.append(update)
        return updates, advertised

    @staticmethod
    def _ask(  # noqa: PLR0913
        strategy: Any,
        server_round: int,
        grid: Grid,
        timeout: float,
        phase: str,
        outgoing: Mapping[int, Any],
        build: Any,
        round_key: bytes,
    ) -> dict[int, ConfigRecord | ArrayRecord | None]:
        """Send each node its part of ``phase`` (with the round's key, so a late message of another round is
        refused by the client); each answering node's ``pollen.secagg`` record (``None`` when its reply is an
        error or lacks it: the protocol counts it as dropped)."""
        contents = {}
        for node, part in outgoing.items():
            record = build(part)
            record[protocol.SECAGG_ROUND_ENTRY] = round_key
            contents[node] = RecordDict({protocol.SECAGG_RECORD: record})
        # as train messages: any ClientApp's train function answers them through secagg_mod
        replies = strategy.exchange(
            server_round, grid, contents, phase=phase, timeout=timeout, message_type=MessageType.TRAIN
        )
        stats = strategy.accounting.round(server_round)
        answers: dict[int, Any] = {}
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                why = client_error_text(reply.error.reason if isinstance(reply.error.reason, str) else "")
                strategy.replies.reject(server_round, node, f"{phase}: client error: {why}")
                continue
            try:
                stats.add_uplink(count_records(reply), prefix=f"{phase}/")
            except ValueError as err:
                strategy.replies.reject(server_round, node, f"{phase}: {err}")
                continue
            answers[node] = (
                reply.content.get(protocol.SECAGG_RECORD) if protocol.SECAGG_RECORD in reply.content else None
            )
        strategy.replies.missing(server_round, phase, replies)
        return answers

    @staticmethod
    def _refuse(strategy: Any, server_round: int, server: SecAggServer) -> None:
        """Count each client the protocol refused since the last call as a failure, with its reason."""
        for node in [n for n in server.refused if n not in server.reported]:
            strategy.replies.reject(server_round, node, f"secure aggregation: {server.refused[node]}")
            server.reported.add(node)


def _keys_of(record: Any) -> dict[str, bytes] | None:
    """A train reply's advertised keys (``c_pk``, ``s_pk``, ``b_commit``) when all three are bytes; else ``None``."""
    if not isinstance(record, ConfigRecord):
        return None
    keys = {name: record.get(name) for name in ("c_pk", "s_pk", "b_commit")}
    return keys if all(isinstance(v, bytes) for v in keys.values()) else None  # the protocol checks their sizes


def _keys_record(neighbours: Mapping[int, Mapping[str, bytes]]) -> ConfigRecord:
    """The share-keys message: each neighbour's id and keys as parallel lists (none: an empty record)."""
    ids = sorted(neighbours)
    record = ConfigRecord()
    if ids:
        record["ids"] = ids
        for name in ("c_pk", "s_pk", "b_commit"):
            record[name] = [neighbours[v][name] for v in ids]
    return record


def _sealed_record(sealed: Mapping[int, bytes]) -> ConfigRecord:
    """The masked-input message: the shares sealed for this client, by sender, as parallel lists."""
    ids = sorted(sealed)
    return ConfigRecord({"from": ids, "sealed": [sealed[v] for v in ids]} if ids else {})


def _unmask(request: Mapping[str, Any]) -> ConfigRecord:
    """The unmask message: the client's neighbourhood's survivors and drop-outs, and the round's survivor count."""
    record = ConfigRecord({"alive": list(request["alive"]), "survivors": int(request["survivors"])})
    if request["dropped"]:
        record["dropped"] = list(request["dropped"])
    return record


def _masked_vector(record: Any) -> Any:
    """The one array of a masked-input answer (the protocol checks its type and size), or what came instead."""
    if not isinstance(record, ArrayRecord) or len(record) != 1:
        return record
    from pollen.wire.records import record_to_arrays

    try:
        return next(iter(record_to_arrays(record).values()))
    except ValueError as err:
        return f"unreadable array: {err}"


def _revealed(record: Any) -> Any:
    """An unmask answer as the protocol reads it: ``{"b": {id: share}, "s": {id: share}}``."""
    b, s = _pairs(record, "b_ids", "b"), _pairs(record, "s_ids", "s")
    if b is None or s is None:
        return None
    return {"b": b, "s": s}


__all__ = ["DEFAULT_BITS", "DEFAULT_CLIP", "KEYS_SPEC", "SecureAggregation", "SecureMean", "rounding_seed"]
