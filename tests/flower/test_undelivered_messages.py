"""A message the SuperLink could not deliver (its node went offline) is that node's failure, counted once.

Flower's SuperLink answers such a message itself: an error reply from its own node id
(``SUPERLINK_NODE_ID``) that points to the message by id. Found when SuperNodes were killed mid-run
(``tests/e2e/test_many_supernodes.py``): each dead node was counted twice ("a node not asked" for the
SuperLink's reply, then "no reply before the timeout" for the node) and the reason hid what happened.
The replies here are made by Flower's own function for them.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

from pollen.strategies import FedAMS, MeteredFedAvg
from pollen.testing.fakes import FakeGrid, full_model_reply, model_record, named_arrays, run_train_round, tiny_model
from pollen.wire import protocol

NODES = [31, 32, 33, 34]
GONE = {32, 34}


def client_or_superlink(msg):  # noqa: ANN001, ANN201
    """Live nodes train (+0.01 per tensor); for a gone node the SuperLink answers with its error reply."""
    if msg.metadata.dst_node_id in GONE:
        return create_message_error_unavailable_res_message(msg.metadata, "node_unavail")
    arrays = {
        k: v + np.asarray(0.01, dtype=v.dtype) if v.dtype.kind == "f" else v
        for k, v in named_arrays(msg.content.array_records[protocol.ARRAYS_RECORD]).items()
    }
    return full_model_reply(msg, arrays, num_examples=10)


@pytest.mark.parametrize(
    "make",
    [
        lambda: FedAMS(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2),
        lambda: MeteredFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2),
    ],
    ids=["pollen-engine", "metered-baseline"],
)
def test_the_superlinks_reply_for_an_offline_node_is_that_nodes_one_failure(make) -> None:  # noqa: ANN001
    strategy = make()
    grid = FakeGrid(NODES, client_or_superlink)
    run_train_round(strategy, grid, 1, model_record(tiny_model()))
    stats = strategy.accounting.rounds[1]
    assert stats.replies == len(NODES) - len(GONE)
    assert stats.failures == len(GONE), stats.failure_reasons
    assert sorted(stats.failure_reasons) == sorted(
        f"node-{node}: train message not delivered: {reason}" for node, reason in ((n, _flower_reason()) for n in GONE)
    )


def _flower_reason() -> str:
    from flwr.server.superlink.linkstate.utils import NODE_UNAVAILABLE_ERROR_REASON

    return NODE_UNAVAILABLE_ERROR_REASON
