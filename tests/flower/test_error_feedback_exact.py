"""Error feedback loses nothing at any seam, for every error-fed method the registry builds (issue 24).

Per client and per side, "what the server applied + the client's residual + what it is still owed (+ what
it dropped when the server refused an upload for its content, issue 44) = the sum of the client's true
updates" holds after rounds with a skipped round (``min-replies``), a
rolled-back server step, a reply lost after the client trained (drop-out), an update clipped by the
outlier screen, and a resume of the server from its state dict in the middle of the run. The methods are
every registered strategy that, with an error-fed compressed uplink, keeps the ledger
(:mod:`pollen.strategies.engine.ledger`); the client runs pollen's two train mods (``lazy_mod`` around
``compression_mod``) on a fake trainer. The bidirectional methods' downlink side is checked by its own
invariant: the server's mirror of each client is bit for bit the model the client holds (or, after a
round the server did not commit, the copy it kept of a round back), so ``theta - mirror`` is exactly
what the downlink still owes.

The server's side of the same account (issue 43): in every committed round, the clients' applied parts
average to the delta the server stepped with, for every method whose aggregate is a mean of the round's
updates. A robust aggregator (median, trimmed mean, majority vote) has no per-client share, so the ledger
could only tell its clients something the server did not do: with error-fed uploads it is refused before
round 1 with the reason and what is allowed, and without error feedback it runs.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord

from pollen.app.config import AppConfig, defaults_from_pyproject
from pollen.app.experiment import build_strategy
from pollen.app.methods import METHODS
from pollen.clientside.compression_mod import RESIDUAL, _pending_upload, compression_mod
from pollen.clientside.feedback import owed, refused
from pollen.clientside.lazy_mod import COPY_PREFIX, PREV_X, UP_ROUND, UP_USED, lazy_mod
from pollen.clientside.state import STATE_KEY, ClientState
from pollen.lazy import checksum
from pollen.strategies.engine import strategy as base_module
from pollen.strategies.engine.ledger import AppliedLedger
from pollen.strategies.engine.sinks import RunningMean
from pollen.strategies.engine.step import ServerStep
from pollen.strategies.fedadavr import _VRSink
from pollen.strategies.lazy import FedLazy
from pollen.testing.fakes import (
    TRAINABLE,
    FakeGrid,
    config_of,
    flat_trainable,
    full_model_reply,
    global_arrays_of,
    make_context,
    model_record,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

NODES = [1, 2, 3, 4]
D = 19
ROUNDS = 8
PYPROJECT = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "pyproject.toml")


def _build(name: str, **extra: Any) -> Any:
    run_config = {
        **defaults_from_pyproject(PYPROJECT),
        "strategy": name,
        "compressor": "topk",
        "topk-ratio": 0.25,
        "error-feedback": True,
        "fraction-train": 1.0,
        "fraction-evaluate": 0.0,
        "min-train-nodes": 3,
        **extra,
    }
    given = {"strategy", "compressor", "topk-ratio", "error-feedback", *extra}
    return build_strategy(AppConfig.from_run_config(run_config, given=given))


def _error_fed_methods() -> list[str]:
    names = []
    for name in METHODS:
        try:
            strategy = _build(name)
        except Exception:  # noqa: BLE001 - a method that takes no compressed uplink is not error-fed
            continue
        if getattr(getattr(strategy, "ledger", None), "tell", False):
            names.append(name)
    return names


ERROR_FED = _error_fed_methods()


def test_the_registry_yields_every_error_fed_family() -> None:
    assert {"fedcams", "fedopt", "fednlaca", "fedaca", "fedbnlaca", "fedbaca"} <= set(ERROR_FED), ERROR_FED


class Harness:
    """Pollen's two train mods on a fake trainer; records true updates and what the server took."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.contexts = {n: make_context(n) for n in NODES}
        self.true: dict[str, list[np.ndarray]] = {f"c{n}": [] for n in NODES}
        self.taken: list[tuple[str, np.ndarray]] = []
        self.applied: dict[str, list[np.ndarray]] = {f"c{n}": [] for n in NODES}
        #: What each client dropped when told its upload was refused for its content (residual + that upload).
        self.dropped: dict[str, list[np.ndarray]] = {f"c{n}": [] for n in NODES}
        self.lose: set[int] = set()
        self.inflate: set[int] = set()
        #: Each committed round: (what each client's upload was applied as, the delta the server stepped with).
        self.rounds: list[tuple[list[np.ndarray], np.ndarray]] = []
        self.stepped: list[np.ndarray] = []
        self.grid = FakeGrid(NODES, self.client, client_ids={n: f"c{n}" for n in NODES})
        for sink in (RunningMean, _VRSink):
            monkeypatch.setattr(sink, "take", self._spy_take(sink.take))
        original = base_module.AdaptiveStrategy.apply_updates

        def apply_updates(strategy, server_round, updates, running=None):  # noqa: ANN001, ANN202
            self.taken += [(u.client_key, u.delta.astype(np.float64)) for u in updates if u.delta is not None]
            return original(strategy, server_round, updates, running)

        monkeypatch.setattr(base_module.AdaptiveStrategy, "apply_updates", apply_updates)
        step = ServerStep.apply

        def apply(server_step, params, delta):  # noqa: ANN001, ANN202
            self.stepped.append(np.array(delta, dtype=np.float64))  # before the step: it may write in place
            return step(server_step, params, delta)

        monkeypatch.setattr(ServerStep, "apply", apply)

    def _spy_take(self, take):  # noqa: ANN001, ANN202
        def spied(sink, update):  # noqa: ANN001, ANN202
            self.taken.append((update.client_key, update.delta.astype(np.float64)))
            return take(sink, update)

        return spied

    def train(self, msg, context):  # noqa: ANN001, ANN201
        node = msg.metadata.dst_node_id
        r = int(config_of(msg)[protocol.CFG_SERVER_ROUND])
        start = global_arrays_of(msg)
        step = np.random.default_rng([node, r]).standard_normal(D).astype(np.float32) * np.float32(0.1)
        if node in self.inflate:
            step *= np.float32(40.0)  # far beyond 10x the others: the clip rule scales it down
        local = dict(start)
        for name, part in split_trainable(step, start).items():
            local[name] = (start[name] + part).astype(np.float32)
        self.true[f"c{node}"].append(
            flat_trainable(local).astype(np.float32).astype(np.float64)
            - flat_trainable(start).astype(np.float32).astype(np.float64)
        )
        return full_model_reply(msg, local, num_examples=10)

    def client(self, msg):  # noqa: ANN001, ANN201
        node = msg.metadata.dst_node_id
        context = self.contexts[node]
        r = int(config_of(msg)[protocol.CFG_SERVER_ROUND])
        state = ClientState(context, server_round=r)
        if state.get(UP_USED) is not None:  # the lazy family: lazy_mod keeps the upload and the residual
            pending, pending_round = state.get(UP_USED), int(state.get(UP_ROUND))
        else:
            pending, pending_round = _pending_upload(state, D, None)
        if refused(config_of(msg), pending_round):  # the mod drops the unapplied part and the residual, as asked
            unapplied = owed(config_of(msg), pending_round, r)  # 1 when rejected, 1 - scale when the screen clipped
            self.dropped[f"c{node}"].append(self.residual(node) + unapplied * np.asarray(pending, dtype=np.float64))
        reply = lazy_mod(copy.deepcopy(msg), context, lambda m, c: compression_mod(m, c, self.train))
        return None if node in self.lose else reply

    def round(self, strategy, r: int, arrays):  # noqa: ANN001, ANN201
        self.taken, self.stepped = [], []
        messages = strategy.configure_train(r, arrays, ConfigRecord(), self.grid)
        new, _ = strategy.aggregate_train(r, list(self.grid.send_and_receive(messages, timeout=5.0)))
        if new is not None:  # the step committed: what was taken was applied
            for key, delta in self.taken:
                self.applied[key].append(delta)
            self.rounds.append(([delta for _, delta in self.taken], self.stepped[-1]))
        return arrays if new is None else new

    def owed_now(self, strategy, node: int, next_round: int) -> np.ndarray:  # noqa: ANN001
        """What the client would put back into its residual at its next message."""
        state = ClientState(self.contexts[node], server_round=next_round)
        config = {protocol.CFG_SERVER_ROUND: next_round, **strategy.ledger.config_for(f"c{node}")}
        if isinstance(strategy, FedLazy):
            used, pending_round = state.get(UP_USED), state.get(UP_ROUND)
            pending_round = None if pending_round is None else int(pending_round)
        else:
            used, pending_round = _pending_upload(state, D, None)
        if used is None:
            return np.zeros(D)
        # refused (the client will drop its unapplied part with the residual) or owed: accounted as it stands
        return owed(config, pending_round, next_round) * np.asarray(used, dtype=np.float64)

    def residual(self, node: int) -> np.ndarray:
        record = self.contexts[node].state.array_records.get(STATE_KEY)
        if record is None or RESIDUAL not in record:
            return np.zeros(D)
        return record[RESIDUAL].numpy().astype(np.float64)


