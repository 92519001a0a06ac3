"""Fed-LAMB, Mime-LAMB and their baselines Fed-AMS, Mime, Adp-Fed and Fed-SGD (spec ``papers/fedlamb.md`` §4.2-4.5).

Clients run layer-wise adaptive local steps (:class:`pollen.clientside.lamb.LocalLAMB`) whose
denominator is a *global* second moment ``v_hat`` that the server keeps and broadcasts:

- ``fed-lamb``: clients upload their model and, on sync rounds, their local ``v`` (extra ``v``);
  the server averages the models (unweighted, buffers too) and sets
  ``v_hat <- max(v_hat, mean_i v_i)`` (Algorithm 1 lines 16, 19-20);
- ``mime-lamb``: on sync rounds clients upload the full-batch gradient of their data at the
  broadcast model (extra ``grad``); the server keeps ``v <- beta2 v + (1 - beta2) mean(G)^2`` and
  ``v_hat <- max(v_hat, v)`` (lines 17, 21-23);
- ``fed-ams`` / ``mime``: the same with the plain AMSGrad local step (no trust ratio), each differing
  from its LAMB variant in exactly that one component (§4.5);
- ``fed-sgd``: plain local SGD (no momentum), ``x <- mean_i x_i`` (§4.5 a);
- ``adp-fed``: plain local SGD and the server Adam of Algorithm 2 on ``mean_i (x_i - x)``
  (:func:`~pollen.optim.adpfed_adam`: ``v_0 = eps``, no bias correction; §4.5 d).

``v_hat`` starts at ``eps`` and only grows; it is sent to a client only when that client does not hold
the current version (a per-client downlink), and a client that lost it (a failed reply) gets it again.
Sync rounds are every ``sync_every`` (Z) rounds: ``r = 1, 1+Z, ...`` (``sync_phase="first"``, the
spec's recommended reading, §9 C2) or ``r = Z, 2Z, ...`` (``"last"``). Client momentum ``m_i`` stays
with the client across rounds (client state). Sign convention: the server's step is the mean of
``x_i - x`` with rate 1, i.e. ``x <- mean_i x_i``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import RecordDict

from pollen.core import state_fields as fields
from pollen.optim import adpfed_adam, sgd
from pollen.strategies.engine.aggregation import Aggregator
from pollen.strategies.engine.declared import COUNT, COUNTS, MOMENT
from pollen.strategies.engine.parts import EngineParts
from pollen.strategies.engine.replies import ClientUpdate, Extra, ReplySpec
from pollen.strategies.engine.sampling import ClientSampler
from pollen.strategies.engine.screening import peak_magnitude
from pollen.strategies.engine.strategy import (
    TRAIN_PHASE,
    AdaptiveStrategy,
    MetricsAggregationFn,
)
from pollen.strategies.engine.uplink import Uplink
from pollen.wire import protocol
from pollen.wire.protocol import (
    ADAPTIVE_LOCAL_STEP as LOCAL_STEP,
)
from pollen.wire.protocol import (
    CFG_BETA_1,
    CFG_BETA_2,
    CFG_EPS,
    CFG_LOCAL_VHAT,
    CFG_STAT,
    CFG_SYNC,
    CFG_TRUST_RATIO,
    CFG_VHAT_KEEP,
    CFG_VHAT_VERSION,
)
from pollen.wire.records import arrays_to_record

SYNC_PHASES = ("first", "last")
#: What the local step divides by while ``v_hat`` is still its initial ``eps`` (round 1 with ``sync_phase="first"``).
ROUND1_DENOMINATORS = ("local-v", "eps")
#: What Mime's server takes into ``v_hat``: its EMA ``v`` as the paper writes it, or ``v / (1 - beta2^k)``.
SERVER_V_READINGS = ("plain", "bias-corrected")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _as_float32(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` (float64) as float32; ``FloatingPointError`` when any is not finite there."""
    peak = peak_magnitude(values) if values.size else 0.0  # NaN if any is NaN
    if not peak <= _FLOAT32_MAX:  # NaN fails too
        raise FloatingPointError(f"{what} would be {peak:.3g}, outside float32's range; the round is rolled back")
    return values.astype(np.float32)


_MEAN_BLOCK = 1 << 15  # elements of the float64 sum kept in cache while every upload is added to it


