"""The cases of the hostile matrix, discovered per method, and the one oracle that judges them.

:func:`probe` runs a method honestly once and keeps what its attacker sent in every phase of the
attacked round, and what the method declared for it (:class:`Probe`). :func:`cases_for` turns that into
cases, by record kind (:data:`KINDS`):

- ``update-arrays`` / ``update-codec``: each array of the update in Flower's full-model form and in
  pollen's codec form (payload arrays and meta), whichever form the method itself asks for;
- ``buffers-arrays`` / ``buffers-codec``: each buffer of the model, in both forms;
- ``extra:<name>``: each extra the method's ``reply_spec_for`` declares for the round;
- ``flags``: each declared flag, an unknown one, a flags record of the wrong kind;
- ``metrics``: the weight ``num-examples`` and another metric, the metrics record itself;
- ``mid-round``: the replies of every later phase of the round (a method that exchanges mid-round);
- ``envelope``: records missing, added, renamed or of the wrong kind; duplicates, unasked nodes,
  a previous round's reply, an error reply, an empty one.

:func:`judge` runs a case and says what happened (:class:`Verdict`), against cached references (the
honest run, and the run where the attacker stayed silent from the attacked reply on).
"""

from __future__ import annotations

import functools
import io
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from pollen.clientside.compression_mod import compress_reply
from pollen.strategies.engine.replies import ReplySpec
from pollen.testing import hostile
from pollen.testing.fakes import FakeGrid, config_of, named_arrays
from pollen.wire import protocol

KINDS = (
    "update-arrays",
    "update-codec",
    "buffers-arrays",
    "buffers-codec",
    "extra",
    "flags",
    "metrics",
    "mid-round",
    "envelope",
)
#: What a case may end in: ``reject`` (state as if silent, a reason counted), ``drop`` (state as if
#: honest, a reason counted: a duplicate or a stranger's reply), ``either`` (one of those two: a reply
#: that may mean the same as the honest one), ``plausible`` (also accepted with another finite state: a
#: legal value that differs from the honest one).
EXPECTS = ("reject", "drop", "either", "plausible")
TIMEOUT_REASON = "no reply before the timeout"


# --------------------------------------------------------------------------- the probe
@dataclass
class Probe:
    """What an honest run of a method showed: its attacker's replies per phase of the attacked round."""

    name: str
    attacker: int
    phases: tuple[int, ...]
    replies: dict[int, Message]  # phase -> the attacker's reply as sent (after pollen's mods)
    plain: dict[int, Message]  # phase -> the same before the mods: the full-model form
    spec: ReplySpec
    dim: int
    mid_round: bool
    replied_before: frozenset[int]  # phases of the round before in which the attacker replied


@functools.lru_cache(maxsize=None)
def probe(name: str) -> Probe:
    attack = hostile.Attack(lambda a, m, h: [h])
    strategy = hostile.run(name, attack)
    node, rnd = attack.attacker, hostile.ATTACK_ROUND
    phases = tuple(sorted(p for (n, r, p) in attack.history if n == node and r == rnd))
    layout = getattr(strategy, "layout", None) or getattr(strategy, "_layout", None)
    return Probe(
        name=name,
        attacker=node,
        phases=phases,
        replies={p: attack.history[(node, rnd, p)] for p in phases},
        plain={p: attack.clients.plain[(node, rnd, p)] for p in phases if (node, rnd, p) in attack.clients.plain},
        spec=hostile.spec_of(strategy, rnd),
        dim=layout.dim if layout is not None else 0,
        mid_round=hostile.has_mid_round(strategy) and len(phases) > 1,
        replied_before=frozenset(p for (n, r, p) in attack.history if n == node and r == rnd - 1),
    )


# --------------------------------------------------------------------------- building replies
Edit = Callable[[dict[str, Any], Message], None]  # changes a reply's records in place


def _answer(msg: Message, records: dict[str, Any]) -> Message:
    return Message(content=RecordDict(dict(records)), reply_to=msg)


