"""The buffered asynchronous driver (issue 38; ``async.md``) on a fake grid whose replies arrive at random.

The fake clients return ``x_start + Delta(node, round)`` with a known ``Delta``; the grid hands replies
back in a seeded random order across pulls (``arrival_seed``), as clients finishing at arbitrary times.
Checked: the spec's exact reductions (FADAS with buffer = concurrency = clients per round is synchronous
FedAMS bit for bit; FedBuff without staleness weights the synchronous mean step), the staleness of each
step against the virtual clock, each rule's arithmetic (FedBuff's weights, FedAsync's mixing, FADAS's
delay-adaptive rate), bit-identical runs whatever the arrival order, refusals before round 1 with a
reason, too-stale replies refused and counted, and error feedback exact under asynchrony.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from pollen.asynchrony import ClientSpeed, StalenessWeight, parse_speed
from pollen.strategies import FedAMS, FedOpt
from pollen.strategies.engine.buffered import AsyncRule, BufferedAsync
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.strategies.engine.rounds import SetupError, SyncRounds
from pollen.testing.fakes import (
    TRAINABLE,
    FakeGrid,
    config_of,
    flat_trainable,
    full_model_reply,
    global_arrays_of,
    model_record,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

D = 19
N = 6


def delta_of(node: int, rnd: int) -> np.ndarray:
    return (np.random.default_rng([node, rnd]).standard_normal(D) * 0.1).astype(np.float32)


def client(msg):  # noqa: ANN001, ANN201
    """``x_start + Delta(node, round)``, the round being the one the message names."""
    node, rnd = msg.metadata.dst_node_id, int(config_of(msg)[protocol.CFG_SERVER_ROUND])
    start = global_arrays_of(msg)
    local = dict(start)
    for name, part in split_trainable(delta_of(node, rnd), start, TRAINABLE).items():
        local[name] = (start[name] + part).astype(start[name].dtype)
    return full_model_reply(msg, local)


def build(cls: Any = FedAMS, driver: Any = None, n: int = 4, **kwargs: Any) -> Any:
    parts = EngineParts(sampler=ClientSampler(seed=3), **({"driver": driver} if driver is not None else {}))
    return cls(
        fraction_train=n / N,
        min_train_nodes=n,
        fraction_evaluate=0.0,
        min_evaluate_nodes=0,
        min_available_nodes=n,
        parts=parts,
        **kwargs,
    )


def run(strategy: Any, rounds: int, arrival_seed: int | None = 0) -> dict[str, np.ndarray]:
    grid = FakeGrid(range(1, N + 1), client, arrival_seed=arrival_seed)
    result = strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=rounds)
    return {name: array.numpy() for name, array in result.arrays.items()}


def same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def method_column(strategy: Any, name: str) -> list[Any]:
    rounds = strategy.accounting.rounds
    return [rounds[r].method.get(name) for r in sorted(rounds)]


# --------------------------------------------------------------------------- exact reductions (§0.7, §9.1-9.2)
@pytest.mark.parametrize("speed", ["constant", "uniform:1:5", "stragglers:0.5:5:10"])
def test_fadas_with_buffer_equal_to_concurrency_is_synchronous_fedams_bit_for_bit(speed: str) -> None:
    sync = run(build(), rounds=5)
    driver = BufferedAsync(
        concurrency=4, buffer_size=4, refill="flush", rule=AsyncRule.fadas(), speed=parse_speed(speed, 1)
    )
    strategy = build(driver=driver)
    assert same_bits(run(strategy, rounds=5, arrival_seed=7), sync)
    assert method_column(strategy, "async_staleness_max") == [0] * 5


def test_fedbuff_without_staleness_weights_is_the_synchronous_mean_step() -> None:
    sync = run(build(FedOpt, optimizer="sgd", eta=0.7), rounds=4)
    rule = AsyncRule("fedbuff", StalenessWeight("constant"))
    driver = BufferedAsync(concurrency=4, buffer_size=4, refill="flush", rule=rule, speed=parse_speed("uniform:1:3"))
    assert same_bits(run(build(FedOpt, driver=driver, optimizer="sgd", eta=0.7), rounds=4, arrival_seed=3), sync)


# --------------------------------------------------------------------------- staleness on the virtual clock
def test_with_constant_durations_and_a_buffer_of_one_every_reply_after_the_first_wave_is_c_minus_1_stale() -> None:
    """§9.8: C jobs started together finish in job order (tau 0, 1, .., C-1); each later one was sent C-1
    steps before it is applied."""
    c = 3
    driver = BufferedAsync(concurrency=c, buffer_size=1, rule=AsyncRule.fedbuff(), speed=ClientSpeed("constant"))
    strategy = build(FedOpt, driver=driver, n=c, optimizer="sgd", eta=1.0)
    run(strategy, rounds=9, arrival_seed=5)
    assert method_column(strategy, "async_staleness_max") == [0, 1, 2] + [c - 1] * 6
    assert method_column(strategy, "async_virtual_time") == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0]


def test_fedbuff_step_is_the_mean_of_staleness_weighted_updates() -> None:
    """With a server SGD of lr 1 each step moves the model by mean_j (1+tau_j)^-1/2 Delta_j exactly."""
    seen: list[tuple[int, int, int]] = []  # (step, node, round its message named)
    driver = BufferedAsync(
        concurrency=4, buffer_size=2, rule=AsyncRule.fedbuff(), speed=parse_speed("stragglers:0.5:3:6", 2)
    )
    strategy = build(FedOpt, driver=driver, optimizer="sgd", eta=1.0)
    models = {}
    original = strategy.aggregate_train

    def spy(step, replies):  # noqa: ANN001, ANN202
        models[step - 1] = strategy.params.copy()
        jobs = strategy.jobs
        for reply in replies:
            node = reply.metadata.src_node_id
            seen.append((step, node, jobs.sent_round(strategy.sampler.key(node), step)))
        out = original(step, replies)
        models[step] = strategy.params.copy()
        return out

    strategy.aggregate_train = spy
    run(strategy, rounds=6, arrival_seed=1)
    taus = method_column(strategy, "async_staleness_max")
    assert max(taus) >= 1, "stragglers make some replies stale"
    for step in range(1, 7):
        mine = [(node, sent) for s, node, sent in seen if s == step]
        want = np.mean([(1 + (step - sent)) ** -0.5 * delta_of(node, sent) for node, sent in mine], axis=0)
        np.testing.assert_allclose(models[step] - models[step - 1], want, rtol=1e-5, atol=1e-7)


def test_fedasync_with_alpha_one_and_one_job_in_flight_is_fedbuff_with_a_buffer_of_one() -> None:
    """§9.4: with one job in flight both take the client's model as the new model."""
    fedasync = BufferedAsync(concurrency=1, buffer_size=1, rule=AsyncRule.fedasync(alpha=1.0, kind="constant"))
    fedbuff = BufferedAsync(concurrency=1, buffer_size=1, rule=AsyncRule("fedbuff", StalenessWeight("constant")))
    a = run(build(FedOpt, driver=fedasync, n=1, optimizer="sgd", eta=1.0), rounds=3)
    b = run(build(FedOpt, driver=fedbuff, n=1, optimizer="sgd", eta=1.0), rounds=3)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7)
    assert not np.allclose(flat_trainable(a), flat_trainable(tiny_model()))