class StepFails(Exception):
    pass


def _failing_step(*args: Any, **kwargs: Any) -> Any:
    raise StepFails("the optimiser failed")


def _run_scenario(name: str, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> tuple[Any, Harness]:
    harness = Harness(monkeypatch)
    strategy = _build(name, **settings)
    arrays = model_record(tiny_model(2))
    for r in range(1, ROUNDS + 1):
        harness.lose = {2} if r == 3 else set()  # drop-out: trained, reply lost
        harness.inflate = {4} if r in (4, 7) else set()  # an outlier, clipped or rejected
        if r == 5:  # a skipped round: fewer usable replies than min-replies
            strategy.transaction.min_replies = 99
        if r == 6:  # a server step that fails and is rolled back
            strategy.server_step.apply = _failing_step
        arrays = harness.round(strategy, r, arrays)
        strategy.transaction.min_replies = 1
        if r == 6:
            del strategy.server_step.apply  # the instance attribute goes, the class's method is back
        if r == 4:  # resume: a new strategy from the state dict goes on
            state = strategy.state_dict()
            strategy = _build(name, **settings)
            strategy.load_state_dict(state)
    return strategy, harness


def _check_balance(strategy: Any, harness: Harness) -> None:
    """Per client: applied + dropped + residual + owed = the sum of its true updates."""
    for node in NODES:
        key = f"c{node}"
        applied = np.sum(harness.applied[key], axis=0) if harness.applied[key] else np.zeros(D)
        dropped = np.sum(harness.dropped[key], axis=0) if harness.dropped[key] else np.zeros(D)
        balance = applied + dropped + harness.residual(node) + harness.owed_now(strategy, node, ROUNDS + 1)
        np.testing.assert_allclose(balance, np.sum(harness.true[key], axis=0), atol=2e-5, err_msg=key)


def _check_server_account(strategy: Any, harness: Harness) -> None:
    """Per committed round, for a method whose aggregate is a mean of the round's updates: what the clients are
    told was applied of their uploads averages to the delta the server stepped with (a stored-update table's
    aggregate, FedAdaVR's, also re-uses earlier rounds' rows: its clients' side is checked by the balance)."""
    if strategy.robust_refusal is not None:
        return
    assert len(harness.rounds) >= ROUNDS - 2, len(harness.rounds)  # the skipped and the rolled-back round
    for i, (parts, stepped) in enumerate(harness.rounds):
        np.testing.assert_allclose(np.mean(parts, axis=0), stepped, atol=1e-6, err_msg=f"committed round {i + 1}")


@pytest.mark.parametrize("outlier_rule", ["clip", "reject"])
@pytest.mark.parametrize("name", ERROR_FED)
def test_applied_plus_residual_plus_owed_equals_the_true_updates(name: str, outlier_rule: str, monkeypatch) -> None:  # noqa: ANN001
    strategy, harness = _run_scenario(name, monkeypatch, **{"outlier-rule": outlier_rule})
    stats = strategy.accounting.rounds
    assert any("skipped" in reason for reason in stats[5].failure_reasons), stats[5].failure_reasons
    assert any("rolled back" in reason for reason in stats[6].failure_reasons), stats[6].failure_reasons
    if outlier_rule == "clip":  # applied in part (not rejected); the cut part is refused, not owed
        assert not any("outlier screen" in why for why in stats[7].failure_reasons), stats[7].failure_reasons
    # refused (or the part clipped off): the client was told and dropped it with its residual (not owed: it would
    # come back); 8: a lazy client sent it late
    assert strategy.ledger.refused.get("c4") in (7, 8), strategy.ledger.refused
    assert harness.dropped["c4"] or strategy.ledger.refused["c4"] == ROUNDS
    _check_balance(strategy, harness)
    _check_server_account(strategy, harness)


def _robust_cases() -> list[tuple[str, str]]:
    """(error-fed method, robust aggregator) wherever the aggregator fits the method without error feedback."""
    cases = []
    for name in ERROR_FED:
        for aggregator in ROBUST:
            try:
                _build(name, **ROBUST[aggregator], **{"error-feedback": False})
            except ValueError:  # the method aggregates its own way, or the vote and the uploads differ
                continue
            cases.append((name, aggregator))
    return cases


#: Each robust aggregator's run-config (the vote takes scaled-sign uploads; 0.25 cuts one of 4 replies per side).
ROBUST = {
    "median": {"aggregator": "median"},
    "trimmed-mean": {"aggregator": "trimmed-mean", "trim-fraction": 0.25},
    "majority-vote": {"aggregator": "majority-vote", "compressor": "sign"},
}
ROBUST_CASES = _robust_cases()


def test_every_robust_aggregator_is_covered_with_every_family_it_fits() -> None:
    names = {name for name, _ in ROBUST_CASES}
    assert {"fedcams", "fedopt", "fedadavr-novr", "fednlaca", "fedbaca"} <= names, ROBUST_CASES
    assert {aggregator for _, aggregator in ROBUST_CASES} == set(ROBUST)


@pytest.mark.parametrize(("name", "aggregator"), ROBUST_CASES)
def test_error_fed_uploads_under_a_robust_aggregator_are_refused_or_exact(
    name: str,
    aggregator: str,
    monkeypatch,  # noqa: ANN001
) -> None:
    """The invariant over the same seams with a robust aggregator: either the ledger's account is exact on both
    sides, or the combination is refused before round 1 with one line that names the aggregator, the uploads
    and what is allowed (and what is allowed builds)."""
    settings = {**ROBUST[aggregator], "outlier-rule": "clip"}
    try:
        strategy, harness = _run_scenario(name, monkeypatch, **settings)
    except ValueError as refusal:
        line = str(refusal)
        assert "\n" not in line
        assert f"aggregator={aggregator!r} cannot take error-fed {settings.get('compressor', 'topk')!r} uploads" in line
        assert (
            "allowed: error_feedback=False (run-config 'error-feedback' = false) with it, or aggregator='mean'" in line
        )
        without = _build(name, **settings, **{"error-feedback": False})
        assert without.aggregator.name == aggregator and not without.ledger.tell
        return
    _check_balance(strategy, harness)
    _check_server_account(strategy, harness)


def test_without_the_ledger_a_skipped_round_loses_mass(monkeypatch) -> None:  # noqa: ANN001
    """The negative control: a strategy that does not tell clients what it applied breaks the balance."""
    monkeypatch.setattr(AppliedLedger, "told", lambda self, content, *_: content)
    strategy, harness = _run_scenario("fedcams", monkeypatch)
    gaps = []
    for node in NODES:
        key = f"c{node}"
        applied = np.sum(harness.applied[key], axis=0) if harness.applied[key] else np.zeros(D)
        gaps.append(np.abs(applied + harness.residual(node) - np.sum(harness.true[key], axis=0)).max())
    assert max(gaps) > 1e-2, gaps


@pytest.mark.parametrize("name", [n for n in ERROR_FED if isinstance(_build(n), FedLazy) and _build(n).bidirectional])
def test_downlink_mirror_is_what_the_client_holds_after_every_seam(name: str, monkeypatch) -> None:  # noqa: ANN001
    strategy, harness = _run_scenario(name, monkeypatch)
    for node in NODES:
        key = f"c{node}"
        if not strategy.book.has("x", key):
            continue
        record = harness.contexts[node].state.array_records[STATE_KEY]
        copy_now = flat_trainable({n: record[COPY_PREFIX + n].numpy() for n in TRAINABLE}).astype(np.float32)
        held = {checksum(copy_now)}
        if PREV_X in record:
            held.add(checksum(record[PREV_X].numpy()))
        assert checksum(strategy.book.get("x", key)) in held, key
    assert not any(s.method.get("lazy_events", {}).get("resync") for s in strategy.accounting.rounds.values())