def _records(reply: Message) -> dict[str, Any]:
    return dict(reply.content.items())


def _full_form(attack: hostile.Attack, msg: Message, honest: Message) -> dict[str, Any]:
    """The attacker's reply with its update as Flower's full model (``arrays``)."""
    if honest.has_error() or protocol.ARRAYS_RECORD in honest.content:
        return _records(honest)
    server_round, phase = hostile.phase_of(msg)
    plain = attack.clients.plain.get((msg.metadata.dst_node_id, server_round, phase))
    records = _records(plain) if plain is not None else {}
    for name, record in honest.content.items():  # flags and the like the mods added
        if name not in (protocol.UPDATE_RECORD, protocol.UPDATE_META_RECORD, protocol.BUFFERS_RECORD):
            records.setdefault(name, record)
    return records


def _codec_form(attack: hostile.Attack, msg: Message, honest: Message) -> dict[str, Any]:
    """The attacker's reply with its update as pollen's codec payload (``none`` when the method asked for none)."""
    if honest.has_error() or protocol.UPDATE_RECORD in honest.content:
        return _records(honest)
    full = _full_form(attack, msg, honest)
    global_arrays = named_arrays(msg.content.array_records[protocol.ARRAYS_RECORD])
    config = ConfigRecord({**config_of(msg), protocol.CFG_CODEC: "none", protocol.CFG_ERROR_FEEDBACK: False})
    context = attack.clients.context(msg.metadata.dst_node_id)
    return _records(compress_reply(msg, _answer(msg, full), context, global_arrays, config))


def edited(form: str, edit: Edit) -> hostile.Tamper:
    """A tamper that takes the reply in ``form`` (``full``, ``codec`` or ``sent``) and applies ``edit``."""

    def tamper(attack: hostile.Attack, msg: Message, honest: Message) -> list[Message]:
        if form == "full":
            records = _full_form(attack, msg, honest)
        elif form == "codec":
            records = _codec_form(attack, msg, honest)
        else:
            records = _records(honest)
        edit(records, msg)
        return [_answer(msg, records)]

    return tamper


def raw_array(dtype: str, shape: tuple[int, ...], payload: bytes) -> Array:
    """An ``Array`` with a hand-written ``.npy`` header (dtypes numpy would refuse to save)."""
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, {"descr": dtype, "fortran_order": False, "shape": shape})
    return Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=stream.getvalue() + payload)


def bent_array(original: np.ndarray, value: str) -> Array:
    """``original`` with the hostile ``value`` (see :data:`ARRAY_VALUES`)."""
    shape = tuple(original.shape)
    size = int(original.size)
    if value in NUMBERS:
        bent = np.array(original, dtype=np.float32 if original.dtype.kind != "f" else original.dtype)
        if bent.size:
            bent.reshape(-1)[0] = NUMBERS[value]
        return Array(np.ascontiguousarray(bent))
    if value == "negative":
        return Array(np.ascontiguousarray(-np.abs(np.asarray(original, np.float32)) - 1.0))
    if value == "float64-1e300":
        bent = np.array(original, dtype=np.float64)
        bent.reshape(-1)[0] = 1e300
        return Array(np.ascontiguousarray(bent))
    if value == "shape":
        return Array(np.zeros(size + 1, dtype=original.dtype))
    if value == "int":
        return Array(np.ascontiguousarray(np.rint(np.asarray(original, np.float64)).astype(np.int32)))
    if value == "float":
        return Array(np.ascontiguousarray(np.asarray(original, np.float64) + 0.5))
    if value == "complex":
        return raw_array("<c8", shape, b"\x00" * (8 * size))
    if value == "object":
        return raw_array("|O", shape, b"\x00" * (8 * size))
    if value == "bytes":
        return raw_array("|S4", shape, b"\x00" * (4 * size))
    if value == "truncated":
        return raw_array(original.dtype.str, shape, b"\x00" * max(0, original.nbytes - 1))
    if value == "huge-declared":
        return raw_array("<f4", (2**31,), b"")
    if value == "index-out-of-range":
        return Array(np.ascontiguousarray(np.full(shape, np.iinfo(original.dtype).max, dtype=original.dtype)))
    if value == "index-negative":
        return Array(np.ascontiguousarray(np.full(shape, -1, dtype=np.int64)))
    raise ValueError(f"unknown array value {value!r}")