def test_fedasync_mixes_against_the_current_model_not_the_one_the_job_started_from() -> None:
    """With two jobs in flight the second reply is one step stale: x <- (1 - a) x + a x_client."""
    alpha = 0.5
    rule = AsyncRule.fedasync(alpha=alpha, kind="constant")
    driver = BufferedAsync(concurrency=2, buffer_size=1, rule=rule, speed=ClientSpeed("uniform", (1.0, 2.0), 4))
    strategy = build(FedOpt, driver=driver, n=2, optimizer="sgd", eta=1.0)
    before: dict[int, np.ndarray] = {}
    starts: dict[int, np.ndarray] = {}
    original = strategy.aggregate_train

    def spy(step, replies):  # noqa: ANN001, ANN202
        before[step] = strategy.params.copy()
        (reply,) = replies
        node = reply.metadata.src_node_id
        sent = strategy.jobs.sent_round(strategy.sampler.key(node), step)
        starts[step] = (strategy.jobs.bases[node].copy(), delta_of(node, sent))
        return original(step, replies)

    strategy.aggregate_train = spy
    final = flat_trainable(run(strategy, rounds=4, arrival_seed=2))
    steps = sorted(before)
    after = [before[s] for s in steps[1:]] + [final]
    for s, x_after in zip(steps, after):
        base, delta = starts[s]
        want = (1 - alpha) * before[s].astype(np.float64) + alpha * (base.astype(np.float64) + delta)
        np.testing.assert_allclose(x_after, want, rtol=1e-5, atol=1e-6)
    assert max(method_column(strategy, "async_staleness_max")) == 1


