"""Which client a message is for: the node's own, or the partition the server binds it to (population mode).

A node is one client (node-config ``client-id``, else ``partition-<partition-id>``) unless the message's
config names a partition (:data:`pollen.wire.protocol.CFG_PARTITION`): in population mode the server plays
many logical clients on few nodes and says, in every message, which one this node plays for it. The data
partition, the seeds, the client id that names the state file and the reply's client info all follow it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pollen.wire import protocol


def played_partition(config: Mapping[str, Any] | None) -> int | None:
    """The partition the message's config says this node plays, or ``None`` (the node is its own client).

    ``ValueError`` when the config names one that is not a non-negative integer.
    """
    if config is None or protocol.CFG_PARTITION not in config:
        return None
    value = config[protocol.CFG_PARTITION]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"message config '{protocol.CFG_PARTITION}' = {value!r}; allowed: an integer >= 0")
    return value


def node_client_id(node_config: Mapping[str, Any]) -> str:
    """A node's own client id: node-config ``client-id``, else ``partition-<partition-id>``."""
    configured = node_config.get("client-id")
    if configured:
        return str(configured)
    partition = node_config.get("partition-id")
    return protocol.partition_client_id(int(partition) if partition not in ("", None) else 0)


def message_client_id(node_config: Mapping[str, Any], config: Mapping[str, Any] | None) -> str:
    """The client id the message is for: ``partition-<p>`` when it names partition ``p``, else the node's own."""
    partition = played_partition(config)
    return node_client_id(node_config) if partition is None else protocol.partition_client_id(partition)