NUMBERS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "1e20": 1e20, "3.4e38": 3.4e38}
#: Hostile values for an array of real numbers (``negative`` only where a moment is expected).
ARRAY_VALUES = (*NUMBERS, "float64-1e300", "shape", "int", "complex", "object", "bytes", "truncated", "huge-declared")


def set_array(record_name: str, array_name: str, value: str) -> Edit:
    def edit(records: dict[str, Any], msg: Message) -> None:
        record = records.get(record_name)
        if not isinstance(record, ArrayRecord) or array_name not in record:
            return
        arrays = OrderedDict(record.items())
        arrays[array_name] = bent_array(np.asarray(record[array_name].numpy()), value)
        records[record_name] = ArrayRecord(arrays)

    return edit


def drop_record(record_name: str) -> Edit:
    def edit(records: dict[str, Any], msg: Message) -> None:
        records.pop(record_name, None)

    return edit


def put_record(record_name: str, record: Any) -> Edit:
    def edit(records: dict[str, Any], msg: Message) -> None:
        records[record_name] = record

    return edit


def rename_record(record_name: str, new_name: str) -> Edit:
    def edit(records: dict[str, Any], msg: Message) -> None:
        if record_name in records:
            records[new_name] = records.pop(record_name)

    return edit


def retype_record(record_name: str) -> Edit:
    """The record replaced by one of another kind with a similar content."""

    def edit(records: dict[str, Any], msg: Message) -> None:
        record = records.get(record_name)
        if isinstance(record, ArrayRecord):
            records[record_name] = ConfigRecord({"value": 1.0})
        elif isinstance(record, (ConfigRecord, MetricRecord)):
            records[record_name] = ArrayRecord(OrderedDict([("value", Array(np.zeros(3, np.float32)))]))

    return edit


def set_config(record_name: str, key: str, value: Any, kind: type = ConfigRecord) -> Edit:
    def edit(records: dict[str, Any], msg: Message) -> None:
        old = records.get(record_name)
        values = dict(old.items()) if isinstance(old, (ConfigRecord, MetricRecord)) else {}
        values[key] = value
        records[record_name] = kind(values)

    return edit


# --------------------------------------------------------------------------- envelope tampers
def duplicated(attack: hostile.Attack, msg: Message, honest: Message) -> list[Message]:
    return [honest, honest]


def duplicated_then_bent(attack: hostile.Attack, msg: Message, honest: Message) -> list[Message]:
    bent = edited("full", set_array(protocol.ARRAYS_RECORD, _first_trainable(attack, msg, honest), "1e20"))
    return [honest, *bent(attack, msg, honest)]


def bent_then_honest(attack: hostile.Attack, msg: Message, honest: Message) -> list[Message]:
    bent = edited("full", set_array(protocol.ARRAYS_RECORD, _first_trainable(attack, msg, honest), "nan"))
    return [*bent(attack, msg, honest), honest]


def _first_trainable(attack: hostile.Attack, msg: Message, honest: Message) -> str:
    full = _full_form(attack, msg, honest).get(protocol.ARRAYS_RECORD)
    return next(iter(full.keys())) if isinstance(full, ArrayRecord) else ""


def from_stranger(attack: hostile.Attack, msg: Message, honest: Message) -> list[Message]:
    """The honest reply, and a copy claiming to come from a node that was never asked."""
    foreign = Message(RecordDict(), dst_node_id=hostile.STRANGER, message_type=msg.metadata.message_type)
    FakeGrid._stamp(foreign)
    return [honest, Message(content=honest.content, reply_to=foreign)]


