"""The outlier screen must not stall a run when the honest step size changes regime (liveness).

The screen judges a round against the norms it accepted in earlier rounds. When every honest update
of a round grows 30-fold (Mime's bias-free server ``v`` does this at round 2; a BatchNorm
``running_var`` that grows), every reply exceeded the history bound, nothing was accepted, the
history never adapted and every later round was rejected too. Now, when more than half of a round's
updates (of at least two) exceed the history bound, the round is judged within itself and the stale
history dropped; a streamed round, whose rejected replies are gone, drops it at its end so that the
next round judges itself. A hostile minority never triggers that, and is rejected as before.

``history_is_stale`` is the one decision every path calls; patching it to ``False`` gives the old
screen, which is how these tests show that the run stalled without the fallback. No torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from pollen.strategies import FedAMS, HAFed, MeteredFedAdam, RunCheckpoint, RunInterrupted
from pollen.strategies.engine import screening
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.strategies.engine.screening import StreamedRound, UpdateScreen, history_is_stale
from pollen.testing.fakes import (
    FakeGrid,
    capture_flwr_logs,
    config_of,
    full_model_reply,
    global_arrays_of,
    messages_text,
    model_record,
    named_arrays,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

D = 19
TRAINABLE = ("conv.weight", "conv.bias", "bn.weight")
NODES = list(range(41, 49))  # 8 clients, every one sampled each round
IDS = {n: f"c{i}" for i, n in enumerate(NODES)}
SWITCH = 3  # from this round on, every honest step is 30x larger
ROUNDS = 6


# ---------------------------------------------------------------------------- UpdateScreen on its own
@dataclass(eq=False)
class Update:
    """What the screen reads of an update (compared by identity)."""

    delta: np.ndarray
    norm: float
    applied_scale: float = 1.0
    record_norms: dict[str, float] = field(default_factory=dict)


def update(norm: float, kinds: dict[str, float] | None = None) -> Update:
    """A delta of norm ``norm`` and the norms of its screened records."""
    delta = np.zeros(D, dtype=np.float32)
    delta[0] = norm
    return Update(delta, float(norm), record_norms=dict(kinds or {}))


def screen_with_history(rule: str = "reject", kind: str | None = None) -> UpdateScreen:
    """A screen that accepted three rounds of 8 norms about 1 (of updates, or of record ``kind``)."""
    screen = UpdateScreen(rule=rule)
    rng = np.random.default_rng(0)
    for _ in range(3):
        norms = list(1.0 + 0.1 * rng.standard_normal(8))
        screen.observe(norms, [{kind: n} for n in norms] if kind else ())
    return screen


def judged(screen: UpdateScreen, updates: list) -> tuple[list, list[str], str]:
    rejected: list[str] = []
    with capture_flwr_logs() as logs:
        kept = screen.filter(updates, lambda u, why: rejected.append(why), "round 4")
    assert {id(u) for u in kept} <= {id(u) for u in updates}
    return kept, rejected, messages_text(logs)


def test_a_round_whose_every_update_grew_30_fold_is_judged_within_itself_and_replaces_the_history() -> None:
    screen = screen_with_history()
    assert screen.bound() == pytest.approx(10.0, rel=0.1)
    updates = [update(30.0 + i) for i in range(8)]
    kept, rejected, logs = judged(screen, updates)
    assert kept == updates and not rejected
    assert "round 4: 8 of 8 updates exceed the history bound" in logs and "the history is stale" in logs
    assert list(screen.history) == []  # dropped: what the step accepts replaces it
    screen.observe([u.norm for u in kept])
    assert screen.bound() == pytest.approx(10 * 33.5)


def test_a_minority_of_outliers_is_rejected_against_the_history_and_the_history_is_kept() -> None:
    screen = screen_with_history()
    before = screen.state_dict()
    updates = [update(1e3) for _ in range(3)] + [update(1.0 + 0.01 * i) for i in range(5)]
    kept, rejected, logs = judged(screen, updates)
    assert kept == updates[3:] and len(rejected) == 3
    assert all("exceeds" in why and "outlier screen" in why for why in rejected)
    assert "stale" not in logs and screen.state_dict() == before


def test_four_of_eight_is_not_more_than_half() -> None:
    screen = screen_with_history()
    updates = [update(1e3) for _ in range(4)] + [update(1.0) for _ in range(4)]
    kept, rejected, _ = judged(screen, updates)
    assert kept == updates[4:] and len(rejected) == 4 and screen.history


def test_a_lone_update_never_outvotes_its_history_but_two_do() -> None:
    """One reply above the bound stays rejected (a single-client round of 1e10 is not accepted); two agree."""
    screen = screen_with_history()
    lone = [update(30.0)]
    kept, rejected, _ = judged(screen, lone)
    assert kept == [] and len(rejected) == 1 and screen.history
    pair = [update(30.0), update(31.0)]
    kept, rejected, _ = judged(screen, pair)
    assert kept == pair and not rejected and not screen.history
    assert [history_is_stale(e, n) for e, n in ((1, 1), (1, 2), (2, 2), (2, 3), (0, 0))] == [
        False,
        False,
        True,
        True,
        False,
    ]


def test_the_clip_rule_does_not_clip_a_round_that_outvoted_its_history() -> None:
    screen = screen_with_history(rule="clip")
    updates = [update(30.0 + i) for i in range(8)]
    kept, _, _ = judged(screen, updates)
    assert kept == updates and all(u.applied_scale == 1.0 for u in updates)


def test_a_record_kind_that_grew_30_fold_is_judged_within_the_round_and_its_history_dropped() -> None:
    """A variance (``running_var``) grows with the square of its scale: 900-fold for a 30-fold scale."""
    kind = "buffer:bn.running_var"
    screen = screen_with_history(kind=kind)
    updates = [update(1.0, {kind: 900.0 + i}) for i in range(8)]
    kept, rejected, logs = judged(screen, updates)
    assert kept == updates and not rejected
    assert "8 of 8 holders of buffer 'bn.running_var' exceed the history bound" in logs
    assert kind not in screen.kinds and screen.history  # the updates' history was fine and stays


def test_a_minority_with_an_outlying_record_is_rejected_and_the_kinds_history_kept() -> None:
    kind = "extra:v"
    screen = screen_with_history(kind=kind)
    before = screen.state_dict()
    updates = [update(1.0, {kind: 1e3}) for _ in range(3)] + [update(1.0, {kind: 1.0}) for _ in range(5)]
    kept, rejected, logs = judged(screen, updates)
    assert kept == updates[3:] and all("extra 'v' has norm" in why for why in rejected)
    assert "stale" not in logs and screen.state_dict() == before


def test_a_streamed_round_drops_each_stale_history_at_its_end() -> None:
    kind = "extra:v"
    screen = screen_with_history(kind=kind)
    streamed = StreamedRound(screen, screen.bound(), screen.record_bounds([kind]))
    for i in range(8):  # the updates grew, v did not; 3 of them have an outlying v
        streamed.count(update(30.0, {kind: 1e3 if i < 3 else 1.0}))
    with capture_flwr_logs() as logs:
        screen.drop_stale(streamed, "round 4")
    assert "round 4: 8 of 8 updates exceeded the history bound" in messages_text(logs)
    assert not screen.history and kind in screen.kinds
    assert screen.bound() is None  # the next round is judged within itself


# ---------------------------------------------------------------------------- the strategies
def scale_of(rnd: int) -> float:
    return 30.0 if rnd >= SWITCH else 1.0


def regime_client(buffer_grows: bool = False):  # noqa: ANN201
    """``x + s(round) a(node, round)``, s = 30 from round ``SWITCH`` on; with ``buffer_grows`` the model's
    ``bn.running_var`` (ones in x0) comes back s^2 = 900x larger from that round on instead (a variance
    grows with the square of its scale, and is judged on the scale: ``UpdateScreen.factor_of``)."""

    def run(msg):  # noqa: ANN001, ANN202
        node, rnd = msg.metadata.dst_node_id, int(config_of(msg)[protocol.CFG_SERVER_ROUND])
        local = dict(global_arrays_of(msg))
        step = np.random.default_rng([node, rnd]).standard_normal(D) * 0.01
        step *= 1.0 if buffer_grows else scale_of(rnd)
        for name, part in split_trainable(step.astype(np.float32), local, TRAINABLE).items():
            local[name] = local[name] + part
        if buffer_grows and "bn.running_var" in local:
            grown = scale_of(rnd) ** 2 * (1.0 + 0.01 * (node - 40))
            local["bn.running_var"] = np.full(4, grown, dtype=np.float32)
        return full_model_reply(msg, local, **{"grad-evals": 10})

    return run


def model(buffer_grows: bool = False) -> dict:
    out = dict(tiny_model())
    if buffer_grows:
        out["bn.running_var"] = np.ones(4, dtype=np.float32)
    return out


def fed_ams(streaming: bool) -> FedAMS:
    strategy = FedAMS(
        eta=0.1,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(identify_clients=True, seed=3), screen=UpdateScreen(rule="reject")),
    )
    strategy.streaming = streaming  # a round with a history streams its replies (the default) or keeps them
    return strategy


def params_after_each_round(strategy, rounds: int, buffer_grows: bool = False) -> list[np.ndarray]:  # noqa: ANN001
    """Run ``rounds`` rounds; the trainable parameters after each (and x0 first)."""
    trail = []
    original = strategy.aggregate_train

    def aggregate_train(server_round, replies):  # noqa: ANN001, ANN202
        if not trail:
            trail.append(strategy.params.copy())
        result = original(server_round, replies)
        trail.append(strategy.params.copy())
        return result

    strategy.aggregate_train = aggregate_train
    grid = FakeGrid(NODES, regime_client(buffer_grows), client_ids=IDS)
    strategy.start(grid=grid, initial_arrays=model_record(model(buffer_grows)), num_rounds=rounds)
    return trail


def moved(trail: list[np.ndarray]) -> list[bool]:
    """Per round (1-based index i -> trail[i] vs trail[i-1]) whether the model moved."""
    return [not np.array_equal(trail[i], trail[i - 1]) for i in range(1, len(trail))]


def replies_per_round(strategy) -> list[int]:  # noqa: ANN001
    return [strategy.accounting.rounds[r].replies for r in sorted(strategy.accounting.rounds)]


@pytest.fixture
def old_screen(monkeypatch):  # noqa: ANN201
    """The screen of before the fallback: the history alone decides (never stale, never spared by the round,
    a streamed reply beyond it rejected at once)."""
    monkeypatch.setattr(screening, "history_is_stale", lambda exceeding, judged: False)
    monkeypatch.setattr(
        UpdateScreen,
        "spared_bounds",
        lambda self, history, norms, what_updates=True: (
            [history] * len(norms) if history is not None else self.within_round_bounds(norms)
        ),
    )
    monkeypatch.setattr(StreamedRound, "hold_if_beyond_history", lambda self, update: False)


@pytest.mark.parametrize("buffer_grows", [False, True], ids=["updates-grow", "running-var-grows"])
@pytest.mark.parametrize("streaming", [False, True], ids=["kept", "streamed"])
def test_without_the_fallback_every_round_after_the_switch_is_rejected(old_screen, streaming, buffer_grows) -> None:  # noqa: ANN001
    strategy = fed_ams(streaming)
    trail = params_after_each_round(strategy, ROUNDS, buffer_grows)
    assert moved(trail) == [True] * (SWITCH - 1) + [False] * (ROUNDS - SWITCH + 1)
    assert replies_per_round(strategy)[SWITCH - 1 :] == [0] * (ROUNDS - SWITCH + 1)


@pytest.mark.parametrize("buffer_grows", [False, True], ids=["updates-grow", "running-var-grows"])
def test_the_kept_path_accepts_the_round_of_the_switch_and_every_later_one(buffer_grows) -> None:  # noqa: ANN001
    strategy = fed_ams(streaming=False)
    with capture_flwr_logs() as logs:
        trail = params_after_each_round(strategy, ROUNDS, buffer_grows)
    assert all(moved(trail)) and replies_per_round(strategy) == [len(NODES)] * ROUNDS
    what = "holders of buffer 'bn.running_var'" if buffer_grows else "updates"
    assert f"round {SWITCH}: 8 of 8 {what} exceed the history bound" in messages_text(logs)
    assert messages_text(logs).count("stale") == 1  # once: the history then describes the new regime


@pytest.mark.parametrize("buffer_grows", [False, True], ids=["updates-grow", "running-var-grows"])
def test_the_streamed_path_accepts_the_round_of_the_switch_too(buffer_grows) -> None:  # noqa: ANN001
    """A streamed round holds the replies beyond the history to its end and judges them within the round:
    the switch round is accepted whole, its end drops the stale history, the next round keeps its replies
    and judges itself (as round 1), and streams again after."""
    strategy = fed_ams(streaming=True)
    streamed_rounds = []
    original = strategy.round_aggregate.sink
    strategy.round_aggregate.sink = lambda own, rnd, bound: streamed_rounds.append(rnd) or original(own, rnd, bound)
    with capture_flwr_logs() as logs:
        trail = params_after_each_round(strategy, ROUNDS, buffer_grows)
    assert all(moved(trail)) and replies_per_round(strategy) == [len(NODES)] * ROUNDS
    assert streamed_rounds == [2, SWITCH, *range(SWITCH + 2, ROUNDS + 1)]  # round SWITCH + 1 judged itself
    what = "holders of buffer 'bn.running_var'" if buffer_grows else "updates"
    assert f"round {SWITCH}: 8 of 8 {what} exceeded the history bound" in messages_text(logs)


@pytest.mark.parametrize("buffer_grows", [False, True], ids=["updates-grow", "running-var-grows"])
def test_the_streamed_and_the_kept_path_give_the_same_bits_across_the_switch(buffer_grows) -> None:  # noqa: ANN001
    kept = params_after_each_round(fed_ams(streaming=False), ROUNDS, buffer_grows)
    streamed = params_after_each_round(fed_ams(streaming=True), ROUNDS, buffer_grows)
    assert all(np.array_equal(a, b) for a, b in zip(kept, streamed))


def test_an_honest_minority_that_grew_with_its_round_is_spared_and_the_history_kept() -> None:
    """3 of 8 updates at 12 (history about 1: bound 10), the other 5 at 2: each 12 is within 10x the median
    of the others (2), so it passes; not more than half exceeded the history, which stays."""
    screen = screen_with_history()
    updates = [update(12.0) for _ in range(3)] + [update(2.0) for _ in range(5)]
    kept, rejected, logs = judged(screen, updates)
    assert sorted(map(id, kept)) == sorted(map(id, updates)) and not rejected
    assert kept == updates[3:] + updates[:3]  # beyond the history last, the order a streamed round sums in
    assert "stale" not in logs and len(screen.history) == 3


def test_near_convergence_a_client_still_learning_is_not_an_outlier_of_a_median_of_almost_nothing() -> None:
    """Three clients moved 0.03, one 2.14, on a model of norm 40 (quickstart-pytorch, round 18): the reference
    is floored at 1% of the model's norm (0.4, a bound of 4), so the learner passes; 10x that floor does not."""
    screen = UpdateScreen(rule="reject")
    norms = [0.03, 0.03, 2.14, 0.03]
    assert screen.update_bounds(norms)[2] == pytest.approx(0.3)  # without the model's norm: 10 x 0.03
    screen.set_model_norm(40.0)
    assert screen.update_bounds(norms)[2] == pytest.approx(4.0)
    kept, rejected, _ = judged(screen, [update(n) for n in norms])
    assert len(kept) == 4 and not rejected
    kept, rejected, _ = judged(screen, [update(n) for n in (0.03, 0.03, 41.0, 0.03)])
    assert len(kept) == 3 and len(rejected) == 1
    assert screen.spared_bounds(None, [0.03, 0.03], "extra:v") == pytest.approx([0.3, 0.3])  # records: no floor


