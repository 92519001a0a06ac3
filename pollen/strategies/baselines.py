"""Flower's own FedAvg / FedAdam / FedYogi / FedAdagrad, with pollen's byte accounting, screening and state.

The baselines are Flower's implementations unchanged (``flwr.serverapp.strategy``);
``Metered`` observes the messages going out and the replies coming in, so the app
reports the same per-round numbers (sampled, replies, failures, bytes each way) for
every method. It holds back replies that cannot be trusted before Flower aggregates
them, with the same reader pollen's strategies use (:func:`pollen.strategies.engine.replies.read_reply`:
names, shapes, dtypes, finite values after the cast, a positive bounded ``num-examples``),
plus whatever Flower's own checks or aggregation would raise on, so that no reply can fail the
round for the others: exactly one ArrayRecord and one MetricRecord, every array of exactly the
model's shape (a 0-d buffer sent as shape (1,) would broadcast into Flower's sum), the same metrics
record name and metric names in every reply, each metric a number in all of them or a list of one
length in all of them (Flower adds them up key by key), a positive weight under the strategy's
``weighted_by_key``. They count as failures, with a reason. If Flower's step still leaves NaN or Inf
in its model or moments, they are put back and the round fails (the model is unchanged).
It also runs pollen's round loop (resume from a checkpoint) and has ``state_dict`` /
``load_state_dict`` (Flower's moments, the global ``random`` state Flower samples with).

Each class takes its Flower class's arguments, as the installed Flower defines them (its signature,
shown by ``help()``, is Flower's plus ``outlier_rule`` and ``outlier_factor``), and reads a reply's model
from its one ArrayRecord whatever its name, as Flower does.
"""

from __future__ import annotations

import inspect
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedYogi

from pollen.core import state_fields as fields
from pollen.core.layout import ModelLayout, TensorSpec, looks_like_buffer
from pollen.strategies.engine.accounting import Accounting
from pollen.strategies.engine.collector import (
    EVALUATE_PHASE,
    TRAIN_PHASE,
    ReplyCollector,
    evaluation_reading,
    positive_weight,
    reason_of,
)
from pollen.strategies.engine.declared import ARRAYS, load_field, save_declared
from pollen.strategies.engine.flower_wrappers import refuse_dp_wrapper
from pollen.strategies.engine.messages import count_sent
from pollen.strategies.engine.model import MAX_NDIM, MAX_TENSORS, saved_dtype
from pollen.strategies.engine.parts import EngineParts, claim
from pollen.strategies.engine.replies import ClientUpdate, ReplyRejected, count_records, read_reply
from pollen.strategies.engine.rounds import RoundLoop
from pollen.wire.records import record_to_arrays