def from_unasked_peer(attack: hostile.Attack, msg: Message, honest: Message) -> list[Message]:
    """The honest reply, and a copy claiming to come from a connected node not asked in this phase (if any)."""
    peers = [n for n in hostile.NODES if n not in attack.asked]
    if not peers:
        return [honest]
    foreign = Message(RecordDict(), dst_node_id=peers[-1], message_type=msg.metadata.message_type)
    FakeGrid._stamp(foreign)
    return [honest, Message(content=honest.content, reply_to=foreign)]


def _previous(attack: hostile.Attack, msg: Message) -> Message | None:
    server_round, phase = hostile.phase_of(msg)
    return attack.history.get((msg.metadata.dst_node_id, server_round - 1, phase))


def stale(attack: hostile.Attack, msg: Message, honest: Message) -> list[Message]:
    """The previous round's reply of the same phase instead of this round's."""
    previous = _previous(attack, msg)
    return [previous] if previous is not None else []


def stale_first(attack: hostile.Attack, msg: Message, honest: Message) -> list[Message]:
    """The previous round's reply, then this round's: the first one an asked node sends is the stale one."""
    previous = _previous(attack, msg)
    return [previous, honest] if previous is not None else [honest]


def error_reply(attack: hostile.Attack, msg: Message, honest: Message) -> list[Message]:
    return [Message(Error(code=1, reason="boom"), reply_to=msg)]