def test_fadas_shrinks_the_step_by_the_stalest_reply_beyond_tau_c() -> None:
    driver = BufferedAsync(
        concurrency=4, buffer_size=1, rule=AsyncRule.fadas(tau_c=1), speed=parse_speed("stragglers:0.5:4:8", 3)
    )
    strategy = build(driver=driver)
    run(strategy, rounds=10)
    taus = method_column(strategy, "async_staleness_max")
    scales = method_column(strategy, "async_lr_scale")
    assert any(t > 1 for t in taus)
    assert scales == [1.0 if t <= 1 else 1.0 / t for t in taus]


# --------------------------------------------------------------------------- determinism
def test_a_run_is_bit_identical_whatever_the_arrival_order_and_differs_with_another_speed_seed() -> None:
    def once(arrival: int, speed_seed: int) -> dict[str, np.ndarray]:
        driver = BufferedAsync(
            concurrency=4, buffer_size=2, rule=AsyncRule.fadas(), speed=parse_speed("lognormal:0.8", speed_seed)
        )
        return run(build(driver=driver), rounds=6, arrival_seed=arrival)

    first = once(1, 0)
    assert same_bits(once(2, 0), first)
    assert same_bits(once(99, 0), first)
    assert not same_bits(once(1, 5), first)


def test_the_sync_driver_with_a_speed_model_counts_each_round_as_its_slowest_client() -> None:
    speed = parse_speed("uniform:1:3", 4)
    strategy = build(driver=SyncRounds(speed=speed))
    grid = FakeGrid(range(1, N + 1), client)
    timed = strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=3)
    timed = {name: array.numpy() for name, array in timed.arrays.items()}
    assert same_bits(timed, run(build(), rounds=3, arrival_seed=None)), "the clock changes nothing of the model"
    clock = method_column(strategy, "async_virtual_time")
    first_round = [m.metadata.dst_node_id for m in grid.calls[0]]
    assert clock[0] == max(speed.duration(f"node-{n}", 0) for n in first_round)
    assert all(b > a for a, b in zip(clock, clock[1:]))


# --------------------------------------------------------------------------- refusals and limits
def test_methods_that_need_lock_step_rounds_refuse_the_driver_before_round_1() -> None:
    from pollen.strategies import FedLAMB, FedLazy, HAFed

    for cls, words in ((HAFed, "gossip"), (FedLAMB, "sync rounds"), (FedLazy, "reference")):
        strategy = build(cls, driver=BufferedAsync(concurrency=2, buffer_size=1))
        grid = FakeGrid(range(1, N + 1), client)
        with pytest.raises(SetupError, match=words):
            strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=2)
        assert not grid.sent, "nothing was sent"