def test_a_streamed_round_holds_what_exceeds_its_history_and_settles_it_within_the_round() -> None:
    screen = screen_with_history()
    streamed = StreamedRound(screen, screen.bound(), {})
    honest = [update(2.0) for _ in range(5)]
    grown, hostile = [update(12.0) for _ in range(2)], update(1e4)
    admitted, rejected = [], []
    for u in [grown[0], *honest, hostile, grown[1]]:
        streamed.count(u)
        if not streamed.hold_if_beyond_history(u):
            admitted.append(u)
    assert admitted == honest and streamed.held == [grown[0], hostile, grown[1]]
    out = streamed.settle(lambda u, why: rejected.append((u, why)), admitted.append)
    assert admitted == [*honest, grown[0], grown[1]] and out == {id(hostile)}
    assert len(rejected) == 1 and rejected[0][0] is hostile and "outlier screen" in rejected[0][1]


def test_a_hostile_minority_after_the_switch_is_still_rejected() -> None:
    """Round 4 (after the switch), 3 of 8 clients send 1e3x the others: rejected against the new history."""
    honest = regime_client()

    def client(msg):  # noqa: ANN001, ANN202
        out = honest(msg)
        node, rnd = msg.metadata.dst_node_id, int(config_of(msg)[protocol.CFG_SERVER_ROUND])
        if rnd == SWITCH + 1 and node in NODES[:3]:
            arrays = named_arrays(out.content.array_records[protocol.ARRAYS_RECORD])
            arrays["conv.bias"] = arrays["conv.bias"] + np.float32(100.0)
            return full_model_reply(msg, arrays, **{"grad-evals": 10})
        return out

    for streaming in (False, True):
        strategy = fed_ams(streaming)
        strategy.start(
            grid=FakeGrid(NODES, client, client_ids=IDS), initial_arrays=model_record(tiny_model()), num_rounds=5
        )
        reasons = strategy.accounting.rounds[SWITCH + 1].failure_reasons
        assert len(reasons) == 3 and all("outlier screen" in r for r in reasons), reasons
        assert strategy.accounting.rounds[SWITCH + 1].replies == 5