class Metered(RoundLoop):
    """Mixin: count messages and bytes around a Flower strategy's own steps, screen replies, keep state.

    Replies go through the same :class:`~pollen.strategies.engine.collector.ReplyCollector` as pollen's
    strategies (asked nodes per round, one reply each, rejections with reasons, silent nodes counted)
    and the same :class:`~pollen.strategies.engine.screening.UpdateScreen`; an outlier is rejected (Flower's
    aggregation cannot take a clipped reply).

    Parameters
    ----------
    *args, **kwargs
        The Flower class's arguments (``FedAvg``'s ``fraction_train`` ... ``evaluate_metrics_aggr_fn``,
        ``FedAdam``'s ``eta`` ...), passed to it unchanged; each class's signature lists them.
    parts : EngineParts | None (default: None)
        pollen's parts it uses (:class:`~pollen.strategies.engine.parts.EngineParts`): the outlier screen of the
        replies' update norms (``UpdateScreen(rule="reject" | "off", factor=...)``; Flower's aggregation cannot
        take a clipped reply, so ``"clip"`` rejects too), the sampler of the reply collector, the accounting,
        the round driver and the checkpoint; the other parts are Flower's own here.
    """

    #: Flower's own state of the FedOpt family (FedAvg keeps none of it), written and checked by
    #: :mod:`pollen.strategies.engine.declared`.
    state_fields = {"current_arrays": ARRAYS, "m_t": ARRAYS, "v_t": ARRAYS}

    def __init__(self, *args: Any, parts: EngineParts | None = None, **kwargs: Any) -> None:  # noqa: D107
        super().__init__(*args, **kwargs)
        if parts is not None and not isinstance(parts, EngineParts):
            raise ValueError(f"parts={parts!r} is not an EngineParts; allowed: EngineParts(...) or None")
        chosen = (parts or EngineParts()).filled()
        claim(chosen, self)
        self.accounting, self.screen, self.transaction = chosen.accounting, chosen.screen, chosen.transaction
        self.driver, self.checkpoint = chosen.driver, chosen.checkpoint
        self.replies = ReplyCollector(chosen.sampler, lambda: self.accounting)
        self._started: dict[int, float] = {}
        self._layout: ModelLayout | None = None
        self._params: np.ndarray | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give a metered Flower class the signature it takes: its Flower class's, then ``parts``."""
        super().__init_subclass__(**kwargs)
        flower = next((base for base in cls.__mro__ if base.__module__.startswith("flwr.")), None)
        if flower is None or "__init__" in cls.__dict__:
            cls.__signature__ = None  # its own __init__ says what it takes
            return
        own = [p for p in inspect.signature(Metered.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY]
        cls.__signature__ = inspect.Signature([*inspect.signature(flower).parameters.values(), *own])

    def summary(self) -> None:
        """Flower's summary; inside one of Flower's DP wrappers a server optimiser is refused first."""
        self._refuse_dp_wrapper()
        super().summary()

    def _refuse_dp_wrapper(self) -> None:
        """FedAvg's aggregate is a mean, and Flower's DP wrappers around it are DP-FedAvg; FedAdam, FedYogi and
        FedAdagrad step an optimiser on the noiseless mean first (:mod:`pollen.strategies.engine.flower_wrappers`)."""
        for flower in (FedAdam, FedYogi, FedAdagrad):
            if isinstance(self, flower):
                refuse_dp_wrapper(self, f"its server optimiser (Flower's {flower.__name__} step)")

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._refuse_dp_wrapper()
        self._started[server_round] = time.perf_counter()
        named = record_to_arrays(arrays)
        if self._layout is None:  # the model as the user gave it: its dtypes are the ones clients use
            self._layout = ModelLayout.from_arrays(named)
        self._params = self._layout.flatten(named)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        group = self.replies.ask(server_round, TRAIN_PHASE, [message.metadata.dst_node_id for message in messages])
        for message in messages:  # the collector knows an earlier round's reply by it
            message.metadata.group_id = group
        self.replies.note_sent(server_round, TRAIN_PHASE, messages)
        stats = self.accounting.round(server_round)
        stats.sampled = len(messages)
        count_sent(stats, messages)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        stats = self.accounting.round(server_round)
        received = self.replies.from_asked(server_round, TRAIN_PHASE, replies)
        judged: list[tuple[Message, ClientUpdate | None]] = []
        for reply in received:
            try:
                if not reply.has_error():
                    stats.add_uplink(count_records(reply))
                judged.append((reply, self._judge(reply)))
            except Exception as err:  # noqa: BLE001 - a bad reply is a failure, never a crash
                self.replies.reject(server_round, reply.metadata.src_node_id, reason_of(err))
        judged = self._without_outliers(server_round, judged)
        done: dict[str, Any] = {}
        judged = self._same_metric_form(server_round, self._same_array_name(server_round, judged), "")
        usable = [reply for reply, _ in judged]
        for reply in usable:  # each has exactly one ArrayRecord (_judge)
            update_bytes = next(iter(reply.content.array_records.values())).count_bytes()
            stats.uplink_update_bytes += update_bytes
            stats.uplink_fp32_bytes += update_bytes
        stats.replies = len(usable)
        self.replies.missing(server_round, TRAIN_PHASE, received)
        self.replies.forget(server_round)
        accepted = [update for _, update in judged if update is not None]
        if usable:
            self.transaction.stage(
                server_round,
                lambda: self.screen.observe([u.norm for u in accepted], [u.record_norms for u in accepted]),
            )
        outcome = self.transaction.settle(
            server_round, usable, lambda: self._flower_step(server_round, usable, done), saved=self._flower_saved
        )
        if outcome.skipped is not None and usable:
            stats.fail(f"round skipped: {outcome.skipped}")
        if outcome.failed is not None:
            stats.fail(outcome.failed)
            log(WARNING, "aggregate_train: Flower's aggregation: %s; the model is unchanged", outcome.failed)
        result = done.get("result", (None, None)) if outcome.applied else (None, None)
        stats.train_metrics = dict(result[1] or {})
        if result[0] is not None:
            stats.count_grad_evals([next(iter(reply.content.metric_records.values())) for reply in usable])
        stats.train_seconds = time.perf_counter() - self._started.pop(server_round, time.perf_counter())
        return result

    def _flower_step(self, server_round: int, usable: list[Message], done: dict[str, Any]) -> None:
        """Flower's own aggregation as the round's server step; its result into ``done``; a non-finite model or
        moment fails the step (the transaction puts Flower's state back)."""
        result = super().aggregate_train(server_round, usable)
        _check_finite_result(result[0], {name: getattr(self, name, None) for name in ("m_t", "v_t")})
        done["result"] = result

    def _flower_saved(self) -> Callable[[], None]:
        """What puts Flower's state (its current model and moments) back: the references of now (Flower replaces
        its dicts when it steps, so the old ones are intact)."""
        before = {name: getattr(self, name, None) for name in self.state_fields}

        def put_back() -> None:
            for name, value in before.items():
                if hasattr(self, name):
                    setattr(self, name, value)

        return put_back

    def _without_outliers(
        self, server_round: int, judged: list[tuple[Message, ClientUpdate | None]]
    ) -> list[tuple[Message, ClientUpdate | None]]:
        """pollen's outlier screen, the one call every strategy makes (:meth:`UpdateScreen.filter`), on the updates
        and each floating-point buffer; outliers are rejected (Flower's aggregation cannot take a clipped reply)
        and the kept replies stay in the order they came."""
        read = {id(update): reply for reply, update in judged if update is not None}
        self.screen.set_model_norm(float(np.linalg.norm(self._params)) if self._params is not None else 0.0)
        kept = self.screen.filter(
            [update for _, update in judged if update is not None],
            lambda update, why: self.replies.reject(server_round, read[id(update)].metadata.src_node_id, why),
            f"round {server_round}",
            clip=False,
            reorder=False,
        )
        rejected = set(read) - {id(update) for update in kept}
        return [(reply, update) for reply, update in judged if update is None or id(update) not in rejected]

    def _judge(self, reply: Message) -> ClientUpdate | None:
        """The reply read by pollen's reader (``None`` before the model is known); ``ReplyRejected`` when
        Flower's checks or aggregation would refuse it."""
        content = reply.content
        if reply.has_error():
            raise ReplyRejected(f"client error: {reply.error.reason}")
        if len(content.array_records) != 1:  # Flower reads the model from it, whatever its name
            raise ReplyRejected(f"reply must carry exactly one ArrayRecord (it carries {len(content.array_records)})")
        if len(content.metric_records) != 1:
            raise ReplyRejected("reply must carry exactly one MetricRecord")
        metrics = next(iter(content.metric_records.values()))
        if positive_weight(metrics, self.weighted_by_key) is None:
            raise ReplyRejected(
                f"metrics lack a positive '{self.weighted_by_key}' (got {metrics.get(self.weighted_by_key)!r})"
            )
        if self._layout is None or self._params is None:
            return None
        update = read_reply(
            reply,
            client_key="",
            layout=self._layout,
            params=self._params,
            arrayrecord_key=next(iter(content.array_records)),
            weighted_by_key=self.weighted_by_key,
            weight_required=True,
            max_abs=self.screen.max_abs,
        )
        arrays = record_to_arrays(next(iter(content.array_records.values())))
        for spec in (*self._layout.trainable, *self._layout.buffers):
            if arrays[spec.name].shape != spec.shape:
                raise ReplyRejected(
                    f"array '{spec.name}' has shape {arrays[spec.name].shape}, the model has {spec.shape} "
                    "(Flower's aggregation needs the exact shape)"
                )
        return update

    def _same_array_name(self, server_round: int, judged: list[tuple[Message, Any]]) -> list[tuple[Message, Any]]:
        """Keep the replies whose one ArrayRecord has the name most others' have: Flower's aggregation needs one
        name in every reply (a reply with another fails the whole round there)."""
        names = [next(iter(reply.content.array_records)) for reply, _ in judged]
        common = Counter(names).most_common(1)[0][0] if names else ""
        for (reply, _), name in zip(judged, names):
            if name != common:
                why = (
                    f"its ArrayRecord is named '{name[:64]}', the others' '{common[:64]}' (Flower aggregates one name)"
                )
                self.replies.refuse(server_round, reply.metadata.src_node_id, why)
        return [item for item, name in zip(judged, names) if name == common]

    def _same_metric_form(
        self, server_round: int, judged: list[tuple[Message, Any]], phase: str
    ) -> list[tuple[Message, Any]]:
        """Keep the replies whose metrics have the form most others have: the record's name, the metric
        names, and for each metric a number or a list of one length (Flower raises on a mix)."""
        if not judged:
            return judged
        forms = [_metric_form(reply) for reply, _ in judged]
        common = Counter(forms).most_common(1)[0][0]
        kept = []
        for item, form in zip(judged, forms):
            if form == common:
                kept.append(item)
            elif phase == EVALUATE_PHASE:
                log(
                    WARNING,
                    "\t> evaluation reply from node %d skipped: %s",
                    item[0].metadata.src_node_id,
                    _form_difference(form, common),
                )
            else:
                self.replies.reject(server_round, item[0].metadata.src_node_id, _form_difference(form, common))
        return kept

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_evaluate(server_round, arrays, config, grid))
        group = self.replies.ask(server_round, EVALUATE_PHASE, [message.metadata.dst_node_id for message in messages])
        for message in messages:
            message.metadata.group_id = group
        self.replies.note_sent(server_round, EVALUATE_PHASE, messages)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        stats = self.accounting.round(server_round)
        usable = []
        for reply in self.replies.from_asked(server_round, EVALUATE_PHASE, replies):
            try:
                if reply.has_error():
                    continue
                stats.eval_uplink_bytes += sum(count_records(reply).values())
                if len(reply.content.metric_records) != 1:  # Flower's aggregation reads the only one
                    raise ReplyRejected("an evaluation reply must carry exactly one MetricRecord")
                evaluation_reading(reply.content, self.weighted_by_key)
            except Exception as err:  # noqa: BLE001
                log(WARNING, "\t> evaluation reply from node %d skipped: %s", reply.metadata.src_node_id, err)
                continue
            usable.append((reply, 0.0))
        usable = self._same_metric_form(server_round, usable, EVALUATE_PHASE)
        self.replies.forget(server_round)
        try:
            aggregated = super().aggregate_evaluate(server_round, [reply for reply, _ in usable])
        except Exception as err:  # noqa: BLE001
            log(WARNING, "aggregate_evaluate: Flower's aggregation failed (%s)", err)
            aggregated = None
        stats.evaluate_metrics = dict(aggregated or {})
        return aggregated

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Flower's moments and current model (declared in ``state_fields``), the global ``random`` state
        Flower samples with, the accounting, the screen and the model's layout."""
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "strategy": type(self).__name__,
            "random": [version, list(internal), gauss],
            "accounting": self.accounting.to_dict(),
            "screen": self.screen.state_dict(),
            **save_declared(self),
        }
        if self._layout is not None:
            specs = self._layout.trainable + self._layout.buffers
            state["model"] = [[spec.name, list(spec.shape), spec.dtype.str] for spec in specs]
        return state

    def load_state_dict(self, state: dict[str, Any], *, server_round: int | None = None) -> None:
        """Restore what :meth:`state_dict` wrote (same strategy class), all or nothing.

        Every field is checked first (a refusal is a ``ValueError`` naming the field and what was
        expected): the global ``random`` state well-formed, the model's names, shapes and dtypes (no
        array allocated from them), Flower's current model and moments as :func:`check_flower_array` holds
        them (each names the model's arrays, in the model's shapes and dtypes or float64, finite; the model
        within the hard limit ``max_abs``, the first moment ``m_t`` in ``[-max_abs, max_abs]``, the second
        ``v_t`` in ``[0, max_abs]``), the accounting's rounds up to ``server_round``.
        """
        where = "strategy"
        fields.mapping(state, where)
        name = fields.text(fields.at(state, "strategy", where), fields.join(where, "strategy"), most=200)
        if name != type(self).__name__:
            raise fields.StateError(fields.join(where, "strategy"), f"is {name!r}; expected {type(self).__name__!r}")
        kept = [key for key in self.state_fields if hasattr(self, key)]
        allowed = {"strategy", "random", "accounting", "screen", "model", *kept}
        for key in ("random", "accounting", "screen"):
            fields.at(state, key, where)
        unknown = sorted(set(state) - allowed)
        if unknown:
            raise fields.StateError(fields.join(where, unknown[0]), f"is not a field of {type(self).__name__}'s state")
        random_state = _random_state(state["random"], fields.join(where, "random"))
        layout = _saved_layout(state["model"], fields.join(where, "model")) if "model" in state else None
        values = {key: load_field(ARRAYS, key, state[key], dim=None, where=where) for key in kept if key in state}
        self._check_moments(values, layout, where)
        accounting = Accounting.from_dict(
            state["accounting"], fields.join(where, "accounting"), last_round=server_round
        )
        commit_screen = self.screen.prepare_load(state["screen"], fields.join(where, "screen"))

        random.setstate(random_state)
        for key, value in values.items():
            setattr(self, key, value)
        self.accounting = accounting
        commit_screen()
        if layout is not None:
            self._layout = layout

    def check_saved_arrays(self, named: dict[str, np.ndarray], state: dict[str, Any]) -> None:
        """The model a checkpoint saved with this strategy's ``state`` (its ``arrays``), held like everyone's:
        the arrays of the model ``state`` declares (``strategy/model``), each as :func:`check_flower_array`
        holds a model (its shape, its dtype or float64, finite, within the hard limit); a
        :class:`~pollen.core.state_fields.StateError` naming ``arrays/<name>`` if not. Called by
        :meth:`pollen.strategies.engine.resume.RunCheckpoint.load` before :meth:`load_state_dict`."""
        if "model" not in state:
            if named:
                raise fields.StateError("arrays", "is saved but the strategy's 'strategy/model' is missing")
            return
        layout = _saved_layout(state["model"], "strategy/model")
        _check_named(
            named,
            layout,
            "arrays",
            "model",
            self.screen.max_abs,
            what="the model the strategy saved ('strategy/model')",
        )

    def _check_moments(self, values: dict[str, Any], layout: ModelLayout | None, where: str) -> None:
        """Flower's current model and moments: each names the model's arrays, as :func:`check_flower_array`
        holds a model (``current_arrays``), a first moment (``m_t``) or a second moment (``v_t``)."""
        if values and layout is None:
            raise fields.StateError(fields.join(where, next(iter(values))), "is saved but 'model' is missing")
        if layout is None:
            return
        kinds = {"current_arrays": "model", "m_t": "first moment", "v_t": "second moment"}
        for key, named in values.items():
            if named:  # Flower starts a moment from zeros when it is empty
                _check_named(named, layout, fields.join(where, key), kinds[key], self.screen.max_abs)