def test_flowers_own_strategies_refuse_the_driver() -> None:
    from pollen.strategies.baselines import MeteredFedAvg

    strategy = MeteredFedAvg(parts=EngineParts(driver=BufferedAsync(concurrency=2, buffer_size=1)))
    with pytest.raises(SetupError, match="engine"):
        strategy.start(grid=FakeGrid(range(1, N + 1), client), initial_arrays=model_record(tiny_model()))


def test_more_jobs_than_nodes_is_refused_with_the_count() -> None:
    strategy = build(driver=BufferedAsync(concurrency=N + 1, buffer_size=2))
    with pytest.raises(SetupError, match=f"concurrency <= {N}"):
        run(strategy, rounds=1)


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"concurrency": 2, "buffer_size": 3}, "buffer_size <= concurrency"),
        ({"concurrency": 0}, "integer >= 1"),
        ({"concurrency": 2, "refill": "sometimes"}, "reply, flush"),
        ({"concurrency": 2, "clock": "wall"}, "virtual, real"),
        ({"concurrency": 2, "max_staleness": -1}, "integer >= 0"),
    ],
)
def test_bad_driver_settings_are_refused_with_what_is_allowed(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        BufferedAsync(**settings)


def test_too_stale_replies_are_refused_and_counted() -> None:
    driver = BufferedAsync(
        concurrency=4,
        buffer_size=1,
        max_staleness=1,
        rule=AsyncRule.fedbuff(),
        speed=parse_speed("stragglers:0.5:5:8", 3),
    )
    strategy = build(driver=driver)
    run(strategy, rounds=8)
    refused = sum(v or 0 for v in method_column(strategy, "async_too_stale"))
    reasons = [r for s in strategy.accounting.rounds.values() for r in s.failure_reasons]
    assert refused >= 1 and sum("max_staleness=1" in r for r in reasons) == refused
    assert max(method_column(strategy, "async_staleness_max")) <= 1


# --------------------------------------------------------------------------- error feedback under asynchrony
def test_error_feedback_stays_exact_when_uploads_are_applied_late_refused_as_too_stale_or_left_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per client: applied + residual + owed = the sum of its true updates (§8.1), with FedCAMS's codec on
    pollen's client mods, replies applied steps after they were sent, some refused as too stale, and jobs
    still in flight when the run ends."""
    from tests.flower.test_error_feedback_exact import NODES as EF_NODES
    from tests.flower.test_error_feedback_exact import Harness, _build

    harness = Harness(monkeypatch)
    settings = {
        "driver": "async",
        "concurrency": 3,
        "buffer-size": 1,
        "max-staleness": 1,
        "client-speed": "stragglers:0.5:3:6",
    }
    strategy = _build("fedcams", **settings)
    original = strategy.aggregate_train

    def aggregate(step, replies):  # noqa: ANN001, ANN202
        harness.taken = []
        new, metrics = original(step, replies)
        if new is not None:
            for key, delta in harness.taken:
                harness.applied[key].append(delta)
        return new, metrics

    strategy.aggregate_train = aggregate
    grid = FakeGrid(EF_NODES, harness.client, client_ids={n: f"c{n}" for n in EF_NODES}, arrival_seed=4)
    steps = 10
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model(2)), num_rounds=steps)
    assert sum(v or 0 for v in method_column(strategy, "async_too_stale")) >= 1, "some replies were too stale"
    assert max(method_column(strategy, "async_staleness_max")) == 1
    assert strategy.ledger.rounds, "uploads were applied, and the clients told"
    for node in EF_NODES:
        key = f"c{node}"
        applied = np.sum(harness.applied[key], axis=0) if harness.applied[key] else np.zeros(D)
        dropped = np.sum(harness.dropped[key], axis=0) if harness.dropped[key] else np.zeros(D)
        balance = applied + dropped + harness.residual(node) + harness.owed_now(strategy, node, steps + 2)
        np.testing.assert_allclose(balance, np.sum(harness.true[key], axis=0), atol=2e-5, err_msg=key)


# --------------------------------------------------------------------------- replies that go wrong
class ScriptedGrid(FakeGrid):
    """A fake grid that can hold a node's first reply back for a while, send it twice, or sign it as another node."""

    def __init__(self, *, hold: float = 0.0, twice: bool = False, claim: int | None = None, **kwargs: Any) -> None:
        super().__init__(range(1, N + 1), client, **kwargs)
        self.hold, self.twice, self.claim = hold, twice, claim
        self.target_id: str | None = None
        self.pushed_at = 0.0

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for msg, mid in zip(messages, ids):
            if msg.metadata.dst_node_id == 2 and self.target_id is None:
                self.target_id, self.pushed_at = mid, time.monotonic()
                reply = self._waiting[mid]
                if self.claim is not None:
                    reply.metadata.__dict__["_src_node_id"] = self.claim
        return ids

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        time.sleep(0.002)  # a pull takes a while, as through a SuperLink
        message_ids = list(message_ids)
        if self.target_id in message_ids and time.monotonic() - self.pushed_at < self.hold:
            message_ids.remove(self.target_id)
        extra = self._waiting.get(self.target_id) if self.twice and self.target_id in message_ids else None
        out = list(super().pull_messages(message_ids))
        return out + [extra] if extra is not None and extra in out else out


def _reasons(strategy: Any) -> list[str]:
    return [r for s in strategy.accounting.rounds.values() for r in s.failure_reasons]


def test_a_job_without_a_reply_is_dropped_after_the_timeout_and_its_late_reply_refused() -> None:
    strategy = build(driver=BufferedAsync(concurrency=3, buffer_size=1, rule=AsyncRule.fadas()))
    grid = ScriptedGrid(hold=0.4)
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=150, timeout=0.25)
    reasons = _reasons(strategy)
    assert sum("no reply before the timeout" in r for r in reasons) == 1, reasons
    assert sum("late reply to a job dropped after the timeout" in r for r in reasons) == 1, reasons
    jobs_of_2 = [m for m in grid.sent if m.metadata.dst_node_id == 2]
    assert len(jobs_of_2) >= 2, "node 2 got work again once its late reply came"


