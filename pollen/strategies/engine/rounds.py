"""The round loop of pollen's strategies: Flower's ``Strategy.start``, plus mid-round exchanges and resume.

:class:`RoundLoop` keeps Flower's ``start(grid=..., initial_arrays=..., num_rounds=...)`` call and its
order of work (centralised evaluation of round 0; per round: train, federated evaluation, centralised
evaluation; a ``Result``), so a strategy drops in where ``FedAvg`` was. It adds:

- **mid-round exchanges**: after the train replies come back and before they are aggregated, the
  strategy's ``mid_round(server_round, grid, replies, timeout)`` may send further messages through the
  grid (gossip relays, a second pass) and returns the replies to aggregate; the default returns them
  unchanged;
- **resume**: with ``checkpoint=RunCheckpoint(path)`` the driver writes the global model, the strategy's
  full ``state_dict()`` and the results so far atomically after every round; with
  ``RunCheckpoint(path, resume=True)`` it continues from the last complete round, and a resumed run
  ends with the same parameters as an uninterrupted one (the strategy's sampling generator and all its
  state are restored; clients derive their randomness from the round number).

Flower itself (1.39 to the 1.43 nightly) always loops from round 1 and keeps no state.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from pollen.asynchrony import ClientSpeed
from pollen.core import state_fields as fields
from pollen.strategies.engine.resume import RunCheckpoint

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class SetupError(ValueError):
    """A setting that cannot work with the nodes that are connected; raised before round 1."""


class RunInterrupted(RuntimeError):
    """The loop stopped on purpose after a checkpointed round (``RunCheckpoint.stop_after_round``)."""

    def __init__(self, server_round: int, result: Result) -> None:
        super().__init__(f"stopped after round {server_round} as asked; the checkpoint can be resumed")
        self.server_round = server_round
        self.result = result


class SyncRounds:
    """The lock-step round driver: Flower's ``start`` loop, with mid-round exchanges and checkpoints.

    It drives any strategy that has Flower's four round methods (``configure_train``, ``aggregate_train``,
    ``configure_evaluate``, ``aggregate_evaluate``), ``summary``, ``mid_round``, ``check_setup`` and
    ``state_dict``/``load_state_dict``; it holds nothing between runs, so one driver object can serve
    any number of runs. A driver that does not move in rounds (buffered asynchronous aggregation) takes
    its place as another part, reusing the strategy's collector, screen, transaction and ledger.

    With a ``speed`` model (:class:`~pollen.asynchrony.ClientSpeed`) each round also advances a virtual clock
    by its slowest sampled client's job, written to the results as ``method.async_virtual_time``: the
    synchronous and the asynchronous driver are then compared on the same clients and the same clock.
    """

    def __init__(self, *, speed: ClientSpeed | None = None) -> None:
        self.timed = speed is not None
        self.speed = speed if speed is not None else ClientSpeed()

    def describe(self) -> dict[str, Any]:
        """The driver's settings, for the strategy's summary and the results."""
        return {"driver": "sync", **({"speed": self.speed.describe()} if self.timed else {})}

    def run(  # noqa: PLR0913 (Flower's signature, plus the strategy)
        self,
        strategy: Any,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        *,
        checkpoint: RunCheckpoint | None = None,
    ) -> Result:
        """Run ``num_rounds`` rounds of ``strategy`` as Flower's ``Strategy.start`` does (module docstring)."""
        log(INFO, "Starting %s strategy:", type(strategy).__name__)
        strategy.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        started = time.time()
        clock = RoundClock(self.speed) if self.timed else None
        first_round, arrays, result, saved = self.opening(
            strategy, initial_arrays, num_rounds, evaluate_fn, checkpoint, kind="sync"
        )
        if saved is not None and clock is not None and saved.driver_state:
            clock.load(saved.driver_state, checkpoint.path)

        if first_round <= num_rounds:
            strategy.check_setup(grid)
        for server_round in range(first_round, num_rounds + 1):
            if not self.may_release(strategy, server_round):
                break
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            arrays = self.train_round(strategy, server_round, grid, arrays, train_config, timeout, result, clock)
            self.evaluate_round(strategy, server_round, grid, arrays, evaluate_config, timeout, evaluate_fn, result)
            driver_state = clock.state_dict() if clock else None
            self.checkpointed(checkpoint, server_round, num_rounds, arrays, strategy, result, driver_state)
        return self.finished(result, started)

    # ------------------------------------------------------------------ what every driver does around its loop
    @staticmethod
    def opening(  # noqa: PLR0913
        strategy: Any,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        evaluate_fn: EvaluateFn | None,
        checkpoint: RunCheckpoint | None,
        *,
        kind: str,
    ) -> tuple[int, ArrayRecord, Result, Any]:
        """The first round, the model, the results and the checkpoint read (``None``: a fresh run): a resume
        from ``checkpoint`` (refused when another ``kind`` of driver wrote it), else the initial evaluation."""
        resume = checkpoint is not None and checkpoint.resume
        saved = checkpoint.load(strategy, num_rounds=num_rounds) if resume else None  # the round bounded by the run
        if saved is None:
            result = Result()
            if evaluate_fn:
                res = evaluate_fn(0, initial_arrays)
                log(INFO, "Initial global evaluation results: %s", res)
                if res is not None:
                    result.evaluate_metrics_serverapp[0] = res
            return 1, initial_arrays, result, None
        written_by = saved.driver_state.get("kind", "sync")  # a checkpoint of before drivers kept state: sync
        if written_by != kind:
            other = "asynchronous" if written_by == "async" else "synchronous"
            raise SetupError(f"the checkpoint was written by the {other} driver; resume it with that driver")
        log(INFO, "Resuming after round %d of %d from %s", saved.server_round, num_rounds, checkpoint.path)
        if len(saved.result.arrays) == 0:
            saved.result.arrays = saved.arrays
        return saved.server_round + 1, saved.arrays, saved.result, saved

    @staticmethod
    def may_release(strategy: Any, server_round: int) -> bool:
        """Whether the run may take ``server_round``: central DP's budget allows one more release (else it logs
        why and the run ends here, with the model of the last release)."""
        privacy = getattr(strategy, "privacy", None)
        return privacy is None or privacy.allows_release(server_round)

    @staticmethod
    def checkpointed(  # noqa: PLR0913
        checkpoint: RunCheckpoint | None,
        server_round: int,
        num_rounds: int,
        arrays: ArrayRecord,
        strategy: Any,
        result: Result,
        driver_state: dict[str, Any] | None,
    ) -> None:
        """Write the round's checkpoint (if any); stop here when the checkpoint asks to (``RunInterrupted``)."""
        if checkpoint is None:
            return
        checkpoint.save(server_round, arrays, strategy, result, driver_state)
        if checkpoint.stop_after_round == server_round and server_round < num_rounds:
            log(WARNING, "Stopping after round %d as asked (stop-after-round)", server_round)
            raise RunInterrupted(server_round, result)

    @staticmethod
    def finished(result: Result, started: float) -> Result:
        """Log the run's end and its results, as Flower's ``start`` does; ``result``."""
        log(INFO, "")
        log(INFO, "Strategy execution finished in %.2fs", time.time() - started)
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        return result

    def train_round(  # noqa: PLR0913
        self,
        strategy: Any,
        server_round: int,
        grid: Grid,
        arrays: ArrayRecord,
        config: ConfigRecord,
        timeout: float,
        result: Result,
        clock: RoundClock | None = None,
    ) -> ArrayRecord:
        """One training round: send, receive, mid-round exchanges, aggregate; the new arrays (or the old)."""
        messages = list(strategy.configure_train(server_round, arrays, config, grid))
        if clock is not None:
            clock.advance(strategy, server_round, messages)
        replies = list(grid.send_and_receive(messages=messages, timeout=timeout))
        replies = strategy.mid_round(server_round, grid, replies, timeout)
        new_arrays, metrics = strategy.aggregate_train(server_round, replies)
        if new_arrays is not None:
            result.arrays = new_arrays
            arrays = new_arrays
        if metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.train_metrics_clientapp[server_round] = metrics
        return arrays

    def evaluate_round(  # noqa: PLR0913
        self,
        strategy: Any,
        server_round: int,
        grid: Grid,
        arrays: ArrayRecord,
        config: ConfigRecord,
        timeout: float,
        evaluate_fn: EvaluateFn | None,
        result: Result,
    ) -> None:
        """Federated evaluation of ``arrays``, then the ServerApp's own (``evaluate_fn``), into ``result``."""
        messages = list(strategy.configure_evaluate(server_round, arrays, config, grid))
        replies = grid.send_and_receive(messages=messages, timeout=timeout) if messages else []
        metrics = strategy.aggregate_evaluate(server_round, replies)
        if metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.evaluate_metrics_clientapp[server_round] = metrics
        if evaluate_fn:
            res = evaluate_fn(server_round, arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[server_round] = res


class RoundClock:
    """A synchronous run's virtual clock: a round lasts as long as its slowest sampled client's job."""

    def __init__(self, speed: ClientSpeed) -> None:
        self.speed, self.now, self.jobs_of_client = speed, 0.0, {}

    def advance(self, strategy: Any, server_round: int, messages: list[Message]) -> None:
        """Move the clock past ``messages``' jobs and write it to the round's results (``async_virtual_time``)."""
        longest = 0.0
        for message in messages:
            client = strategy.sampler.key(message.metadata.dst_node_id)
            number = self.jobs_of_client.get(client, 0)
            self.jobs_of_client[client] = number + 1
            longest = max(longest, self.speed.duration(client, number))
        self.now += longest
        strategy.accounting.round(server_round).method["async_virtual_time"] = self.now

    def state_dict(self) -> dict[str, Any]:
        """The clock and each client's job count (a checkpoint's driver state)."""
        return {"kind": "sync", "clock": float(self.now), "jobs_of_client": dict(self.jobs_of_client)}

    def load(self, state: Any, path: Any) -> None:
        """Continue from :meth:`state_dict`'s form, checked (``SetupError`` naming the field)."""
        try:
            fields.mapping(state, "driver", keys=("kind", "clock", "jobs_of_client"))
            now = fields.finite_number(state["clock"], "driver/clock", low=0.0)
            counts = fields.mapping(state["jobs_of_client"], "driver/jobs_of_client")
            jobs = {c: fields.whole(n, fields.join("driver/jobs_of_client", c)) for c, n in counts.items()}
        except fields.StateError as err:
            raise SetupError(str(err.in_file(str(path)))) from None
        self.now, self.jobs_of_client = now, jobs


class RoundLoop:
    """Mixin for a Flower ``Strategy``: ``start`` handed to its round driver (``self.driver``), and the hooks
    a driver calls that a method may override."""

    #: The round driver; a strategy built with another (``EngineParts(driver=...)``) sets its own.
    driver: Any = SyncRounds()

    def check_setup(self, grid: Grid) -> None:
        """Hook: check what needs the connected nodes (e.g. a cluster layout); raise ``SetupError``.

        Called by the driver before the first round it runs (fresh or resumed).
        """

    def mid_round(self, server_round: int, grid: Grid, replies: list[Message], timeout: float) -> list[Message]:
        """Hook: further exchanges inside a training round; returns the replies to aggregate.

        With secure aggregation (``self.secagg``) the base runs its three exchanges here and keeps the round's
        sum for ``aggregate_train``: no reply is left to aggregate one by one."""
        secagg = getattr(self, "secagg", None)
        if secagg is not None:
            secagg.run(self, server_round, grid, replies, timeout)
            return []
        return replies

    def start(  # noqa: PLR0913 (Flower's signature)
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        *,
        checkpoint: RunCheckpoint | None = None,
    ) -> Result:
        """Run ``num_rounds`` rounds as Flower's ``Strategy.start`` does, through the strategy's driver.

        Parameters are Flower's, plus ``checkpoint``: where to write a checkpoint after every round
        and, when it was made with ``resume=True``, the checkpoint to continue from (default: the
        strategy's own, if it was built with one).
        """
        checkpoint = checkpoint if checkpoint is not None else getattr(self, "checkpoint", None)
        return self.driver.run(
            self,
            grid,
            initial_arrays,
            num_rounds,
            timeout,
            train_config,
            evaluate_config,
            evaluate_fn,
            checkpoint=checkpoint,
        )
