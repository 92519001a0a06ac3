"""Where each train message ran: one JSON line per message, for tests that spread clients over machines.

The testing app (:mod:`pollen.testing.apps`) puts :func:`placement_mod` in front of its train handler.
With run-config ``trace-dir`` set (a directory every worker can write; empty: off), each train message
appends ``{"client": ..., "round": r, "ray_node": ..., "pid": ...}`` to ``<trace-dir>/<pid>.jsonl``:
``ray_node`` is the id of the Ray node whose worker ran the message (``None`` outside Ray), so a test
of a multi-node Ray cluster can check that clients ran on every node and that a client's state
followed it from one node to another.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from pollen.app.spec import text
from pollen.wire import protocol

KEYS = {"trace-dir": text("")}


def ray_node_id() -> str | None:
    """The Ray node this process runs on, or ``None`` when it is not a Ray worker."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def read_placements(trace_dir: Path) -> list[dict]:
    """Every line the workers wrote under ``trace_dir``."""
    return [json.loads(line) for path in sorted(trace_dir.glob("*.jsonl")) for line in path.read_text().splitlines()]


def placement_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: after a train message is answered, note where it ran (when ``trace-dir`` is set)."""
    reply = call_next(msg, context)
    trace_dir = str(context.run_config.get("trace-dir", "") or "")
    if not trace_dir or msg.metadata.message_type.split(".")[0] != "train":
        return reply
    config = msg.content.config_records.get(protocol.CONFIG_RECORD)
    node = context.node_config
    line = {
        "client": str(node.get("client-id") or f"partition-{int(node.get('partition-id', 0))}"),
        "round": int(config.get(protocol.CFG_SERVER_ROUND, 0)) if config is not None else 0,
        "ray_node": ray_node_id(),
        "pid": os.getpid(),
    }
    with open(Path(trace_dir) / f"{os.getpid()}.jsonl", "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
    return reply