def test_two_answers_to_one_job_are_both_refused_and_the_run_goes_on() -> None:
    """Issue 43: which answer is the node's own is not the server's to guess; arrival order must not decide."""
    strategy = build(driver=BufferedAsync(concurrency=3, buffer_size=2, rule=AsyncRule.fedbuff()))
    strategy.start(grid=ScriptedGrid(twice=True), initial_arrays=model_record(tiny_model()), num_rounds=5)
    reasons = _reasons(strategy)
    assert sum("two answers to one message: both refused" in r for r in reasons) == 2, reasons
    assert all(strategy.accounting.rounds[s].replies == 2 for s in range(1, 6))


def test_a_reply_signed_by_another_node_is_refused() -> None:
    strategy = build(driver=BufferedAsync(concurrency=3, buffer_size=1, rule=AsyncRule.fedbuff()))
    strategy.start(grid=ScriptedGrid(claim=5), initial_arrays=model_record(tiny_model()), num_rounds=5, timeout=0.3)
    reasons = _reasons(strategy)
    assert sum("job came from node 5" in r for r in reasons) == 1, reasons
    assert sum("no reply before the timeout" in r for r in reasons) == 1, "node 2's own reply never came"


# --------------------------------------------------------------------------- FedAdaVR's table as CA2FL's cache
@pytest.mark.parametrize("variant", ["fedvarp", "fedadavr"])
def test_fedadavr_with_buffer_equal_to_concurrency_is_the_synchronous_table_method(variant: str) -> None:
    """§9.3: with every reply fresh, the table under the async driver is the synchronous method bit for bit."""
    from pollen.strategies import FedAdaVR

    sync = run(build(FedAdaVR, variant=variant, num_clients=N), rounds=5)
    driver = BufferedAsync(concurrency=4, buffer_size=4, refill="flush", speed=parse_speed("uniform:1:4", 2))
    asynchronous = build(FedAdaVR, driver=driver, variant=variant, num_clients=N)
    assert same_bits(run(asynchronous, rounds=5, arrival_seed=6), sync)


