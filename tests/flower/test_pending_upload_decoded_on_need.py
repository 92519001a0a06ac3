"""The last upload kept for error feedback is decoded only when the server's ledger makes it matter.

A client keeps its last compressed upload so that the part the server did not apply can go back into the
residual (:mod:`pollen.clientside.feedback`). In the usual round the server applied all of it and nothing is
owed: decoding it (a d-size vector, 11 M values at ResNet-18 size) would be work on every message for nothing
(issue 41: no record converted more often than needed). The residual must come out the same either way.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, RecordDict

from pollen.clientside.compression_mod import RESIDUAL, compress_update
from pollen.clientside.state import ClientState
from pollen.wire import protocol

DIM = 64
mod = importlib.import_module("pollen.clientside.compression_mod")  # the package's attribute is the mod function


def upload(context: Context, server_round: int, ledger: dict) -> np.ndarray:
    config = ConfigRecord({protocol.CFG_CODEC: "sign", protocol.CFG_SERVER_ROUND: server_round, **ledger})
    state = ClientState(context, server_round=server_round)
    delta = np.random.default_rng(server_round).standard_normal(DIM).astype(np.float32)
    compress_update(delta, config, state)
    state.commit()
    return ClientState(context, server_round=server_round + 1).get(RESIDUAL)


def residual_after_round_2(ledger: dict, monkeypatch: pytest.MonkeyPatch | None = None) -> tuple[np.ndarray, int]:
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    upload(context, 1, {})
    calls = []
    if monkeypatch is not None:
        real = mod.decode_payload
        monkeypatch.setattr(mod, "decode_payload", lambda *a, **k: calls.append(1) or real(*a, **k))
    return upload(context, 2, ledger), len(calls)


FULLY_APPLIED = {protocol.CFG_APPLIED_ROUND: 1, protocol.CFG_APPLIED_SCALE: 1.0}


def test_an_upload_the_server_applied_in_full_is_not_decoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    residual, decodes = residual_after_round_2(FULLY_APPLIED, monkeypatch)
    assert decodes == 0
    assert np.isfinite(residual).all() and residual.shape == (DIM,)


@pytest.mark.parametrize(
    "ledger",
    [
        {protocol.CFG_APPLIED_ROUND: 1, protocol.CFG_APPLIED_SCALE: 0.25},  # a quarter applied: 3/4 owed
        {protocol.CFG_APPLIED_ROUND: 0},  # not applied: all of it owed
        {protocol.CFG_REFUSED_ROUND: 1},  # refused for its content: dropped with the residual
    ],
    ids=["partly-applied", "not-applied", "refused"],
)
def test_an_upload_the_ledger_names_is_decoded_and_settled(ledger: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    owed, decodes = residual_after_round_2(ledger, monkeypatch)
    assert decodes == 1
    fully = residual_after_round_2(FULLY_APPLIED)[0]
    assert not np.array_equal(owed, fully)  # what is owed (or dropped) changes the residual
