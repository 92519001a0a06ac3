"""Per-round bookkeeping of a strategy: who was asked, who answered, bytes each way."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

from pollen.core import state_fields as fields
from pollen.wire import protocol

#: The metric a client reports for its gradient evaluations in one message.
GRAD_EVALS = "grad-evals"

#: A client's claim above this many gradient evaluations in one message is not believed.
MAX_GRAD_EVALS = 10**9


def grad_evals_of(record: Any) -> int:
    """The gradient evaluations a reply's metrics claim: a finite whole number in [0, 1e9], else 0.

    The value comes from a client: NaN, infinity, negatives, booleans or lists count as nothing
    rather than failing the round's bookkeeping.
    """
    if record is None:
        return 0
    value = record.get(GRAD_EVALS, record.get("num-steps", 0))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0
    return int(value) if 0 <= value <= MAX_GRAD_EVALS else 0


#: Failure reasons are kept short in the results (a reason, not a traceback).
MAX_REASON_LENGTH = 200


@dataclass
class RoundStats:
    """What happened in one training round, measured from the records on the wire.

    ``uplink_bytes`` counts every record of every reply; ``uplink_update_bytes`` only
    the record that carries the model update (compressed payload or full model), and
    ``uplink_fp32_bytes`` what a dense float32 update of the trainable parameters
    would have cost for the same replies, so their ratio is the compression gain.
    ``uplink_records`` / ``downlink_records`` split the training traffic by record name (model,
    compressed update, each extra, flags); records of a mid-round exchange are named
    ``<phase>/<record>``. ``messages_sent`` counts every training message, all phases.
    ``grad_evals`` sums the gradient evaluations (mini-batch forward/backward passes) the applied
    replies report (``grad-evals``, else ``num-steps``): a full local pass shows up here.
    ``method`` holds what one method counts for itself, by name: a number, or a mapping of numbers or
    of lists of numbers (HA-Fed's ``relayed_bytes`` and ``peer_bytes``, the lazy family's
    ``lazy_events`` and ``lazy_rel``; each strategy's docstring says what its own mean). The strategy
    writes them; the results show each as a column ``method.<name>`` and the round line prints them,
    without knowing the names.
    """

    server_round: int
    sampled: int = 0
    replies: int = 0
    failures: int = 0
    failure_reasons: list[str] = field(default_factory=list)
    uplink_bytes: int = 0
    uplink_update_bytes: int = 0
    uplink_fp32_bytes: int = 0
    downlink_bytes: int = 0
    eval_downlink_bytes: int = 0
    eval_uplink_bytes: int = 0
    messages_sent: int = 0
    exchange_messages: int = 0
    uplink_records: dict[str, int] = field(default_factory=dict)
    downlink_records: dict[str, int] = field(default_factory=dict)
    train_seconds: float = 0.0
    server_state_bytes: int = 0
    grad_evals: int = 0
    method: dict[str, Any] = field(default_factory=dict)
    train_metrics: dict[str, float] = field(default_factory=dict)
    evaluate_metrics: dict[str, float] = field(default_factory=dict)

    def count_grad_evals(self, metrics: list) -> None:  # noqa: ANN001 - MetricRecord or dict
        """Add the gradient evaluations the replies' metrics report (``grad-evals``, else ``num-steps``)."""
        self.grad_evals += sum(grad_evals_of(record) for record in metrics)

    def count_uploads(self, updates: list, arrayrecord_key: str, dim: int) -> None:  # noqa: ANN001
        """The round's usable replies, the bytes of the records carrying their model updates (under any name
        a reply may use) and what FP32 models would have taken (``4 * dim`` each)."""
        self.replies = len(updates)
        for update in updates:
            names = {protocol.UPDATE_RECORD, arrayrecord_key, update.update_record} - {""}
            if update_bytes := sum(update.record_bytes.get(name, 0) for name in names):
                self.uplink_update_bytes += update_bytes
                self.uplink_fp32_bytes += 4 * dim

    def fail(self, reason: str) -> None:
        self.failures += 1
        self.failure_reasons.append(reason[:MAX_REASON_LENGTH])

    def add_uplink(self, record_bytes: dict[str, int], prefix: str = "") -> None:
        """Count the records of one reply (all of them, before it is judged)."""
        for name, size in record_bytes.items():
            key = prefix + name
            self.uplink_records[key] = self.uplink_records.get(key, 0) + size
            self.uplink_bytes += size

    def add_downlink(self, record_bytes: dict[str, int], prefix: str = "") -> None:
        """Count the records of one message sent."""
        self.messages_sent += 1
        for name, size in record_bytes.items():
            key = prefix + name
            self.downlink_records[key] = self.downlink_records.get(key, 0) + size
            self.downlink_bytes += size

    @property
    def compression_ratio(self) -> float:
        """Dense FP32 bytes over the measured update bytes (1.0 when nothing came back)."""
        return self.uplink_fp32_bytes / self.uplink_update_bytes if self.uplink_update_bytes else 1.0


class Accounting:
    """All rounds' stats plus cumulative totals; serialisable."""

    def __init__(self) -> None:
        self.rounds: dict[int, RoundStats] = {}

    def round(self, server_round: int) -> RoundStats:
        if server_round not in self.rounds:
            self.rounds[server_round] = RoundStats(server_round)
        return self.rounds[server_round]

    def cumulative(self, field_name: str, up_to: int | None = None) -> int:
        return sum(getattr(stats, field_name) for r, stats in self.rounds.items() if up_to is None or r <= up_to)

    def to_dict(self) -> dict:
        return {str(r): asdict(stats) for r, stats in sorted(self.rounds.items())}

    def state_dict(self) -> dict:
        """What a checkpoint keeps (:meth:`to_dict`)."""
        return self.to_dict()

    def prepare_load(
        self, data: Any, *, last_round: int | None = None, where: str = "accounting"
    ) -> Callable[[], None]:
        """Check what :meth:`to_dict` wrote (:meth:`from_dict`) and return what makes it this accounting's."""
        rounds = self.from_dict(data, where, last_round=last_round).rounds

        def commit() -> None:
            self.rounds = rounds

        return commit

    @classmethod
    def from_dict(cls, data: Any, where: str = "accounting", last_round: int | None = None) -> Accounting:
        """The accounting :meth:`to_dict` wrote, every field checked (``StateError`` naming the field).

        Rounds are whole numbers up to ``last_round`` (the checkpoint's); each round holds exactly the
        fields of :class:`RoundStats`, counts whole and >= 0, seconds finite and >= 0, metrics finite.
        """
        accounting = cls()
        high = fields.MAX_COUNT if last_round is None else last_round
        known = {f.name: f.type for f in dataclass_fields(RoundStats)}
        for key, values in fields.mapping(data, where).items():
            round_where = fields.join(where, key)
            if not (key.isascii() and key.isdigit()):
                raise fields.StateError(round_where, f"is keyed by a round that is not a whole number in [0, {high}]")
            server_round = fields.whole(int(key), round_where, high=high)
            values = fields.mapping(values, round_where, keys=tuple(known))
            checked = {name: _stats_field(known[name], values[name], fields.join(round_where, name)) for name in known}
            if checked["server_round"] != server_round:
                raise fields.StateError(fields.join(round_where, "server_round"), f"is not {server_round}")
            accounting.rounds[server_round] = RoundStats(**checked)
        return accounting


def _stats_field(kind: str, value: Any, where: str) -> Any:
    """One checked field of a saved :class:`RoundStats` (``kind`` is its annotation)."""
    if kind == "int":
        return fields.whole(value, where)
    if kind == "float":
        return fields.finite_number(value, where, low=0.0)
    if kind == "list[str]":
        return [
            fields.text(item, fields.join(where, i), most=MAX_REASON_LENGTH)
            for i, item in enumerate(fields.sequence(value, where))
        ]
    if kind == "dict[str, int]":
        return {k: fields.whole(v, fields.join(where, k)) for k, v in fields.mapping(value, where).items()}
    if kind == "dict[str, float]":
        return {k: fields.finite_number(v, fields.join(where, k)) for k, v in fields.mapping(value, where).items()}
    return {k: _method_value(v, fields.join(where, k)) for k, v in fields.mapping(value, where).items()}


def _method_value(value: Any, where: str) -> Any:
    """A method's own count: a finite number, or a mapping of numbers or of lists of numbers."""
    if isinstance(value, Mapping):
        return {k: _method_value(v, fields.join(where, k)) for k, v in fields.mapping(value, where).items()}
    if isinstance(value, (list, tuple)):
        return [fields.finite_number(v, fields.join(where, i)) for i, v in enumerate(value)]
    return fields.finite_number(value, where)