def empty_reply(attack: hostile.Attack, msg: Message, honest: Message) -> list[Message]:
    return [_answer(msg, {})]


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One hostile reply: its record kind, what in it is bent and how, from which phase, and what may happen."""

    kind: str
    target: str
    value: str
    tamper: hostile.Tamper
    expect: str = "reject"
    phase: int = 0

    @property
    def id(self) -> str:
        return f"{self.kind}|{self.target}|{self.value}" + (f"|phase{self.phase}" if self.phase else "")


def _array_cases(kind: str, form: str, record: str, names: list[str], values: tuple[str, ...], phase: int = 0):
    for name in names:
        for value in values:
            yield Case(kind, f"{record}/{name}", value, edited(form, set_array(record, name, value)), phase=phase)


def _buffer_values(name: str, dtype: np.dtype) -> list[tuple[str, str]]:
    """(value, expect) for one buffer: a float buffer takes integers (legal, another value)."""
    out = [(v, "reject") for v in ("nan", "inf", "1e20", "3.4e38", "float64-1e300", "shape", "complex", "object")]
    out += [("truncated", "reject"), ("bytes", "reject")]
    if dtype.kind == "f":
        out.append(("int", "plausible"))
        if "var" in name:  # a variance: a moment, must be >= 0
            out.append(("negative", "reject"))
    else:
        out.append(("float", "plausible"))
    return out


def cases_for(name: str) -> list[Case]:
    """Every case of method ``name``: all kinds, all targets, all values."""
    found = probe(name)
    cases: list[Case] = []
    sent = found.replies[0]
    full = found.plain.get(0, sent)
    arrays = full.content.array_records.get(protocol.ARRAYS_RECORD)
    trainable = [n for n in arrays.keys() if not _is_buffer(n, arrays)] if arrays is not None else []
    buffers = [n for n in arrays.keys() if _is_buffer(n, arrays)] if arrays is not None else []
    # the update in both wire forms
    cases += _array_cases("update-arrays", "full", protocol.ARRAYS_RECORD, trainable[:2], ARRAY_VALUES)
    codec_arrays = _codec_array_names(found)
    for array_name, is_index, itemsize in codec_arrays:
        for value in _codec_values(array_name, is_index, itemsize):
            edit = set_array(protocol.UPDATE_RECORD, array_name, value)
            cases.append(Case("update-codec", f"{protocol.UPDATE_RECORD}/{array_name}", value, edited("codec", edit)))
    meta = protocol.UPDATE_META_RECORD
    for key, value in ((protocol.META_CODEC, "bogus"), (protocol.META_DIM, 10**12), (protocol.META_DIM, -1)):
        cases.append(Case("update-codec", f"{meta}/{key}", repr(value), edited("codec", set_config(meta, key, value))))
    cases.append(Case("update-codec", meta, "missing", edited("codec", drop_record(meta))))
    # buffers in both forms
    for buffer in buffers:
        dtype = np.asarray(arrays[buffer].numpy()).dtype
        for value, expect in _buffer_values(buffer, dtype):
            for kind, form, record in (
                ("buffers-arrays", "full", protocol.ARRAYS_RECORD),
                ("buffers-codec", "codec", protocol.BUFFERS_RECORD),
            ):
                edit = edited(form, set_array(record, buffer, value))
                cases.append(Case(kind, f"{record}/{buffer}", value, edit, expect))
    cases.append(
        Case("buffers-codec", protocol.BUFFERS_RECORD, "missing", edited("codec", drop_record("pollen.buffers")))
    )
    # every declared extra
    for extra in found.spec.extras:
        record = extra.record_name
        values = [*NUMBERS, "shape", "int", "complex", "object", "truncated", "huge-declared"]
        if extra.nonnegative:
            values.append("negative")
        for value in values:
            edit = set_array(record, protocol.EXTRA_ARRAY, value)
            cases.append(Case(f"extra:{extra.name}", record, value, edited("sent", edit)))
        cases.append(
            Case(f"extra:{extra.name}", record, "missing", edited("sent", drop_record(record)), _missing(extra))
        )
        cases.append(Case(f"extra:{extra.name}", record, "renamed-array", edited("sent", _rename_array(record))))
        cases.append(Case(f"extra:{extra.name}", record, "wrong-kind", edited("sent", retype_record(record))))
    # flags: each declared one with a value that is not a boolean; an unknown one; the wrong record kind
    flags = protocol.FLAGS_RECORD
    for flag in found.spec.flags:
        for value in (1, "yes"):
            cases.append(Case("flags", f"{flags}/{flag}", repr(value), edited("sent", set_config(flags, flag, value))))
    cases.append(Case("flags", f"{flags}/bogus", "True", edited("sent", set_config(flags, "bogus", True)), "either"))
    cases.append(
        Case("flags", flags, "metric-record", edited("sent", set_config(flags, "x", 1.0, MetricRecord)), "either")
    )
    # metrics: the weight and another value; the record
    metrics = protocol.METRICS_RECORD
    for value, expect in (
        (math.nan, "reject"),
        (math.inf, "reject"),
        (-5, "reject"),
        (0, "reject"),
        (1e20, "reject"),
        (2**63 - 1, "reject"),
        ([1.0, 2.0], "reject"),
        (1e6, "plausible"),
    ):
        edit = set_config(metrics, protocol.NUM_EXAMPLES, value, MetricRecord)
        cases.append(Case("metrics", f"{metrics}/{protocol.NUM_EXAMPLES}", repr(value), edited("sent", edit), expect))
    for value in (math.nan, math.inf, 1e300, [1.0, math.nan]):
        edit = set_config(metrics, "loss", value, MetricRecord)
        cases.append(Case("metrics", f"{metrics}/loss", repr(value), edited("sent", edit), "either"))
    cases.append(Case("metrics", metrics, "missing", edited("sent", drop_record(metrics)), "either"))
    cases.append(Case("metrics", metrics, "wrong-kind", edited("sent", retype_record(metrics)), "either"))
    cases.append(
        Case("metrics", "second-record", "MetricRecord", edited("sent", put_record("m2", _metric())), "either")
    )
    # mid-round phases: the replies of every later exchange of the round
    for phase in found.phases[1:] if found.mid_round else ():
        reply = found.replies[phase]
        phase_arrays = reply.content.array_records.get(protocol.ARRAYS_RECORD)
        names = list(phase_arrays.keys()) if phase_arrays is not None else []
        first = [n for n in names if not _is_buffer(n, phase_arrays)][:1]
        for value in ("nan", "inf", "1e20", "3.4e38", "shape", "int", "complex", "truncated"):
            edit = set_array(protocol.ARRAYS_RECORD, first[0], value) if first else drop_record("")
            target = f"{protocol.ARRAYS_RECORD}/{first[0] if first else '-'}"
            cases.append(Case("mid-round", target, value, edited("sent", edit), phase=phase))
        for buffer in [n for n in names if _is_buffer(n, phase_arrays)]:
            for value in ("nan", "1e20", *(("negative",) if "var" in buffer else ())):
                edit = set_array(protocol.ARRAYS_RECORD, buffer, value)
                cases.append(
                    Case("mid-round", f"{protocol.ARRAYS_RECORD}/{buffer}", value, edited("sent", edit), phase=phase)
                )
        for value, tamper, expect in _envelope(reply, phase in found.replied_before):
            cases.append(Case("mid-round", "envelope", value, tamper, expect, phase=phase))
    # the envelope of the train reply
    for value, tamper, expect in _envelope(sent, 0 in found.replied_before):
        cases.append(Case("envelope", "reply", value, tamper, expect))
    return cases


def _envelope(reply: Message, has_previous: bool) -> list[tuple[str, hostile.Tamper, str]]:
    """Envelope cases; the stale ones only where the attacker replied in the same phase of the round before."""
    out: list[tuple[str, hostile.Tamper, str]] = [
        ("duplicate", duplicated, "drop"),
        ("duplicate-then-bent", duplicated_then_bent, "drop"),
        ("bent-then-honest", bent_then_honest, "either"),
        ("unasked-stranger", from_stranger, "drop"),
        ("unasked-peer", from_unasked_peer, "either"),
        ("error", error_reply, "reject"),
        ("empty", empty_reply, "reject"),
        ("extra-array-record", edited("sent", put_record("junk", _junk_arrays())), "either"),
        ("extra-config-record", edited("sent", put_record("junk", ConfigRecord({"x": "y"}))), "either"),
    ]
    if has_previous:
        out += [("stale-round", stale, "reject"), ("stale-round-first", stale_first, "drop")]
    for name in reply.content.keys():
        out.append((f"missing {name}", edited("sent", drop_record(name)), "either"))
        out.append((f"renamed {name}", edited("sent", rename_record(name, name + "-x")), "either"))
        out.append((f"wrong-kind {name}", edited("sent", retype_record(name)), "either"))
    return out


def _missing(extra: Any) -> str:
    return "reject" if extra.required else "either"


def _rename_array(record_name: str) -> Edit:
    def edit(records: dict[str, Any], msg: Message) -> None:
        record = records.get(record_name)
        if isinstance(record, ArrayRecord):
            records[record_name] = ArrayRecord(OrderedDict((k + "-x", v) for k, v in record.items()))

    return edit


def _metric() -> MetricRecord:
    return MetricRecord({"a": 1.0})


def _junk_arrays() -> ArrayRecord:
    return ArrayRecord(OrderedDict([("value", Array(np.zeros(3, np.float32)))]))


def _is_buffer(name: str, record: ArrayRecord) -> bool:
    from pollen.core.layout import looks_like_buffer

    return looks_like_buffer(name, np.asarray(record[name].numpy()))


def _codec_array_names(found: Probe) -> list[tuple[str, bool]]:
    """The arrays of the method's codec payload (its own codec, else ``none``), each with 'is an index'."""
    sent = found.replies[0]
    record = sent.content.array_records.get(protocol.UPDATE_RECORD)
    if record is None:
        return [("values", False, 4)]  # the payload of codec 'none' (built per message by _codec_form)
    return [
        (key, np.asarray(record[key].numpy()).dtype.kind in "iu", np.asarray(record[key].numpy()).dtype.itemsize)
        for key in record.keys()
    ]