#: The dtype Flower's arithmetic gives a model's array: its mean of an integer buffer (``int * float``) and
#: FedOpt's step (``np.float64`` scalars times ``float32`` arrays) are float64.
FLOWER_DTYPE = np.dtype(np.float64)


def check_flower_array(array: np.ndarray, spec: TensorSpec, where: str, max_abs: float, kind: str = "model") -> None:
    """One array of the model as Flower holds it (a :class:`~pollen.core.state_fields.StateError` naming
    ``where`` if not): the model's shape; the model's dtype or float64 (a moment: floating only); finite; a
    ``"model"`` value within the hard limit ``max_abs`` and the range of the model's dtype (finite once cast
    back to it, as the clients receive it), a ``"first moment"`` in ``[-max_abs, max_abs]``, a
    ``"second moment"`` in ``[0, max_abs]``."""
    model = kind == "model"
    allowed = {spec.dtype: "(the model's)"} if model or spec.dtype.kind == "f" else {}
    allowed.setdefault(FLOWER_DTYPE, "(Flower's arithmetic)")
    if not isinstance(array, np.ndarray) or array.dtype not in allowed:
        shown = f"dtype {array.dtype}" if isinstance(array, np.ndarray) else type(array).__name__
        expected = " or ".join(f"{dtype} {why}" for dtype, why in allowed.items())
        raise fields.StateError(where, f"has {shown}; expected {expected}")
    low, high, what = -max_abs, max_abs, "(the hard limit max_abs)"
    if kind == "second moment":
        low, what = 0.0, "(a second moment)"
    elif kind == "first moment":
        what = "(a first moment)"
    else:
        least, most = _dtype_span(spec.dtype)
        if least > low or most < high:
            low, high, what = max(low, least), min(high, most), f"(the range of the model's {spec.dtype})"
    fields.numeric_array(array, where, shape=spec.shape, low=low, high=high, what=what)