def test_fedadavr_keeps_each_clients_latest_applied_update_as_ca2fl_does_under_staleness() -> None:
    """CA2FL's cache (``async.md`` §5): after the run each client's row is its latest *applied* update (taken
    against the model its job started from, in the table's gradient units), however stale it was."""
    from pollen.strategies import FedAdaVR

    driver = BufferedAsync(
        concurrency=4, buffer_size=2, rule=AsyncRule.fadas(), speed=parse_speed("stragglers:0.5:3:6", 5)
    )
    strategy = build(FedAdaVR, driver=driver, variant="fedvarp", num_clients=N, client_lr=0.5)
    latest: dict[str, np.ndarray] = {}
    original = strategy.aggregate_train

    def spy(step, replies):  # noqa: ANN001, ANN202
        keys = {r.metadata.src_node_id: strategy.sampler.key(r.metadata.src_node_id) for r in replies}
        sent = {node: strategy.jobs.sent_round(key, step) for node, key in keys.items()}  # set while the step runs
        out = original(step, replies)
        if out[0] is not None:
            latest.update({keys[node]: delta_of(node, sent[node]) for node in keys})
        return out

    strategy.aggregate_train = spy
    run(strategy, rounds=8, arrival_seed=2)
    assert max(method_column(strategy, "async_staleness_max")) >= 1
    assert latest
    for key, delta in latest.items():
        np.testing.assert_allclose(strategy.store.table.get(key), delta / 0.5, rtol=1e-5, atol=1e-6, err_msg=key)


def test_when_no_more_replies_can_come_the_step_takes_the_buffer_it_has() -> None:
    """Buffer = concurrency = all clients, one client's job fails: no job is in flight and no client is idle,
    so the step goes on with the other replies (as a synchronous round does), not a stalled run."""
    from pollen.testing.fakes import error_reply

    def failing(msg):  # noqa: ANN001, ANN202
        if msg.metadata.dst_node_id == 2 and int(config_of(msg)[protocol.CFG_SERVER_ROUND]) == 2:
            return error_reply(msg, "out of memory")
        return client(msg)

    strategy = build(driver=BufferedAsync(concurrency=3, buffer_size=3, refill="flush"), n=3)
    grid = FakeGrid(range(1, 4), failing)
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=3)
    rounds = strategy.accounting.rounds
    assert [rounds[s].replies for s in (1, 2, 3)] == [3, 2, 3]
    assert any("out of memory" in r for r in rounds[2].failure_reasons), rounds[2].failure_reasons


def test_a_superlink_error_reply_ends_its_job_at_once_as_not_delivered() -> None:
    """Flower's SuperLink answers a message it cannot deliver itself (node id 1): the job ends then, counted
    against its own node, not after the timeout against a phantom node."""
    from flwr.app import Error, Message

    from pollen.strategies.engine.flight import SUPERLINK_NODE_ID

    def undeliverable(msg):  # noqa: ANN001, ANN202
        if msg.metadata.dst_node_id == 3 and int(config_of(msg)[protocol.CFG_SERVER_ROUND]) == 2:
            reply = Message(Error(code=3, reason="Node unavailable"), reply_to=msg)
            reply.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
            return reply
        return client(msg)

    strategy = build(driver=BufferedAsync(concurrency=3, buffer_size=3, refill="flush"), n=3)
    started = time.monotonic()
    strategy.start(
        grid=FakeGrid(range(1, 4), undeliverable), initial_arrays=model_record(tiny_model()), num_rounds=3,
        timeout=30,
    )  # fmt: skip
    assert time.monotonic() - started < 10, "the job waited for its timeout"
    reasons = _reasons(strategy)
    assert [r for r in reasons if "not delivered" in r] == ["node-3: train message not delivered: Node unavailable"]
    assert [strategy.accounting.rounds[s].replies for s in (1, 2, 3)] == [3, 2, 3]