def _codec_values(array: str, is_index: bool, itemsize: int) -> tuple[str, ...]:
    if not is_index:
        return ARRAY_VALUES
    if itemsize == 1:  # packed sign bits: every byte is legal
        return ("float", "complex", "shape", "truncated")
    return ("index-out-of-range", "index-negative", "float", "complex", "shape", "truncated")


# --------------------------------------------------------------------------- references and the oracle
@functools.lru_cache(maxsize=None)
def reference(name: str, silent_from: int | None, driver: str = "sync") -> dict[str, np.ndarray]:
    """The state of an honest run (``silent_from=None``) or of one whose attacker is silent from that phase,
    on round ``driver`` (``hostile.DRIVERS``)."""
    if silent_from is None:
        return hostile.state_arrays(hostile.run(name, hostile.Attack(lambda a, m, h: [h]), driver=driver))
    return hostile.state_arrays(hostile.run(name, hostile.Attack(None, phase=silent_from), driver=driver))


@dataclass
class Verdict:
    """What one case did: ``rejected``, ``harmless``, ``accepted`` (a plausible value, finite state) or an
    escape: ``crashed``, ``corrupted``, ``stalled``, ``uncounted`` (dropped without a reason)."""

    outcome: str
    detail: str = ""

    @property
    def escaped(self) -> bool:
        return self.outcome in ESCAPES