def mean_float64(stats: list[np.ndarray]) -> np.ndarray:
    """``np.mean(np.stack(stats), axis=0, dtype=np.float64)``, bit for bit, without the stack.

    NumPy's mean over the first axis adds the rows one after another in float64 to a sum that starts at
    +0.0 (so a coordinate where every row holds -0.0 comes out +0.0) and divides the sum by their count;
    this does the same a block at a time, so only the float64 result is d-sized (the stack was
    ``len(stats)`` float32 copies of the model's size, and its reduction ran at a fraction of the speed of
    these adds).
    """
    count = len(stats)
    mean = np.zeros(stats[0].shape[0], dtype=np.float64)
    for lo in range(0, mean.shape[0], _MEAN_BLOCK):
        block = mean[lo : lo + _MEAN_BLOCK]
        for values in stats:
            block += values[lo : lo + _MEAN_BLOCK]
        block /= count
    return mean


@dataclass(frozen=True)
class Variant:
    """What one method of the family uploads, which local step it runs and how the server steps."""

    name: str
    stat: str | None  # "v" (Fed-*), "grad" (Mime*) or None (no shared second moment)
    trust_ratio: bool  # LAMB (True) or AMSGrad (False) local step; unused by plain SGD
    server_adam: bool = False  # Adp-Fed: server Adam on the mean delta instead of x <- mean x_i

    @property
    def local_step(self) -> str:
        return LOCAL_STEP if self.stat is not None else "sgd"

    @property
    def local_rule(self) -> str:
        if self.stat is None:
            return "SGD"
        return "LAMB" if self.trust_ratio else "AMSGrad"


VARIANTS = {
    "fed-lamb": Variant("fed-lamb", "v", True),
    "mime-lamb": Variant("mime-lamb", "grad", True),
    "fed-ams": Variant("fed-ams", "v", False),
    "mime": Variant("mime", "grad", False),
    "adp-fed": Variant("adp-fed", None, False, server_adam=True),
    "fed-sgd": Variant("fed-sgd", None, False),
}


@dataclass(frozen=True)
class SyncReplies:
    """What a FedLAMB reply carries, by round: the variant's statistic (``v``, or Mime's ``grad``) as an extra on
    the rounds that synchronise ``v_hat`` (every ``sync_every``-th: the first of each period, or the last), and
    nothing else on the others (the strategy's ``reply_spec``: see :meth:`ReplySpec.for_round`)."""

    stat: str | None
    sync_every: int
    sync_phase: str

    def is_sync(self, server_round: int) -> bool:
        """Whether ``server_round`` synchronises ``v_hat`` (Z = 1: every round; never without ``v_hat``)."""
        if self.stat is None:
            return False
        if self.sync_phase == "first":
            return (server_round - 1) % self.sync_every == 0
        return server_round % self.sync_every == 0

    def for_round(self, server_round: int) -> ReplySpec:
        if self.is_sync(server_round):
            return ReplySpec(extras=(Extra(self.stat, size="model", nonnegative=self.stat == "v"),))
        return ReplySpec()


