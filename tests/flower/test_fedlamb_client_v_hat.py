"""Fed-LAMB's client keeps the server's ``v_hat`` in its state only when the server may leave it out of a message.

With one synchronisation a round the server sends ``v_hat`` with every message (``pollen.v-hat-keep`` false);
a copy in client state would never be read, and in simulation Flower ships the node's state to the client and
back with every message (89 MB a message at ResNet-18 size with the momentum, ``docs/results/performance.md``).
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from pollen.clientside.state import ClientState
from pollen.clientside.steps import LocalWork
from pollen.clientside.steps import fedlamb as lamb
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record

DIM = 7


def work_for(context: Context, server_round: int, v_hat: np.ndarray | None, keep: bool | None) -> LocalWork:
    config = ConfigRecord({protocol.CFG_VHAT_VERSION: server_round, protocol.CFG_SERVER_ROUND: server_round})
    if keep is not None:
        config[protocol.CFG_VHAT_KEEP] = keep
    content = RecordDict({protocol.CONFIG_RECORD: config})
    if v_hat is not None:
        content[protocol.extra_record("v_hat")] = arrays_to_record({protocol.EXTRA_ARRAY: v_hat})
    msg = Message(content=content, dst_node_id=1, message_type="train")
    state = ClientState(context, server_round=server_round)
    return LocalWork(task=None, msg=msg, config=config, state=state, server_round=server_round, seed=0)


def kept_names(context: Context) -> set[str]:
    return set(ClientState(context, server_round=99).names())


def fresh_context() -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})


@pytest.mark.parametrize("keep", [True, None], ids=["told-to-keep", "older-server-says-nothing"])
def test_a_client_keeps_the_sent_v_hat_when_the_server_may_leave_it_out(keep: bool | None) -> None:
    context, v_hat = fresh_context(), np.arange(DIM, dtype=np.float32)
    work = work_for(context, 1, v_hat, keep)
    np.testing.assert_array_equal(lamb._round_v_hat(work, DIM), v_hat)
    work.state.commit()
    assert {lamb.V_HAT, lamb.V_HAT_VERSION} <= kept_names(context)
    later = work_for(context, 1, None, keep)  # a message without it: the kept copy of the same version
    np.testing.assert_array_equal(lamb._round_v_hat(later, DIM), v_hat)


def test_a_client_told_v_hat_comes_every_time_keeps_none_and_drops_an_old_copy() -> None:
    context = fresh_context()
    first = work_for(context, 1, np.ones(DIM, np.float32), keep=True)
    lamb._round_v_hat(first, DIM)
    first.state.commit()
    assert lamb.V_HAT in kept_names(context)
    v_hat = np.full(DIM, 2.0, np.float32)
    work = work_for(context, 2, v_hat, keep=False)
    np.testing.assert_array_equal(lamb._round_v_hat(work, DIM), v_hat)
    work.state.commit()
    assert not {lamb.V_HAT, lamb.V_HAT_VERSION} & kept_names(context)
    with pytest.raises(ValueError, match="holds no v_hat of version 2"):  # a server that broke its word
        lamb._round_v_hat(work_for(context, 2, None, keep=False), DIM)