def _dtype_span(dtype: np.dtype) -> tuple[float, float]:
    """The values a model's numeric dtype holds (a float's finite range)."""
    if dtype.kind == "b":
        return 0.0, 1.0
    info = np.finfo(dtype) if dtype.kind == "f" else np.iinfo(dtype)
    return float(info.min), float(info.max)


def _check_named(
    named: dict[str, np.ndarray],
    layout: ModelLayout,
    where: str,
    kind: str,
    max_abs: float,
    what: str = "the model ('strategy/model')",
) -> None:
    """Arrays named exactly as ``layout``'s, each as :func:`check_flower_array` holds ``kind``."""
    specs = {spec.name: spec for spec in layout.trainable + layout.buffers}
    if set(named) != set(specs):
        odd = sorted(set(named) ^ set(specs))[0]
        raise fields.StateError(where, f"does not name the arrays of {what} ({odd[:64]!r} is in one of them only)")
    for name, array in named.items():
        if isinstance(array, np.ndarray) and array.shape != specs[name].shape:  # the saved model says which
            raise fields.StateError(
                fields.join(where, name), f"has shape {array.shape}; expected {specs[name].shape}, as in {what}"
            )
        check_flower_array(array, specs[name], fields.join(where, name), max_abs, kind)


def _random_state(value: Any, where: str) -> tuple:
    """The state of Python's ``random`` (Mersenne Twister: version 3, 624 words and a position, a gauss)."""
    version, internal, gauss = fields.sequence(value, where, length=3)
    fields.whole(version, fields.join(where, 0), low=3, high=3)
    words = fields.sequence(internal, fields.join(where, 1), length=625)
    checked = tuple(
        fields.whole(word, fields.join(fields.join(where, 1), i), high=2**32 - 1) for i, word in enumerate(words)
    )
    if checked[-1] > 624:
        raise fields.StateError(
            fields.join(fields.join(where, 1), 624), f"is {checked[-1]}; expected a position <= 624"
        )
    if gauss is not None:
        fields.finite_number(gauss, fields.join(where, 2))
    state = (3, checked, gauss)
    try:
        random.Random().setstate(state)
    except (TypeError, ValueError) as err:
        raise fields.StateError(where, f"is not a usable generator state ({err})") from None
    return state