def test_flowers_fedadam_metered_accepts_every_round_after_the_switch() -> None:
    strategy = MeteredFedAdam(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=len(NODES))
    random.seed(0)
    with capture_flwr_logs() as logs:
        strategy.start(
            grid=FakeGrid(NODES, regime_client()), initial_arrays=model_record(tiny_model()), num_rounds=ROUNDS
        )
    assert [strategy.accounting.rounds[r].replies for r in range(1, ROUNDS + 1)] == [len(NODES)] * ROUNDS
    assert f"round {SWITCH}: 8 of 8 updates exceed the history bound" in messages_text(logs)


def test_flowers_fedadam_metered_stalled_without_the_fallback(old_screen) -> None:  # noqa: ANN001
    strategy = MeteredFedAdam(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=len(NODES))
    random.seed(0)
    strategy.start(grid=FakeGrid(NODES, regime_client()), initial_arrays=model_record(tiny_model()), num_rounds=4)
    assert [strategy.accounting.rounds[r].replies for r in range(1, 5)] == [8, 8, 0, 0]


HAFED_CLUSTERS = {node: str(i // 4) for i, node in enumerate(NODES)}


def hafed_run(rounds: int) -> HAFed:
    strategy = HAFed(
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True), screen=UpdateScreen(rule="reject")),
        min_available_nodes=len(NODES),
        local_steps=2,
    )
    grid = FakeGrid(NODES, regime_client(), client_ids=IDS, cluster_ids=HAFED_CLUSTERS)
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=rounds)
    return strategy


