"""The buffered asynchronous driver: ``concurrency`` jobs in flight, a server step every ``buffer-size`` replies.

:class:`BufferedAsync` takes :class:`~pollen.strategies.engine.rounds.SyncRounds`' place in a strategy's
parts (``EngineParts(driver=BufferedAsync(...))``, run-config ``driver=async``). It keeps ``concurrency``
clients training at once (Flower's ``Grid.push_messages`` / ``pull_messages``), puts each accepted reply in a
buffer, and when the buffer holds ``buffer_size`` replies hands them to the strategy's own ``aggregate_train``
as one step: the same collector, screen, transaction, ledger, optimiser, uplink and aggregator as a
synchronous round. A job carries the model version it started from; its staleness is the number of steps
taken since. The driver's :class:`AsyncRule` says how a buffer becomes a step (``async.md``):

- **FADAS**: the unweighted buffer mean into the strategy's optimiser (AMSGrad for FedAMS/FedCAMS), with the
  delay-adaptive learning rate (``eta / tau_max`` once the stalest reply is more than ``tau_c`` steps old);
- **FedBuff**: each update weighted ``1 / sqrt(1 + tau)``, the buffer's mean into the server optimiser;
- **FedAsync**: a buffer of one, the update taken against the *current* model and mixed in with weight
  ``alpha * s(tau)`` (with a server SGD step of learning rate 1: ``x <- (1 - a) x + a x_client``).

Steps are the engine's rounds: step ``s`` is round ``s`` to the strategy (its results row, its byte counts,
the ledger's round), and a job sent while step ``s`` fills names round ``s`` in its message, so every
(client, round) pair names one job: a client (by its stable id, whatever node it is on) is sent at most one
job per step, and a client whose reply waits in the buffer is not sent another before the step. Staleness
counts *model versions*: a step that applied nothing (too few replies, a rolled-back step) is not one. When no
job is in flight and no client may be sent one, the step takes the replies it has, none included.

**The clock.** With ``clock="virtual"`` (simulation) each job gets a finish time from a seeded
:class:`~pollen.asynchrony.ClientSpeed` (a pure function of the client and its job number), and replies are
handled strictly in (virtual finish, job number) order: a reply that arrives early waits for the ones
before it, so a run ends bit-identical whatever the machine's timing and however many workers train. With
``clock="real"`` (deployment) replies are handled as they arrive. Either way a job without a reply after
``timeout`` seconds is dropped (counted); its client gets no new job until its late reply comes (refused),
the one place where real time can matter in a virtual-clock run.

A checkpoint after every step holds the driver's book too (:class:`~pollen.strategies.engine.flight.Flight`);
a resume sends the jobs in flight again and ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from pollen.asynchrony import ClientSpeed, StalenessWeight, delay_adaptive_scale
from pollen.core import state_fields as fields
from pollen.strategies.engine.client_errors import ClientAppIncompatible, client_error_text, incompatibility
from pollen.strategies.engine.collector import TRAIN_PHASE
from pollen.strategies.engine.flight import SUPERLINK_NODE_ID, Flight, Job
from pollen.strategies.engine.jobs import StepJobs
from pollen.strategies.engine.resume import RunCheckpoint
from pollen.strategies.engine.rounds import EvaluateFn, SetupError, SyncRounds

REFILLS = ("reply", "flush")
CLOCKS = ("virtual", "real")
REFERENCES = ("dispatch", "current")


@dataclass(frozen=True)
class AsyncRule:
    """How a buffer of replies becomes a server step (module docstring; ``async.md`` §2-4).

    ``staleness`` weights each update by its staleness; ``reference`` is the model an update is taken
    against (``"dispatch"``: the one its job started from; ``"current"``: the model of now, FedAsync);
    ``delay_adaptive`` scales the step's learning rate by :func:`~pollen.asynchrony.delay_adaptive_scale`
    (``tau_c``, ``da_form``).
    """

    name: str = "fedbuff"
    staleness: StalenessWeight = StalenessWeight("constant")
    reference: str = "dispatch"
    delay_adaptive: bool = False
    tau_c: float = 1.0
    da_form: str = "code"

    def __post_init__(self) -> None:
        if self.reference not in REFERENCES:
            raise ValueError(f"async reference {self.reference!r} is unknown; allowed: {', '.join(REFERENCES)}")
        if not (isinstance(self.tau_c, (int, float)) and self.tau_c >= 0):
            raise ValueError(f"tau_c={self.tau_c!r} is invalid; allowed: a number >= 0")
        delay_adaptive_scale(0, self.tau_c, 1.0, self.da_form)  # checks the form

    @classmethod
    def fadas(cls, *, delay_adaptive: bool = True, tau_c: float = 1.0, da_form: str = "code") -> AsyncRule:
        """FADAS: the plain buffer mean, the delay-adaptive learning rate."""
        return cls("fadas", StalenessWeight("constant"), "dispatch", delay_adaptive, tau_c, da_form)

    @classmethod
    def fedbuff(cls, *, exponent: float = 0.5) -> AsyncRule:
        """FedBuff: updates weighted ``(1 + tau) ** -exponent`` (``1/sqrt(1+tau)``), the buffer's mean."""
        return cls("fedbuff", StalenessWeight("polynomial", a=exponent))

    @classmethod
    def fedasync(cls, *, alpha: float = 0.9, kind: str = "polynomial", a: float = 0.5, b: float = 4.0) -> AsyncRule:
        """FedAsync: each update against the current model, mixed in with ``alpha * s(tau)``."""
        return cls("fedasync", StalenessWeight(kind, a=a, b=b, scale=alpha), "current")

    def describe(self) -> dict[str, Any]:
        out = {"rule": self.name, "staleness": self.staleness.kind, "reference": self.reference}
        if self.staleness.kind != "constant":
            out.update(a=self.staleness.a, **({"b": self.staleness.b} if self.staleness.kind == "hinge" else {}))
        if self.staleness.scale != 1.0:
            out["alpha"] = self.staleness.scale
        if self.delay_adaptive:
            out.update(delay_adaptive=True, tau_c=self.tau_c, da_form=self.da_form)
        return out