def _saved_layout(value: Any, where: str) -> ModelLayout:
    """The model's layout from ``[[name, shape, dtype], ...]``, checked without allocating anything."""
    trainable, buffers, names = [], [], set()
    for i, item in enumerate(fields.sequence(value, where, most=MAX_TENSORS)):
        at = fields.join(where, i)
        name, shape, dtype = fields.sequence(item, at, length=3)
        name = fields.text(name, fields.join(at, 0))
        if name in names:
            raise fields.StateError(fields.join(at, 0), f"names array {name!r} twice")
        names.add(name)
        dims = tuple(
            fields.whole(n, fields.join(fields.join(at, 1), j), high=2**62)
            for j, n in enumerate(fields.sequence(shape, fields.join(at, 1), most=MAX_NDIM))
        )
        spec = TensorSpec(name, dims, saved_dtype(dtype, fields.join(at, 2)))
        (buffers if looks_like_buffer(name, np.empty(0, spec.dtype)) else trainable).append(spec)
    return ModelLayout(tuple(trainable), tuple(buffers))


def _metric_form(reply: Message) -> tuple[str, frozenset]:
    """A reply's metrics record name and, per metric, ``None`` for a number or the length of a list."""
    name, record = next(iter(reply.content.metric_records.items()))
    return name, frozenset((key, len(value) if isinstance(value, list) else None) for key, value in record.items())