ESCAPES = ("crashed", "corrupted", "stalled", "uncounted")
_ROUND_FAILED = re.compile(r"round skipped|rolled back|aggregation failed")


def judge(name: str, case: Case, driver: str = "sync") -> Verdict:
    """Run ``case`` against method ``name`` on round ``driver`` and judge it (the module docstring of
    :mod:`hostile`)."""
    attack = hostile.Attack(case.tamper, phase=case.phase)
    try:
        strategy = hostile.run(name, attack, driver=driver)
    except Exception as err:  # noqa: BLE001 - a hostile reply that raises out of the server is an escape
        return Verdict("crashed", f"{type(err).__name__}: {str(err)[:160]}")
    if attack.tamper_error is not None:
        raise RuntimeError(f"case {case.id} could not build its reply: {attack.tamper_error!r}")
    if not attack.hit:
        raise RuntimeError(f"case {case.id}: the attacker was never asked in round {attack.server_round}")
    return classify(strategy, case.expect, reference(name, case.phase, driver), reference(name, None, driver))


def classify(strategy: Any, expect: str, silent: dict[str, np.ndarray], honest: dict[str, np.ndarray]) -> Verdict:
    """The verdict of a finished run against its two references."""
    state = hostile.state_arrays(strategy)
    stats = strategy.accounting.rounds.get(hostile.ATTACK_ROUND)
    reasons = [r for r in (stats.failure_reasons if stats else []) if TIMEOUT_REASON not in r]
    bad = hostile.non_finite(state)
    if bad:
        return Verdict("corrupted", f"non-finite state: {bad[:3]}")
    off_silent = hostile.differences(state, silent)
    off_honest = hostile.differences(state, honest)
    if not off_silent and reasons:
        return Verdict("rejected", reasons[0][:160])
    if not off_honest:
        if expect == "drop" and not reasons:
            return Verdict("uncounted", "the extra reply was dropped without a counted reason")
        if expect == "reject":
            return Verdict("corrupted", "accepted as if honest: " + "; ".join(reasons)[:120])
        return Verdict("harmless", "; ".join(reasons)[:160])
    if any(_ROUND_FAILED.search(r) for r in reasons):
        return Verdict("stalled", "; ".join(r for r in reasons if _ROUND_FAILED.search(r))[:160])
    if expect == "plausible" and not _blown(state, silent, honest):
        return Verdict("accepted", "a legal value, accepted")
    if not off_silent and not reasons:
        return Verdict("uncounted", "state as if silent but no reason counted")
    return Verdict("corrupted", f"state differs from silent in {off_silent[:4]} and from honest in {off_honest[:2]}")


def _blown(state: dict[str, np.ndarray], *references: dict[str, np.ndarray]) -> bool:
    """Whether a float state array is more than 1e6 times as large as in either reference."""
    for key, value in state.items():
        if value.dtype.kind != "f" or not value.size:
            continue
        scale = max([1.0] + [float(np.max(np.abs(r[key]))) for r in references if key in r and r[key].size])
        if float(np.max(np.abs(value))) > 1e6 * scale:
            return True
    return False