class FedLAMB(AdaptiveStrategy):
    """Locally adaptive training with a server-synchronised second moment ``v_hat``.

    Parameters
    ----------
    variant : str (default: "fed-lamb")
        ``fed-lamb``, ``mime-lamb``, ``fed-ams``, ``mime``, ``adp-fed`` or ``fed-sgd`` (see the
        module docstring).
    beta_1, beta_2 : float (default: 0.9, 0.999)
        Moment coefficients of the local step (and of Mime's server EMA and Adp-Fed's server Adam),
        in [0, 1).
    eps : float (default: 1e-8)
        ``v_hat``'s initial value and floor, > 0 (Adp-Fed: the server's ``v_0``).
    eta : float (default: 0.003)
        Adp-Fed's server learning rate eta_g (> 0; run-config ``server-lr``); the other variants
        average models (rate 1).
        Default 0.003 (chosen for drop-in use, measured with benchmarks/bench_dropin.py); the
        paper tunes eta_g in {0.001, 0.01} (its grid: 1e-4 to 0.1).
    weight_decay : float (default: 0.0)
        The local step's decoupled weight decay lambda, >= 0 (clients take it from run-config
        ``weight-decay``; kept here for the summary).
    sync_every : int (default: 1)
        Z: ``v_hat`` is synchronised every Z rounds (uploads of ``v``/``grad`` only then).
    sync_phase : str (default: "first")
        Which rounds sync: ``"first"`` (r = 1, 1+Z, ...) or ``"last"`` (r = Z, 2Z, ...).
    round1_denominator : str (default: "eps")
        The local step's denominator while ``v_hat`` is still its initial ``eps`` (round 1 when syncing
        first): ``"eps"``, the paper's literal ``v_hat_0 = eps`` (line 2; a plain AMSGrad step then is
        ``alpha * m / sqrt(eps)``, a 10^4-fold jump at eps = 1e-8), or ``"local-v"``, the authors' code:
        ``sqrt(max(v_hat, v))`` with the client's own running ``v`` (spec ``papers/fedlamb.md`` §9 A4/B5).
        The app's defaults: ``local-v`` for Fed-AMS and Mime (so the baselines do not degenerate),
        ``eps`` for Fed-LAMB and Mime-LAMB (whose trust ratio normalises the jump away).
    server_v : str (default: "plain")
        What Mime's and Mime-LAMB's server takes into ``v_hat <- max(v_hat, .)`` after its EMA
        ``v <- beta2 v + (1 - beta2) mean(G)^2``: ``"plain"``, ``v`` itself (Algorithm 1 lines 22-23, no
        bias correction: ``v_k ~ (1 - beta2^k) mean(G)^2``, so with beta2 = 0.999 the first rounds' AMSGrad
        steps are about ``1 / sqrt(1 - beta2^k)`` = 30x an Adam step), or ``"bias-corrected"``,
        ``v / (1 - beta2^k)`` with k the number of synchronisations so far (Adam's correction; spec
        ``papers/fedlamb.md`` §9 C3). ``v`` itself is kept uncorrected either way. The app's default:
        ``bias-corrected`` for Mime (the plain reading makes the baseline degenerate), ``plain`` for
        Mime-LAMB (its trust ratio normalises the scale away). Unused by the other variants.
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes : float, int
        Sampling: Flower's ``FedAvg`` arguments, with its defaults and meaning (:class:`AdaptiveStrategy`).
    weighted_by_key, arrayrecord_key, configrecord_key : str
        Flower's weight metric and record names, with its defaults and meaning (:class:`AdaptiveStrategy`).
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : Callable[[list[RecordDict], str], MetricRecord] | None
        Flower's metric aggregation functions; ``None``: each metric's weighted mean (:class:`AdaptiveStrategy`).
    aggregation, aggregator, uplink, parts
        The engine's settings and parts (:class:`AdaptiveStrategy`,
        :class:`~pollen.strategies.engine.parts.EngineParts`); its default
        sampler asks each new node for its client id (each client's ``v_hat`` version is kept by its stable id).
    """

    secagg_refusal = (
        "its server takes the max of the clients' second moments and its clients share their moments one by one; "
        "a max is not a sum"
    )
    privacy_refusal = (
        "its clients share their Adam/LAMB moments with the server each round, and those moments are no clipped, "
        "noised mean of updates"
    )
    async_refusal = (
        "its server moments are synchronised with every client in sync rounds, and its replies differ by round "
        "(moments only in a sync round), which a job applied steps later cannot keep"
    )

    streaming = False  # the extras of every reply are needed after the step
    state_fields = {
        "v_hat": MOMENT,
        "v": MOMENT,
        "v_syncs": COUNT,
        "v_hat_version": COUNT,
        "client_versions": COUNTS,
    }

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
        variant: str = "fed-lamb",
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        sync_every: int = 1,
        sync_phase: str = "first",
        round1_denominator: str = "eps",
        server_v: str = "plain",
        eta: float = 0.003,
        aggregation: str = "mean",
        aggregator: str | Aggregator = "mean",
        uplink: Uplink | None = None,
        parts: EngineParts | None = None,
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r} is unknown; allowed: {', '.join(VARIANTS)}")
        for name, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value!r} is out of range; allowed: a number in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps={eps!r} is out of range; allowed: a number > 0")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay!r} is out of range; allowed: a number >= 0")
        if not (isinstance(sync_every, int) and sync_every >= 1):
            raise ValueError(f"sync_every={sync_every!r} is out of range; allowed: an integer >= 1")
        if sync_phase not in SYNC_PHASES:
            raise ValueError(f"sync_phase={sync_phase!r} is unknown; allowed: {', '.join(SYNC_PHASES)}")
        if round1_denominator not in ROUND1_DENOMINATORS:
            raise ValueError(
                f"round1_denominator={round1_denominator!r} is unknown; allowed: {', '.join(ROUND1_DENOMINATORS)}"
            )
        if server_v not in SERVER_V_READINGS:
            raise ValueError(f"server_v={server_v!r} is unknown; allowed: {', '.join(SERVER_V_READINGS)}")
        chosen = VARIANTS[variant]
        if chosen.server_adam:
            optimizer = adpfed_adam(eta=eta, beta_1=beta_1, beta_2=beta_2, v0=eps)
        else:
            optimizer = sgd(eta=1.0)
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
        self.variant = chosen
        self.streaming = chosen.stat is None  # no extras to keep: replies are summed as they are read
        self.beta_1, self.beta_2, self.eps, self.weight_decay = (
            float(beta_1),
            float(beta_2),
            float(eps),
            float(weight_decay),
        )
        self.sync_every, self.sync_phase = sync_every, sync_phase
        self.reply_spec = SyncReplies(chosen.stat, sync_every, sync_phase)
        self.round1_denominator = round1_denominator
        self.server_v = server_v
        self.v_syncs = 0  # Mime's server EMA updates committed so far (k of the bias correction)
        self.v_hat: np.ndarray | None = None
        self.v: np.ndarray | None = None  # Mime's server EMA of the squared mean gradient
        self.v_hat_version = 0
        self.client_versions: dict[str, int] = {}
        self._sent_versions: dict[int, int] = {}  # round -> the v_hat version its train messages carried

    # ------------------------------------------------------------------ rounds
    def is_sync_round(self, server_round: int) -> bool:
        """Whether ``server_round`` synchronises ``v_hat`` (Z = 1: every round; never without ``v_hat``)."""
        return self.reply_spec.is_sync(server_round)

    def on_layout(self, layout: Any) -> None:
        if self.v_hat is None and self.variant.stat is not None:
            self.v_hat = np.full(layout.dim, self.eps, dtype=np.float32)
            self.v = np.zeros(layout.dim, dtype=np.float32)
            self.v_hat_version = 1

    def train_config(self, server_round: int) -> dict[str, Any]:
        self._sent_versions[server_round] = self.v_hat_version
        if self.variant.stat is None:  # Fed-SGD / Adp-Fed: plain local SGD, no momentum or decay (§4.5 a, d)
            return {protocol.CFG_LOCAL_STEP: self.variant.local_step, "momentum": 0.0, "weight-decay": 0.0}
        return {
            protocol.CFG_LOCAL_STEP: LOCAL_STEP,
            CFG_VHAT_VERSION: self.v_hat_version,
            CFG_VHAT_KEEP: not self.sends_v_hat_always,
            CFG_SYNC: self.is_sync_round(server_round),
            CFG_STAT: self.variant.stat,
            CFG_TRUST_RATIO: self.variant.trust_ratio,
            CFG_BETA_1: self.beta_1,
            CFG_BETA_2: self.beta_2,
            CFG_EPS: self.eps,
            CFG_LOCAL_VHAT: self.round1_denominator == "local-v" and self.v_hat_version == 1,
        }

    @property
    def sends_v_hat_always(self) -> bool:
        """Whether every train message carries ``v_hat`` (one synchronisation a round: it changes with nearly
        every round, so a client would hold its version only by chance); then clients do not keep it."""
        return self.sync_every == 1

    def node_content(self, server_round: int, node: int, shared: RecordDict) -> RecordDict:
        """The model and config; ``v_hat`` too when this client does not hold its current version (always, when
        :attr:`sends_v_hat_always`)."""
        if self.variant.stat is None:
            return shared
        if not self.sends_v_hat_always and self.client_versions.get(self.sampler.key(node)) == self.v_hat_version:
            return shared
        content = RecordDict(dict(shared.items()))
        content[protocol.extra_record("v_hat")] = self._v_hat_record()
        return content

    def _v_hat_record(self) -> Any:
        cached = getattr(self, "_v_hat_cache", None)
        if cached is None or cached[0] != self.v_hat_version:  # built once per version, shared by messages
            self._v_hat_cache = (self.v_hat_version, arrays_to_record({protocol.EXTRA_ARRAY: self.v_hat}))
        return self._v_hat_cache[1]

    def aggregate_deltas(self, server_round: int, updates: list[ClientUpdate]) -> np.ndarray:
        """The mean delta; on sync rounds first the new ``v`` / ``v_hat``, formed and checked inside the
        server step's transaction (a round whose moments would leave float32 fails and is rolled back)."""
        stats = [u.extras[self.variant.stat] for u in updates if self.variant.stat in u.extras]
        if self.variant.stat is not None and self.is_sync_round(server_round) and stats:
            moments = self._moments_after(stats)
            self.transaction.stage(server_round, lambda: self._take_moments(*moments))
        return super().aggregate_deltas(server_round, updates)

    def _take_moments(self, v: np.ndarray, new_v_hat: np.ndarray) -> None:
        """Commit a sync round's moments (staged by :meth:`aggregate_deltas`; run only if its step commits)."""
        self.v = v
        self.v_syncs += self.variant.stat == "grad"
        if not np.array_equal(new_v_hat, self.v_hat):
            self.v_hat = new_v_hat
            self.v_hat_version += 1

    def after_round(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """Record who holds which ``v_hat``: a client whose reply was applied holds the version it was sent."""
        sent = self._sent_versions.pop(server_round, self.v_hat_version)
        if self.variant.stat is None:
            return
        replied = {u.client_key for u in updates}
        for node in self._asked_train_nodes(server_round):
            key = self.sampler.key(node)
            if key in replied:
                self.client_versions[key] = sent
            else:  # a failed client may have lost its state: send v_hat again next time
                self.client_versions.pop(key, None)
        self.accounting.round(server_round).train_metrics["v-hat-version"] = float(self.v_hat_version)

    def _moments_after(self, stats: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``(v, v_hat)`` after this round's statistics, in float64 and checked before they may reach state.

        Fed-*: ``v_hat <- max(v_hat, mean v_i)`` (line 20); Mime*: ``v <- beta2 v + (1 - beta2) mean(G)^2``,
        then the running max (lines 22-23) of ``v`` or, with ``server_v="bias-corrected"``, of
        ``v / (1 - beta2^k)`` (k counting this synchronisation). The mean and its square are formed in
        float64, where a square of a float32 value cannot overflow; ``FloatingPointError`` when the result
        is not finite in float32.
        """
        mean = mean_float64(stats)
        if self.variant.stat == "v":
            v, candidate = self.v, _as_float32(mean, "the mean uploaded second moment")
        else:
            ema = self.beta_2 * self.v.astype(np.float64) + (1.0 - self.beta_2) * np.square(mean)
            v = candidate = _as_float32(ema, "Mime's server second moment v")
            if self.server_v == "bias-corrected":
                correction = 1.0 - self.beta_2 ** (self.v_syncs + 1)
                candidate = _as_float32(ema / correction, "Mime's bias-corrected second moment")
        return v, np.maximum(self.v_hat, candidate)

    def _asked_train_nodes(self, server_round: int) -> list[int]:
        return self.replies.asked(server_round, TRAIN_PHASE)

    def extra_summary(self) -> dict[str, Any]:
        if self.variant.stat is None:
            server = "server Adam (v_0 = eps, no bias correction)" if self.variant.server_adam else "x <- mean x_i"
            return {"variant": f"{self.variant.name} (local SGD, {server})"}
        return {
            "variant": f"{self.variant.name} (uploads {self.variant.stat}, {self.variant.local_rule} local step)",
            "v_hat": f"eps={self.eps:g}, synchronised every {self.sync_every} round(s) ({self.sync_phase})",
            "before the first v_hat": f"denominator {self.round1_denominator}",
            **({"server v": self.server_v} if self.variant.stat == "grad" else {}),
        }

    # ------------------------------------------------------------------ state
    def check_loaded(self, values: Mapping[str, Any], layout: Any, server_round: int | None) -> None:
        """A loaded state holds ``v_hat`` and ``v`` exactly when the variant keeps them and the model is known,
        ``v_hat >= eps`` (it starts at eps and only grows), its version at most one per round past the first,
        and no client holding a version the server never had."""
        at = lambda name: fields.join("strategy", name)  # noqa: E731
        keeps = self.variant.stat is not None and layout is not None
        for name in ("v_hat", "v"):
            if keeps and name not in values:
                raise fields.StateError(at(name), f"is missing; {self.variant.name} keeps it once the model is known")
            if not keeps and name in values:
                raise fields.StateError(at(name), f"is saved but {self.variant.name} keeps no {name} here")
        if not keeps:
            return
        if values["v_hat"].min() < np.float32(self.eps):
            index = int(np.argmin(values["v_hat"]))
            raise fields.StateError(
                at("v_hat"), f"holds {values['v_hat'][index]!r} at index {index}; expected values >= eps={self.eps:g}"
            )
        syncs = values.get("v_syncs", 0)
        if server_round is not None and syncs > server_round:
            raise fields.StateError(
                at("v_syncs"), f"is {syncs}; expected at most the checkpoint's round, {server_round}"
            )
        version = values.get("v_hat_version", 0)
        high = fields.MAX_COUNT if server_round is None else server_round + 1
        if not 1 <= version <= high:
            raise fields.StateError(at("v_hat_version"), f"is {version}; expected an integer in [1, {high}]")
        for key, held in values.get("client_versions", {}).items():
            if held > version:
                raise fields.StateError(
                    fields.join(at("client_versions"), key), f"is {held}; expected at most v_hat_version={version}"
                )