def _form_difference(form: tuple[str, frozenset], common: tuple[str, frozenset]) -> str:
    """One line saying how a reply's metrics differ from the form most replies of the round have."""
    if form[0] != common[0]:
        return f"metrics record '{form[0]}' is named differently from the round's other replies ('{common[0]}')"
    mine, theirs = dict(form[1]), dict(common[1])
    if set(mine) != set(theirs):
        return "metric names differ from the round's other replies"
    key = sorted(k for k in mine if mine[k] != theirs[k])[0]

    def shape(length: int | None) -> str:
        return "a number" if length is None else f"a list of {length}"

    return f"metric '{key}' is {shape(mine[key])} where the round's other replies have {shape(theirs[key])}"


def _check_finite_result(arrays: ArrayRecord | None, moments: dict[str, Any]) -> None:
    """``FloatingPointError`` when Flower's new model or moments hold NaN or Inf."""
    named = [(f"model '{k}'", v) for k, v in (record_to_arrays(arrays).items() if arrays is not None else ())]
    for moment, values in moments.items():
        named += [(f"{moment} '{k}'", v) for k, v in (values or {}).items()]
    for what, value in named:
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise FloatingPointError(f"Flower's step produced NaN or Inf in {what}")


class MeteredFedAvg(Metered, FedAvg):
    """Flower's FedAvg, metered.

    Parameters
    ----------
    *args, **kwargs
        Flower's ``FedAvg`` arguments, passed to it unchanged (the signature lists them).
    parts : EngineParts | None (default: None)
        pollen's parts it uses (:class:`~pollen.strategies.engine.parts.EngineParts`): the outlier screen, the
        reply collector's sampler, the round's transaction, the accounting, the round driver and the checkpoint.
    """