def test_hafed_accepts_its_uploaders_after_the_switch() -> None:
    with capture_flwr_logs() as logs:
        strategy = hafed_run(5)
    uploads = [strategy.accounting.rounds[r].replies for r in range(1, 6)]
    assert uploads[0] > 0 and uploads == [uploads[0]] * 5
    assert f"round {SWITCH}: " in messages_text(logs) and "the history is stale" in messages_text(logs)


def test_hafed_stalled_without_the_fallback(old_screen) -> None:  # noqa: ANN001
    strategy = hafed_run(4)
    assert [strategy.accounting.rounds[r].replies for r in (SWITCH, SWITCH + 1)] == [0, 0]


# ---------------------------------------------------------------------------- save and resume
@pytest.mark.parametrize("stop_after", [SWITCH, SWITCH + 1], ids=["after-the-dropping-round", "after-the-next"])
def test_a_run_resumed_after_the_history_was_dropped_ends_bit_identical(stop_after, tmp_path) -> None:  # noqa: ANN001
    x0 = model_record(model(buffer_grows=True))

    def start(strategy, checkpoint):  # noqa: ANN001, ANN202
        grid = FakeGrid(NODES, regime_client(buffer_grows=True), client_ids=IDS)
        return strategy.start(grid=grid, initial_arrays=x0, num_rounds=ROUNDS, checkpoint=checkpoint)

    full = fed_ams(streaming=True)
    want = start(full, RunCheckpoint(tmp_path / "full"))
    with pytest.raises(RunInterrupted):
        start(fed_ams(streaming=True), RunCheckpoint(tmp_path / "crash", stop_after_round=stop_after))
    resumed = fed_ams(streaming=True)
    got = start(resumed, RunCheckpoint(tmp_path / "crash", resume=True))
    for key, value in named_arrays(want.arrays).items():
        assert value.tobytes() == named_arrays(got.arrays)[key].tobytes(), key
    assert resumed.screen.state_dict() == full.screen.state_dict()
    assert replies_per_round(full)[SWITCH:] == [len(NODES)] * (ROUNDS - SWITCH)