def test_a_step_whose_every_job_failed_is_skipped_and_the_run_goes_on() -> None:
    from pollen.testing.fakes import error_reply

    def failing(msg):  # noqa: ANN001, ANN202
        if int(config_of(msg)[protocol.CFG_SERVER_ROUND]) == 2:
            return error_reply(msg, "disk full")
        return client(msg)

    strategy = build(driver=BufferedAsync(concurrency=3, buffer_size=3, refill="flush"), n=3)
    strategy.start(grid=FakeGrid(range(1, 4), failing), initial_arrays=model_record(tiny_model()), num_rounds=4)
    rounds = strategy.accounting.rounds
    assert [rounds[s].replies for s in (1, 2, 3, 4)] == [3, 0, 3, 3]
    assert sum("disk full" in r for r in rounds[2].failure_reasons) == 3
    # the skipped step changed no model: the next step's replies are fresh against it
    assert method_column(strategy, "async_staleness_max")[2:] == [0, 0]


def test_fadas_paper_form_keeps_a_small_learning_rate_where_the_code_form_divides_it() -> None:
    """§9.6: with eta = 1e-3 and tau_max = 4, the code form gives eta / 4, the paper form min(eta, 1/4) = eta."""
    from pollen.asynchrony import delay_adaptive_scale

    assert delay_adaptive_scale(4, 1, 1e-3, "code") == 0.25
    assert delay_adaptive_scale(4, 1, 1e-3, "paper") == 1.0

    def scales(form: str) -> list[float]:
        driver = BufferedAsync(
            concurrency=4, buffer_size=1, rule=AsyncRule.fadas(da_form=form), speed=parse_speed("stragglers:0.5:4:8", 3)
        )
        strategy = build(driver=driver, eta=1e-3)
        run(strategy, rounds=10)
        return method_column(strategy, "async_lr_scale")

    code, paper = scales("code"), scales("paper")
    assert min(code) < 1.0 and set(paper) == {1.0}


def test_the_delay_adaptive_rate_and_the_staleness_record_count_only_the_replies_the_step_applied() -> None:
    """A stale reply the outlier screen refuses must not shrink the step's learning rate."""
    from pollen.strategies.engine.screening import UpdateScreen

    def huge_when_stale(msg):  # noqa: ANN001, ANN202
        reply = client(msg)
        if msg.metadata.dst_node_id == 1:  # node 1's every update is 1e4 times the others': refused
            arrays = global_arrays_of(msg)
            local = dict(arrays)
            for name, part in split_trainable(delta_of(1, 0) * 1e4, arrays, TRAINABLE).items():
                local[name] = (arrays[name] + part).astype(arrays[name].dtype)
            reply = full_model_reply(msg, local)
        return reply

    driver = BufferedAsync(
        concurrency=4, buffer_size=2, rule=AsyncRule.fadas(), speed=parse_speed("stragglers:0.5:4:8", 3)
    )
    parts = EngineParts(sampler=ClientSampler(seed=3), driver=driver, screen=UpdateScreen(rule="reject", factor=5))
    strategy = FedAMS(fraction_train=1.0, min_train_nodes=4, fraction_evaluate=0.0, min_evaluate_nodes=0, parts=parts)
    strategy.start(
        grid=FakeGrid(range(1, N + 1), huge_when_stale), initial_arrays=model_record(tiny_model()), num_rounds=12
    )
    taus = method_column(strategy, "async_staleness_max")
    scales = method_column(strategy, "async_lr_scale")
    assert scales == [1.0 if t <= 1 else 1.0 / t for t in taus]
    refused = [
        s
        for s, st in strategy.accounting.rounds.items()
        if any("node 1" in r or "node-1" in r for r in st.failure_reasons)
    ]
    assert refused, "node 1's replies were refused by the screen"
