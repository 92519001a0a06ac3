"""FedNLAA, FedAA, FedNLACA, FedACA, FedBNLACA and FedBACA (spec ``papers/fedbaca.md`` §4-5) as one strategy.

Lazy (NLA) and accelerated (AA) aggregation on FedAMS (Option A: ``v_hat = max(v_hat, v, eps)``):

- **uplink** (Algorithms 1 and 3): each client judges its candidate (``Delta``, or ``C(Delta + e)`` with
  error feedback) against the last vector it transmitted (:func:`pollen.lazy.judge`). An NLA skip sends
  a one-bit flag and no vector, and the server reuses its stored copy ``ref_i``; AA sends the new vector
  and the server adds ``ref_i``. The server sends each client the checksum of the ``ref_i`` it holds, and
  a client judges only against a reference with that checksum, so both sides always reuse the same copy.
- **downlink** (Algorithm 2, the spec's *increment reading*, FedBNLACA / FedBACA): the server keeps a
  mirror ``x_i`` of each client's model and the last increment ``c_prev_i``; it sends
  ``C(theta_t - x_i)`` judged by NLA / AA against ``c_prev_i``, and both sides add the result to ``x_i``
  (:func:`pollen.lazy.downlink_step`); the client trains from ``x_i``. A client seen for the first time,
  or one whose copy was lost or disagrees with the mirror (a checksum travels with every increment),
  gets the full model once (``full``), counted apart. Ablations: ``downlink_mode="model-keep"``
  (Variant B) and ``"literal"`` (Variant C, error feedback on raw models; fails by design).

The aggregate is ``(1/|S_t|) sum_i used_i`` over the replies (a skipped client counts through its reused
vector). Per-client vectors live in a :class:`~pollen.strategies.lazy_book.ClientBook` (FedAdaVR's table storage;
RAM or memory-mapped); absent clients keep everything on both sides. The client side is
:func:`pollen.clientside.lazy_mod.lazy_mod`.

With every threshold 0 nothing fires (unless a candidate equals its reference exactly): FedNLAA = FedAA =
FedAMS, FedNLACA = FedACA = FedCAMS, FedBNLACA = FedBACA = FedCAMS with an error-fed compressed downlink.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log

from pollen.compression import CODECS, GRANULARITIES, make_codec
from pollen.lazy.rules import (
    DOWNLINK_MODES,
    EF_MODES,
    REF_MODES,
    RULES,
    TAU_SCALINGS,
    check_choice,
    check_tau,
    checksum,
    norm64,
    replay,
    threshold_warnings,
)
from pollen.strategies.engine.aggregation import Aggregator
from pollen.strategies.engine.declared import PART
from pollen.strategies.engine.downlink import Downlink
from pollen.strategies.engine.parts import EngineParts
from pollen.strategies.engine.sampling import ClientSampler
from pollen.strategies.engine.strategy import (
    MetricsAggregationFn,
    ReplyRejected,
    ReplySpec,
)
from pollen.strategies.fedams import FedAMS
from pollen.strategies.lazy_book import ClientBook
from pollen.strategies.lazy_uplink import LazyUplink
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record, payload_to_records

#: Every event of a round the family counts (``RoundStats.method["lazy_events"]``, results column
#: ``method.lazy_events``).
EVENTS = (
    "up-send",
    "up-skip",
    "up-aa",
    "up-flags",
    "down-dense",
    "down-full",
    "down-send",
    "down-skip",
    "down-aa",
    "down-keep",
    "down-flags",
    "resync",
)


class FedLazy(FedAMS):
    """FedAMS with lazy / accelerated aggregation, optionally compressed both ways with error feedback.

    Parameters
    ----------
    up_rule : str (default: "nla")
        ``"nla"`` (skip), ``"aa"`` (merge) or ``"none"`` on the uplink.
    up_tau : float (default: 0.0)
        Effective uplink threshold ``C / (alpha |S_t|)`` (NLA) or ``D / (alpha |S_t|)`` (AA), >= 0 (with
        ``tau_scaling="paper"``: ``C`` or ``D`` itself). The paper gives no value; the spec's calibration
        (§9) and pollen's (``docs/results/lazy.md``): uncompressed updates fire from about 0.25-0.5, top-k 1/8
        with error feedback only from about 1.2-1.4.
        The app's defaults per method are calibrated ones (:data:`pollen.app.methods.lazy.TAUS`); 0 here
        never fires (a warning says so).
    compressor : str (default: "none")
        Uplink codec of :mod:`pollen.compression` (``"none"``: Algorithm 1, no error feedback).
    topk_ratio : float (default: 1/8)
        Uplink top-k ratio, in (0, 1].
    error_feedback : bool (default: True)
        Error feedback on a compressed uplink (ignored without a codec).
    granularity : str (default: "model")
        One scale / one top-k over the model, or per tensor (``"tensor"``), both directions.
    down_compressor : str | None (default: None)
        ``None``: dense downlink (the full model every round, Algorithms 1 and 3). A codec name:
        Algorithm 2's compressed, error-fed downlink with per-client mirrors.
    down_rule : str (default: "none")
        ``"nla"``, ``"aa"`` or ``"none"`` on the downlink.
    down_tau : float (default: 0.0)
        Effective downlink threshold, >= 0.
    down_topk_ratio : float (default: 1/8)
        Downlink top-k ratio, in (0, 1].
    downlink_mode : str (default: "increment")
        ``"increment"`` (recommended), ``"model-keep"`` (Variant B; NLA only) or ``"literal"``
        (Variant C, the negative control).
    ef_mode : str (default: "applied")
        Uplink error feedback on what the server applied (``"applied"``, Lemma F.4) or on what the
        codec kept (``"compressed"``, the proof identities D.1/E.1).
    ref_mode : str (default: "last-transmitted")
        What "t-1" is for a client's uplink reference: its last transmitted vector from its last
        participation, or ``"consecutive-only"`` (the proofs' literal reading, spec §5.7: no reference
        unless it took part in the previous round). The downlink's last increment is always the one of
        the client's last participation.
    bookkeeping_dir : str | None (default: None)
        Keep the per-client vectors memory-mapped in this directory instead of RAM.
    tau_scaling : str (default: "effective")
        ``"effective"``: ``up_tau`` / ``down_tau`` are the thresholds themselves. ``"paper"``: they are the
        paper's constants ``C`` and ``D``, and each round's thresholds are ``C / (alpha |S_t|)`` and
        ``D / (alpha |S_t|)`` with ``|S_t|`` the clients sampled that round (spec §4, so they shrink as
        more clients take part).
    tau_alpha : float (default: 1.0)
        The paper's ``alpha`` in that scaling, > 0.
    downlink : Downlink | None (default: None)
        The compressed downlink as one part (:class:`~pollen.strategies.engine.downlink.Downlink`); the
        ``down_*`` arguments build it when it is not given (``down_compressor`` set).
    eta, beta_1, beta_2, eps, option, bias_correction
        The server's AMSGrad, as :class:`FedAMS` takes them (its defaults: ``eta=None`` is 0.02 with option 1). The
        paper's server settings are Option A with ``eps=1e-3``; the app's run-config passes them.
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes : float, int
        Sampling: Flower's ``FedAvg`` arguments, with its defaults and meaning (:class:`AdaptiveStrategy`).
    weighted_by_key, arrayrecord_key, configrecord_key : str
        Flower's weight metric and record names, with its defaults and meaning (:class:`AdaptiveStrategy`).
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : Callable[[list[RecordDict], str], MetricRecord] | None
        Flower's metric aggregation functions; ``None``: each metric's weighted mean (:class:`AdaptiveStrategy`).
    aggregation, aggregator, parts
        The engine's settings and parts (:class:`AdaptiveStrategy`,
        :class:`~pollen.strategies.engine.parts.EngineParts`); its default
        sampler asks each new node for its client id (each client's stored copies are kept by its stable id).
    """

    secagg_refusal = (
        "the server keeps a copy of each client's last upload (its skip and merge rules read one client's upload), "
        "which secure aggregation never shows it"
    )
    privacy_refusal = (
        "the server keeps each client's last upload and re-uses a skipped client's copy in later rounds, so a "
        "client's update re-enters every later release (privacy.md section 7)"
    )
    async_refusal = (
        "its lazy rules compare each upload with the client's reference of the previous round, and its downlink "
        "increments assume every client holds the same model replica, which clients training from different "
        "versions do not"
    )

    streaming = False  # each reply is resolved against its client's stored copies before the mean
    state_fields = {"book": PART}
    reply_spec = ReplySpec(flags=(protocol.FLAG_SKIP, protocol.FLAG_AA, protocol.FLAG_RESYNC), update="optional")

    @classmethod
    def default_parts(cls) -> EngineParts:
        """A sampler that asks each new node for its stable client id (see the class docstring)."""
        return EngineParts(sampler=ClientSampler(identify_clients=True))

    def __init__(  # noqa: PLR0913 - Flower's FedAvg arguments, the method's, FedAMS's, the engine's
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
        up_rule: str = "nla",
        up_tau: float = 0.0,
        compressor: str = "none",
        topk_ratio: float = 1 / 8,
        error_feedback: bool = True,
        granularity: str = "model",
        down_compressor: str | None = None,
        down_rule: str = "none",
        down_tau: float = 0.0,
        down_topk_ratio: float = 1 / 8,
        downlink_mode: str = "increment",
        ef_mode: str = "applied",
        ref_mode: str = "last-transmitted",
        bookkeeping_dir: str | None = None,
        tau_scaling: str = "effective",
        tau_alpha: float = 1.0,
        downlink: Downlink | None = None,
        eta: float | None = None,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        eps: float | None = None,
        option: int = 1,
        bias_correction: bool = False,
        aggregation: str = "mean",
        aggregator: str | Aggregator = "mean",
        parts: EngineParts | None = None,
    ) -> None:
        check_choice("up_rule", up_rule, RULES)
        check_choice("compressor", compressor, CODECS)
        check_choice("granularity", granularity, GRANULARITIES)
        check_choice("ef_mode", ef_mode, EF_MODES)
        check_choice("ref_mode", ref_mode, REF_MODES)
        check_choice("tau_scaling", tau_scaling, TAU_SCALINGS)
        if isinstance(tau_alpha, bool) or not isinstance(tau_alpha, (int, float)) or not tau_alpha > 0:
            raise ValueError(f"tau_alpha={tau_alpha!r} is out of range; allowed: a number > 0")
        if not 0.0 < topk_ratio <= 1.0:
            raise ValueError(f"topk_ratio={topk_ratio!r} is out of range; allowed: a number in (0, 1]")
        if downlink is None and down_compressor is not None:
            downlink = Downlink(down_compressor, down_topk_ratio, down_rule, down_tau, downlink_mode, granularity)
        elif downlink is None:
            check_choice("down_rule", down_rule, RULES)
            check_choice("downlink_mode", downlink_mode, DOWNLINK_MODES)
            check_tau("down_tau", down_tau)
        if downlink is None and down_rule != "none":
            raise ValueError(
                f"down_rule={down_rule!r} needs a compressed downlink (down_compressor); allowed without one: none"
            )
        uplink = LazyUplink(compressor, topk_ratio, error_feedback, granularity, rule=up_rule, ef_mode=ef_mode)
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
            eta=eta,
            beta_1=beta_1,
            beta_2=beta_2,
            eps=eps,
            option=option,
            bias_correction=bias_correction,
            aggregation=aggregation,
            aggregator=aggregator,
            uplink=uplink,
            parts=parts,
        )
        self.up_rule, self.up_tau = up_rule, check_tau("up_tau", up_tau)
        self.compressor, self.topk_ratio, self.granularity = compressor, uplink.topk_ratio, granularity
        self.error_feedback = uplink.error_feedback
        # the client owes its residual what was not applied; ref_mode="consecutive-only" asks who took part
        self.ledger.decide(self.error_feedback, must_keep=True, owner=self)
        self.downlink = downlink
        self.ef_mode, self.ref_mode = ef_mode, ref_mode
        self.bookkeeping_dir = bookkeeping_dir
        self.tau_scaling, self.tau_alpha = tau_scaling, float(tau_alpha)
        self._taus: dict[int, tuple[float, float]] = {}  # each round's (uplink, downlink) threshold
        self._scaling_checked = False
        if tau_scaling == "effective":  # with the paper's scaling the thresholds are known once |S_t| is
            for line in self.threshold_warnings(self.up_tau, self.downlink.tau if self.downlink else 0.0):
                log(WARNING, "%s: %s", type(self).__name__, line)
        self.book: ClientBook | None = None
        self._down_codec = None
        self._pending: dict[str, dict[str, Any]] = {}  # this round: what each sampled client will hold

    def threshold_warnings(self, up_tau: float, down_tau: float) -> list[str]:
        """Why this round's effective thresholds cannot fire (:func:`pollen.lazy.rules.threshold_warnings`)."""
        down_rule = self.downlink.rule if self.downlink is not None else "none"
        return threshold_warnings(self.up_rule, up_tau, self.compressor, self.error_feedback, down_rule, down_tau)

    @property
    def bidirectional(self) -> bool:
        return self.downlink is not None

    def extra_summary(self) -> dict[str, Any]:
        summary = super().extra_summary()
        scaling = "" if self.tau_scaling == "effective" else f" / (alpha={self.tau_alpha:g} x sampled clients)"
        summary["uplink threshold"] = f"tau={self.up_tau:g}{scaling}, reference {self.ref_mode}"
        summary["downlink"] = "dense (the full model)" if self.downlink is None else self.downlink.describe()
        summary["bookkeeping"] = "RAM" if self.bookkeeping_dir is None else self.bookkeeping_dir
        return summary

    # ------------------------------------------------------------------ state per client
    def on_layout(self, layout: Any) -> None:
        if self.book is None:
            kinds = ("up-ref",) + (Downlink.MIRRORS if self.bidirectional else ())
            self.book = ClientBook(layout.dim, directory=self.bookkeeping_dir, kinds=kinds)

    def _codec(self, name: str, ratio: float) -> Any:
        return make_codec(name, topk_ratio=ratio, segments=self.layout.segments, granularity=self.granularity)

    def _count(self, server_round: int, event: str, n: int = 1) -> None:
        events = self.accounting.round(server_round).method.setdefault("lazy_events", {})
        events[event] = events.get(event, 0) + n

    def _note_rel(self, server_round: int, direction: str, rel: float) -> None:
        self.accounting.round(server_round).method.setdefault("lazy_rel", {}).setdefault(direction, []).append(
            round(float(rel), 6)
        )

    # ------------------------------------------------------------------ downlink
    def round_taus(self, server_round: int) -> tuple[float, float]:
        """This round's (uplink, downlink) thresholds: as given, or ``C / (alpha |S_t|)`` (``tau_scaling="paper"``)."""
        if server_round not in self._taus:
            down = self.downlink.tau if self.downlink is not None else 0.0
            if self.tau_scaling == "paper":
                sampled = max(self.accounting.round(server_round).sampled, 1)
                scale = 1.0 / (self.tau_alpha * sampled)
                self._taus[server_round] = (self.up_tau * scale, down * scale)
                if not self._scaling_checked:
                    self._scaling_checked = True
                    for line in self.threshold_warnings(*self._taus[server_round]):
                        log(WARNING, "%s (C / (alpha x %d sampled clients)): %s", type(self).__name__, sampled, line)
            else:
                self._taus[server_round] = (self.up_tau, down)
        return self._taus[server_round]

    def train_config(self, server_round: int) -> dict[str, Any]:
        self._taus = {r: taus for r, taus in self._taus.items() if r >= server_round - 1}
        # the rest of the uplink's entries are the LazyUplink part's (the base adds them)
        return {protocol.CFG_LAZY_UP_TAU: self.round_taus(server_round)[0]}

    def node_content(self, server_round: int, node: int, shared: RecordDict) -> RecordDict:
        """The client's own config (its reference checksum) and model: dense, full, or a judged increment."""
        key = self.sampler.key(node)
        config = ConfigRecord(dict(shared.config_records[self.configrecord_key]))
        ref = self.book.get("up-ref", key)
        if ref is not None and self.ref_mode == "consecutive-only" and self.ledger.round_of(key) != server_round - 1:
            ref = None
        if ref is not None:
            config[protocol.CFG_LAZY_REF_SUM] = checksum(ref)
        pending: dict[str, Any] = {"ref": ref}
        content = RecordDict({self.configrecord_key: config})
        if not self.bidirectional:
            config[protocol.CFG_LAZY_DOWN] = "dense"
            content[self.arrayrecord_key] = shared.array_records[self.arrayrecord_key]
            self._count(server_round, "down-dense")
        elif not self.book.has("x", key):
            config[protocol.CFG_LAZY_DOWN] = "full"
            content[self.arrayrecord_key] = shared.array_records[self.arrayrecord_key]
            pending.update(x=self.params.copy(), c_prev=None, error=None)
            self._count(server_round, "down-full")
        else:
            if self._down_codec is None:
                self._down_codec = self.downlink.make_codec(self.layout.segments)
            step, payload = self.downlink.step(
                self._down_codec,
                self.params,
                self.book.get("x", key),
                self.book.get("c-prev", key),
                self.book.get("error", key),
                tau=self.round_taus(server_round)[1],
            )
            config[protocol.CFG_LAZY_DOWN] = step.kind
            config[protocol.CFG_LAZY_APPLY] = step.apply
            config[protocol.CFG_LAZY_X_SUM] = checksum(step.new_x)
            if payload is not None:
                down, meta = payload_to_records(payload, self.granularity)
                content[protocol.DOWN_RECORD], content[protocol.DOWN_META_RECORD] = down, meta
            if self.buffers:
                content[protocol.DOWN_BUFFERS_RECORD] = self._buffers_record()
            pending.update(x=step.new_x, c_prev=step.new_c_prev, error=step.new_error)
            self._count(server_round, f"down-{step.kind}")
            if step.rel == step.rel:  # not NaN: there was a reference to judge against
                self._note_rel(server_round, "down", step.rel)
            if step.kind != "send":
                self._count(server_round, "down-flags")
        self._pending[key] = pending
        return content

    def _buffers_record(self) -> ArrayRecord:
        cached = getattr(self, "_buffers_cache", None)
        if cached is None or cached[0] is not self.model.last_returned:
            self._buffers_cache = (self.model.last_returned, arrays_to_record(self.buffers))
        return self._buffers_cache[1]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Any
    ) -> Iterable[Message]:
        self._pending = {}
        return super().configure_train(server_round, arrays, config, grid)

    # ------------------------------------------------------------------ uplink
    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Resolve each reply against its client's stored copies, screen, then FedAMS's step on the mean."""
        phase = self.replies.phase_of(server_round)
        usable, commits = [], {}
        for update in self.collect(server_round, replies, phase=phase):
            try:
                commits[id(update)] = self._resolve(server_round, update)
            except Exception as err:  # noqa: BLE001 - nothing of the client's is kept; its copies of a round back still match
                reason = (
                    str(err) if isinstance(err, ReplyRejected) else f"cannot be applied: {type(err).__name__}: {err}"
                )
                self.replies.reject(server_round, update.node_id, reason)
                continue
            usable.append(update)
        self._pending = {}
        kept = self.screened(server_round, usable)
        for update in kept:  # both sides hold the same copies only if the round commits
            self.transaction.stage(server_round, lambda u=update: self._commit(u.client_key, *commits[id(u)]))
        return self.apply_updates(server_round, kept, None)

    def after_round(self, server_round: int, updates: list[Any]) -> None:
        """The book's size. (Its copies were committed by the round's transaction: a skipped, failed or
        rolled-back round commits none, every client keeps the copies the server holds of a round back, and
        the ledger tells it that its upload was not applied.)"""
        if self.book is not None:
            self.accounting.round(server_round).server_state_bytes = self.book.memory_bytes()

    def _resolve(self, server_round: int, update: Any) -> tuple[str, Any, dict[str, Any]]:
        """Turn a reply into the vector the server applies; return what :meth:`_commit` keeps if it is used.

        A reply rejected here or by the outlier screen leaves the server's copies of its client as they
        were: the client keeps its copies of one round back, and the next round's checksums pick those.
        """
        key = update.client_key
        pending = self._pending.pop(key, None)
        if pending is None:
            raise ReplyRejected("no downlink was prepared for this client this round")
        flags = update.flags
        if flags.get(protocol.FLAG_RESYNC):
            if not self.bidirectional:
                raise ReplyRejected("a resync request, but this method sends the full model every round")
            if update.delta is not None or flags.get(protocol.FLAG_SKIP) or flags.get(protocol.FLAG_AA):
                raise ReplyRejected("a resync request together with an update or another flag")
            self._count(server_round, "resync")
            for kind in ("x", "c-prev", "error"):
                self.book.put(kind, key, None)
            raise ReplyRejected(
                "the client has no copy of the model that matches the server's mirror: it gets the full model next time"
            )
        if flags.get(protocol.FLAG_SKIP) and flags.get(protocol.FLAG_AA):
            raise ReplyRejected("both the skip and the aa flag")
        kind = "skip" if flags.get(protocol.FLAG_SKIP) else "aa" if flags.get(protocol.FLAG_AA) else "send"
        if kind != "send" and kind != {"nla": "skip", "aa": "aa"}.get(self.up_rule):
            raise ReplyRejected(f"a {kind} flag, but this method's uplink rule is {self.up_rule!r}")
        if kind == "send" and update.delta is None:
            raise ReplyRejected("neither an update nor a skip flag")
        try:
            used, new_ref = replay(kind, update.delta, pending["ref"])
        except ValueError as err:
            raise ReplyRejected(str(err)) from None
        up_tau = self.round_taus(server_round)[0]
        if kind == "aa" and norm64(update.delta - pending["ref"]) > up_tau * norm64(pending["ref"]):
            raise ReplyRejected(f"an aa flag on a change larger than tau={up_tau:g} times the reference")
        if kind != "send":
            self._count(server_round, "up-flags")
        self._count(server_round, f"up-{kind}")
        if pending["ref"] is not None and update.delta is not None:  # the change the client's rule judged
            self._note_rel(
                server_round, "up", norm64(update.delta - pending["ref"]) / max(norm64(pending["ref"]), 1e-300)
            )
        update.delta = used
        update.norm = norm64(used)
        return kind, new_ref, pending

    def _commit(self, key: str, kind: str, new_ref: Any, pending: dict[str, Any]) -> None:
        """Both sides now hold the same copies of ``key``: its last upload and, if bidirectional, its model."""
        if kind != "skip":
            self.book.put("up-ref", key, new_ref)
        if self.bidirectional:
            for kind_, name in (("x", "x"), ("c-prev", "c_prev"), ("error", "error")):
                self.book.put(kind_, key, pending[name])


__all__ = ["EVENTS", "FedLazy"]