class BufferedAsync(SyncRounds):
    """The buffered asynchronous round driver (module docstring).

    Parameters
    ----------
    concurrency : int | None
        Jobs kept in flight; ``None``: half the connected nodes (at least 1), settled when the run starts.
    buffer_size : int | None
        Accepted replies per server step (``<= concurrency``); ``None``: a fifth of ``concurrency`` (FADAS's
        ratio, at least 1), or 1 for FedAsync.
    rule : AsyncRule (default: FedBuff's)
        How a buffer becomes a step (:meth:`AsyncRule.fadas`, :meth:`AsyncRule.fedbuff`, :meth:`AsyncRule.fedasync`).
    max_staleness : int | None (default: None)
        Replies staler than this are refused (counted; an error-fed client then owes the whole upload).
    refill : str (default: "reply")
        ``"reply"``: a new job as soon as one ends; ``"flush"``: new jobs only at a step (FADAS's code).
    clock : str (default: "virtual")
        ``"virtual"``: replies in seeded virtual-finish order (simulation); ``"real"``: as they arrive.
    speed : ClientSpeed (default: every job 1.0)
        Job durations on the virtual clock; also the sync driver's, for comparisons.
    poll_interval : float (default: 0.02)
        Seconds between two pulls while waiting for a reply.
    """

    def __init__(  # noqa: PLR0913 - the driver's settings
        self,
        *,
        concurrency: int | None = None,
        buffer_size: int | None = None,
        rule: AsyncRule | None = None,
        max_staleness: int | None = None,
        refill: str = "reply",
        clock: str = "virtual",
        speed: ClientSpeed | None = None,
        poll_interval: float = 0.02,
    ) -> None:
        for name, value in (("concurrency", concurrency), ("buffer_size", buffer_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is invalid; allowed: None or an integer >= 1")
        if concurrency is not None and buffer_size is not None and buffer_size > concurrency:
            raise ValueError(
                f"buffer_size={buffer_size} > concurrency={concurrency}: a step could never fill; "
                "allowed: buffer_size <= concurrency"
            )
        if max_staleness is not None and (
            isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
        ):
            raise ValueError(f"max_staleness={max_staleness!r} is invalid; allowed: None or an integer >= 0")
        if refill not in REFILLS:
            raise ValueError(f"refill={refill!r} is unknown; allowed: {', '.join(REFILLS)}")
        if clock not in CLOCKS:
            raise ValueError(f"clock={clock!r} is unknown; allowed: {', '.join(CLOCKS)}")
        super().__init__(speed=speed)
        self.asked_sizes = (concurrency, buffer_size)
        self.concurrency, self.buffer_size = concurrency, buffer_size
        self.rule = rule if rule is not None else AsyncRule.fedbuff()
        self.max_staleness, self.refill, self.clock = max_staleness, refill, clock
        self.poll_interval = float(poll_interval)

    def describe(self) -> dict[str, Any]:
        """The driver's settings, for the strategy's summary and the results."""
        return {
            "driver": "async",
            "concurrency": self.concurrency,
            "buffer_size": self.buffer_size,
            **self.rule.describe(),
            "max_staleness": self.max_staleness,
            "refill": self.refill,
            "clock": self.clock,
            "speed": self.speed.describe(),
        }

    # ------------------------------------------------------------------ the run
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
        """``num_rounds`` server steps of ``strategy``, each from ``buffer_size`` replies (module docstring)."""
        self.check_fits(strategy)
        log(INFO, "Starting %s strategy (asynchronous driver):", type(strategy).__name__)
        strategy.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        started = time.time()
        step, arrays, result, saved = self.opening(
            strategy, initial_arrays, num_rounds, evaluate_fn, checkpoint, kind="async"
        )
        flight = Flight()
        if saved is not None:
            try:
                flight = Flight.from_state(saved.driver_state, strategy.model, saved.server_round)
            except fields.StateError as err:
                raise SetupError(str(err.in_file(str(checkpoint.path)))) from None
        if step <= num_rounds:
            strategy.check_setup(grid)
            nodes = strategy.sampler.connected(grid, strategy.min_train_nodes)
            self.settle_sizes(len(nodes))
            log(INFO, "Driver: %s", ", ".join(f"{k}={v}" for k, v in self.describe().items()))
        real_start = time.monotonic()
        if saved is not None and step <= num_rounds:
            self._resend(strategy, grid, flight, step, arrays, train_config)
        elif step <= num_rounds:
            self._fill(strategy, grid, flight, step, arrays, train_config)
        while step <= num_rounds:
            if not self.may_release(strategy, step):
                break
            if flight.in_flight() == 0:  # whatever the refill rule: nothing in flight would stall the run
                self._fill(strategy, grid, flight, step, arrays, train_config)
            if flight.in_flight() == 0 and (flight.buffer or self._spent(strategy, grid, flight, step)):
                # no more replies can come to this step: it takes what it has (none: the model stays as it is)
                log(
                    WARNING,
                    "async: step %d takes %d replies: nothing in flight, nobody to send to",
                    step,
                    len(flight.buffer),
                )
            else:
                job, reply = flight.next_event(
                    grid,
                    virtual=self.clock == "virtual",
                    timeout=timeout,
                    real_start=real_start,
                    poll_interval=self.poll_interval,
                )
                for extra, why in flight.extra:
                    strategy.replies.reject(step, extra.metadata.src_node_id, why)
                flight.extra.clear()
                if job is not None:
                    self._receive(strategy, flight, step, job, reply)
                if len(flight.buffer) < self.buffer_size:
                    if self.refill == "reply":
                        self._fill(strategy, grid, flight, step, arrays, train_config)
                    continue
            arrays = self._step(strategy, flight, step, arrays, result, started)
            if evaluate_fn:
                res = evaluate_fn(step, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[step] = res
            self.checkpointed(checkpoint, step, num_rounds, arrays, strategy, result, flight.state_dict())
            step += 1
            if step <= num_rounds:
                self._fill(strategy, grid, flight, step, arrays, train_config)
        left = flight.in_flight()
        if left:
            log(INFO, "%d jobs still in flight at the end were not waited for", left)
        if num_rounds >= 1:
            self.evaluate_round(strategy, num_rounds, grid, arrays, evaluate_config, timeout, None, result)
        return self.finished(result, started)

    def settle_sizes(self, nodes: int) -> tuple[int, int]:
        """The run's concurrency and buffer size for ``nodes`` connected nodes (module docstring's defaults);
        ``SetupError`` when there are fewer nodes than jobs to keep in flight."""
        asked_concurrency, asked_buffer = self.asked_sizes
        concurrency = asked_concurrency if asked_concurrency is not None else max(1, nodes // 2)
        if asked_buffer is not None:
            buffer_size = asked_buffer
        else:
            buffer_size = 1 if self.rule.name == "fedasync" else max(1, concurrency // 5)
        if nodes < concurrency:
            raise SetupError(
                f"concurrency={concurrency} jobs in flight need as many clients, but {nodes} nodes are "
                f"connected; allowed: concurrency <= {nodes}"
            )
        if buffer_size > concurrency:
            raise SetupError(f"buffer_size={buffer_size} > concurrency={concurrency}: a step could never fill")
        self.concurrency, self.buffer_size = concurrency, buffer_size
        return concurrency, buffer_size

    def check_fits(self, strategy: Any) -> None:
        """``SetupError`` before round 1 when the strategy or the run cannot go asynchronous, with the reason."""
        name = type(strategy).__name__
        if not hasattr(strategy, "job_messages"):
            raise SetupError(f"{name} does not run on pollen's engine, which the asynchronous driver needs")
        if (why := getattr(strategy, "async_refusal", None)) is not None:
            raise SetupError(f"{name} cannot run with the asynchronous driver: {why}")
        if strategy.sampler.population:
            raise SetupError(
                "the asynchronous driver keeps one job per node; population mode binds clients to nodes per round "
                "and is not supported with it (allowed: population=0)"
            )

    # ------------------------------------------------------------------ sending
    @staticmethod
    def _spent(strategy: Any, grid: Grid, flight: Flight, step: int) -> bool:
        """Whether some connected client is idle but was already sent a job in this step (a new step frees it)."""
        busy, key = flight.busy(), strategy.sampler.key
        return any(
            key(n) not in busy and flight.sent_in_step.get(key(n)) == step for n in strategy.sampler.connected(grid)
        )

    def _fill(
        self, strategy: Any, grid: Grid, flight: Flight, step: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> None:
        """Send new jobs until ``concurrency`` are in flight, to clients sampled from the idle ones."""
        need = self.concurrency - flight.in_flight()
        if need <= 0:
            return
        busy, key = flight.busy(), strategy.sampler.key
        idle = [
            n
            for n in strategy.sampler.connected(grid)
            if key(n) not in busy and flight.sent_in_step.get(key(n)) != step
        ]
        if not idle:
            return
        picks = strategy.sampler.rng.choice(len(idle), size=min(need, len(idle)), replace=False)
        nodes = [idle[i] for i in sorted(picks)]
        jobs = []
        for node in nodes:
            client = strategy.sampler.key(node)
            number = flight.jobs_of_client.get(client, 0)
            flight.jobs_of_client[client] = number + 1
            flight.seq += 1
            job = Job(
                seq=flight.seq,
                node=node,
                client=client,
                version=flight.version,
                sent_round=step,
                started=flight.clock,
                finish=flight.clock + self.speed.duration(client, number),
                sent_at=time.monotonic(),
                group=f"pollen/async/{flight.seq}",
            )
            jobs.append(job)
            flight.sent_in_step[client] = step
        messages = strategy.job_messages(step, [(job.node, job.group) for job in jobs], arrays, config)
        if flight.version not in flight.snapshots:
            flight.snapshots[flight.version] = np.array(strategy.params, copy=True)
            flight.records[flight.version] = arrays
        ids = list(grid.push_messages(messages))
        for job, message, message_id in zip(jobs, messages, ids):
            flight.add(job, str(message_id or message.metadata.message_id))
        log(INFO, "async: step %d: sent %d jobs (%d in flight)", step, len(jobs), flight.in_flight())

    # ------------------------------------------------------------------ checkpoints
    def _resend(
        self, strategy: Any, grid: Grid, flight: Flight, step: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> None:
        """Send the saved jobs again, each to the node its client is on now, with the model and round it had
        (a client that kept its state in a file starts the job again from its state of before it); a job whose
        client is not connected is dropped. Then the rest of the jobs, as after any step."""
        nodes_of = {strategy.sampler.key(node): node for node in strategy.sampler.connected(grid)}
        saved, flight.jobs = sorted(flight.jobs.values(), key=lambda job: job.seq), {}
        for job in saved:
            if job.client not in nodes_of:
                log(WARNING, "async: %s is not connected; its job in flight at the checkpoint is dropped", job.client)
                continue
            job.node, job.sent_at = nodes_of[job.client], time.monotonic()
            (message,) = strategy.job_messages(
                job.sent_round, [(job.node, job.group)], flight.records[job.version], config, count_in=step
            )
            (message_id,) = list(grid.push_messages([message]))
            flight.add(job, str(message_id or message.metadata.message_id))
        strategy._adopt_global_model(arrays)  # the model of now again: the step reads replies against it
        log(INFO, "async: resumed with %d of %d saved jobs sent again", len(flight.jobs), len(saved))
        flight.release()
        self._fill(strategy, grid, flight, step, arrays, config)

    # ------------------------------------------------------------------ receiving
    def _receive(self, strategy: Any, flight: Flight, step: int, job: Job, reply: Message | None) -> None:
        """Put ``job``'s reply in the buffer, or count why not (timeout, late, error, too stale)."""
        refuse = strategy.replies.reject
        if reply is None and job.refused:  # its two answers were refused and counted as they came
            flight.release()
            return
        if reply is None:
            if job.message_id not in flight.jobs:  # a dropped job's late reply
                refuse(step, job.node, "late reply to a job dropped after the timeout")
            else:
                refuse(step, job.node, "no reply before the timeout (train)")
            flight.release()
            return
        node = reply.metadata.src_node_id
        if reply.has_error():
            reason = reply.error.reason
            if node == SUPERLINK_NODE_ID:
                refuse(step, job.node, f"train message not delivered: {reason}")
            else:
                refuse(step, job.node, f"client error: {client_error_text(reason)}")
                if (why := incompatibility(reason)) is not None:
                    flight.incompatible += 1
                    if flight.incompatible >= max(len(strategy.sampler.node_keys), 1):
                        raise ClientAppIncompatible(f"stopped in step {step}: no ClientApp can answer: {why}")
            flight.release()
            return
        if node != job.node:
            refuse(step, job.node, f"reply to node {job.node}'s job came from node {node}")
            flight.release()
            return
        tau = flight.version - job.version
        if self.max_staleness is not None and tau > self.max_staleness:
            refuse(step, job.node, f"reply {tau} steps stale, more than max_staleness={self.max_staleness}")
            stats = strategy.accounting.round(step).method
            stats["async_too_stale"] = stats.get("async_too_stale", 0) + 1
            flight.release()
            return
        flight.incompatible = 0
        flight.buffer.append((job, reply))

    # ------------------------------------------------------------------ stepping
    def _step(  # noqa: PLR0913
        self, strategy: Any, flight: Flight, step: int, arrays: ArrayRecord, result: Result, started: float
    ) -> ArrayRecord:
        """One server step from the buffer through the strategy's ``aggregate_train``; the new arrays (or the old)."""
        buffer, flight.buffer = flight.buffer, []
        taus = {job.node: flight.version - job.version for job, _ in buffer}
        rule, eta = self.rule, server_lr(strategy)
        strategy.replies.ask_jobs(step, TRAIN_PHASE, {job.node: job.group for job, _ in buffer})
        jobs = strategy.jobs = StepJobs(
            bases={job.node: flight.snapshots[job.version] for job, _ in buffer},
            weights={} if rule.staleness.is_one else {node: rule.staleness(tau) for node, tau in taus.items()},
            sent_rounds={job.client: job.sent_round for job, _ in buffer},
            reference=rule.reference,
            taus=taus,
            lr_scale_of=(lambda tau: delay_adaptive_scale(tau, rule.tau_c, eta, rule.da_form))
            if rule.delay_adaptive
            else None,
        )
        try:
            new_arrays, metrics = strategy.aggregate_train(step, [reply for _, reply in buffer])
        finally:
            strategy.jobs = None
            strategy.server_step.lr_scale = 1.0
        applied = jobs.applied_taus if jobs.applied_taus is not None else list(taus.values())
        stats = strategy.accounting.round(step)
        stats.method.update(
            async_virtual_time=float(flight.clock),
            async_wall_seconds=time.time() - started,
            async_staleness_mean=float(np.mean(applied)) if applied else 0.0,
            async_staleness_max=int(max(applied, default=0)),
            async_lr_scale=float(jobs.lr_scale_used),
        )
        flight.release()
        log(
            INFO,
            "async: step %d at virtual time %.3f: %d replies, staleness mean %.2f max %d",
            step,
            flight.clock,
            len(buffer),
            stats.method["async_staleness_mean"],
            stats.method["async_staleness_max"],
        )
        if new_arrays is not None:
            flight.version += 1
            result.arrays = arrays = new_arrays
        else:
            log(WARNING, "async: step %d applied nothing; the model is unchanged", step)
        if metrics is not None:
            result.train_metrics_clientapp[step] = metrics
        return arrays


def server_lr(strategy: Any) -> float:
    """The strategy's server learning rate (its optimiser's ``eta``, else the strategy's), for FADAS's paper form."""
    optimizer = strategy.server_step.optimizer
    eta = optimizer.hyperparameters().get("eta") if optimizer is not None else None
    if eta is None:
        eta = getattr(strategy, "eta", None)
    return float(eta) if isinstance(eta, (int, float)) and eta > 0 else 1.0
