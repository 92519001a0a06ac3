"""Injected client faults for tests: check a server against clients that fail, stall or lie.

``fault_mod`` is a Flower mod, part of the test harness (:mod:`pollen.testing.apps` puts it in front
of pollen's ClientApp; the product's ClientApp does not have it). Its settings are node-config keys
``fault-fraction``, ``fault-kind`` and ``fault-delay``, else the run-config keys of the same names
that only the testing app's config accepts (:data:`KEYS`). With ``fault-fraction`` = f > 0, each
train message of a round fails for a seeded, repeatable choice of about f of the clients (drawn per
round and client id from run-config ``seed``), in the way ``fault-kind`` says:

- ``error``: the ClientApp raises; Flower sends the server an error reply;
- ``garbage``: the reply carries a model full of NaN (the server must reject it);
- ``timeout``: the client sleeps ``fault-delay`` seconds before answering (set it above the round's
  ``round-timeout`` to make it miss the round);
- ``mixed``: one of the three, drawn per fault.

``fault-phase`` limits the faults to the messages of one phase (``train``: the round's train message; a
mid-round phase by its name, e.g. ``secagg-masked-input``); empty: every train-type message.
``fault-partitions`` (comma-separated partition ids) makes exactly those clients fail, every round, in place of
the seeded draw (``fault-fraction`` must still be > 0 to switch faults on).

Off (f = 0) it passes every message through untouched.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from pollen.app.spec import ConfigError, choice, non_negative, text, unit_closed
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record, record_to_arrays

FAULT_KINDS = ("error", "garbage", "timeout", "mixed")

#: The fault settings: node-config keys, or run-config keys of the testing app (never of the product's).
KEYS = {
    "fault-fraction": unit_closed(0.0),
    "fault-kind": choice(FAULT_KINDS, "error"),
    "fault-delay": non_negative(0.0),
    "fault-phase": text(""),
    "fault-partitions": text(""),
}


class InjectedFault(RuntimeError):
    """The fault ``fault_mod`` raises for ``fault-kind=error``."""


def fault_for(seed: int, server_round: int, client_id: str, fraction: float, kind: str) -> str | None:
    """The fault this client suffers in this round, or ``None`` (seeded, the same on every run)."""
    if fraction <= 0:
        return None
    digest = int.from_bytes(hashlib.sha256(client_id.encode()).digest()[:8], "little")
    rng = np.random.default_rng([seed, server_round, digest])
    if rng.random() >= fraction:
        return None
    return str(rng.choice(FAULT_KINDS[:3])) if kind == "mixed" else kind


def fault_settings(context: Context) -> dict[str, float | str]:
    """The fault keys for this node: node-config first, else the run-config, else off; ``ConfigError`` for a bad one."""
    settings: dict[str, float | str] = {}
    for key, spec in KEYS.items():
        value = context.node_config.get(key)
        where = "node-config"
        if value in (None, ""):
            value, where = context.run_config.get(key, spec.default), "run-config"
        if spec.type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, spec.type) or not spec.check(value):
            raise ConfigError(f"{where} '{key}' = {value!r} is out of range; allowed: {spec.words}")
        settings[key] = value
    return settings


def fault_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: inject the configured fault into train messages, else pass through."""
    settings = fault_settings(context)  # read as given: a preset does not set them
    fraction = float(settings["fault-fraction"])
    if fraction <= 0 or msg.metadata.message_type.split(".")[0] != "train":
        return call_next(msg, context)
    config = msg.content.config_records.get(protocol.CONFIG_RECORD)
    server_round = int(config.get(protocol.CFG_SERVER_ROUND, 0)) if config is not None else 0
    phase = str(config.get(protocol.CFG_PHASE, "train")) if config is not None else "train"
    if settings["fault-phase"] and phase != settings["fault-phase"]:
        return call_next(msg, context)
    node = context.node_config
    client_id = str(node.get("client-id") or f"partition-{int(node.get('partition-id', 0))}")
    if settings["fault-partitions"]:
        chosen = {part.strip() for part in str(settings["fault-partitions"]).split(",")}
        fault = str(settings["fault-kind"]) if str(node.get("partition-id", "")) in chosen else None
    else:
        fault = fault_for(
            int(context.run_config.get("seed", 0)), server_round, client_id, fraction, str(settings["fault-kind"])
        )
    if fault is None:
        return call_next(msg, context)
    if fault == "error":
        raise InjectedFault(f"injected fault in round {server_round} ({client_id})")
    if fault == "timeout":
        time.sleep(float(settings["fault-delay"]))
        return call_next(msg, context)
    reply = call_next(msg, context)
    if reply.has_error() or protocol.ARRAYS_RECORD not in reply.content.array_records:
        return reply
    arrays = record_to_arrays(reply.content.array_records[protocol.ARRAYS_RECORD])
    garbage = {k: np.full(v.shape, np.nan, v.dtype) if v.dtype.kind == "f" else v for k, v in arrays.items()}
    reply.content[protocol.ARRAYS_RECORD] = arrays_to_record(garbage)
    return reply