class MeteredFedAdam(Metered, FedAdam):
    """Flower's FedAdam (bias-corrected eta, tau outside the sqrt), metered.

    Parameters
    ----------
    *args, **kwargs
        Flower's ``FedAdam`` arguments, passed to it unchanged (the signature lists them).
    parts : EngineParts | None (default: None)
        pollen's parts it uses (:class:`~pollen.strategies.engine.parts.EngineParts`): the outlier screen, the
        reply collector's sampler, the round's transaction, the accounting, the round driver and the checkpoint.
    """


class MeteredFedYogi(Metered, FedYogi):
    """Flower's FedYogi, metered.

    Parameters
    ----------
    *args, **kwargs
        Flower's ``FedYogi`` arguments, passed to it unchanged (the signature lists them).
    parts : EngineParts | None (default: None)
        pollen's parts it uses (:class:`~pollen.strategies.engine.parts.EngineParts`): the outlier screen, the
        reply collector's sampler, the round's transaction, the accounting, the round driver and the checkpoint.
    """


class MeteredFedAdagrad(Metered, FedAdagrad):
    """Flower's FedAdagrad, metered.

    Parameters
    ----------
    *args, **kwargs
        Flower's ``FedAdagrad`` arguments, passed to it unchanged (the signature lists them).
    parts : EngineParts | None (default: None)
        pollen's parts it uses (:class:`~pollen.strategies.engine.parts.EngineParts`): the outlier screen, the
        reply collector's sampler, the round's transaction, the accounting, the round driver and the checkpoint.
    """
