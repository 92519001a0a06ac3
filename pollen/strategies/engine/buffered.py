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
(client, round) pair names one job: a client is sent at most one job per step, and a client whose reply waits
in the buffer is not sent another before the step.

**The clock.** With ``clock="virtual"`` (simulation) each job gets a finish time from a seeded
:class:`~pollen.asynchrony.ClientSpeed` (a pure function of the client and its job number), and replies are
handled strictly in (virtual finish, job number) order: a reply that arrives early waits for the ones
before it, so a run ends bit-identical whatever the machine's timing and however many workers train. With
``clock="real"`` (deployment) replies are handled as they arrive. Either way a job without a reply after
``timeout`` seconds is dropped (counted); its node gets no new job until its late reply comes (refused).

Checkpoints are not written by this driver yet, and a resume is refused before round 1 with that reason.
"""

from __future__ import annotations

import heapq
import io
import time
from dataclasses import dataclass, field
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
from pollen.strategies.engine.jobs import StepJobs
from pollen.strategies.engine.resume import RunCheckpoint
from pollen.strategies.engine.rounds import EvaluateFn, RunInterrupted, SetupError, SyncRounds
from pollen.wire.records import arrays_to_record, record_to_arrays

REFILLS = ("reply", "flush")
CLOCKS = ("virtual", "real")
REFERENCES = ("dispatch", "current")
SUPERLINK_NODE_ID = 0


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


@dataclass
class Job:
    """One train message in flight: who, from which model version, and when it finishes."""

    seq: int
    node: int
    client: str
    version: int
    sent_round: int
    started: float
    finish: float
    sent_at: float
    group: str
    message_id: str = ""
    dropped: bool = False


@dataclass
class _Flight:
    """The run's moving parts: jobs in flight, replies waiting, the buffer, the model snapshots."""

    jobs: dict[str, Job] = field(default_factory=dict)  # message id -> job
    heap: list[tuple[float, int, str]] = field(default_factory=list)  # (finish, seq, message id)
    arrived: dict[str, Message] = field(default_factory=dict)
    buffer: list[tuple[Job, Message]] = field(default_factory=list)
    snapshots: dict[int, np.ndarray] = field(default_factory=dict)
    records: dict[int, ArrayRecord] = field(default_factory=dict)  # version -> the model as sent (for a resume)
    sent_in_step: dict[int, int] = field(default_factory=dict)  # node -> the step it was last sent a job in
    jobs_of_client: dict[str, int] = field(default_factory=dict)
    extra: list[tuple[Message, str]] = field(default_factory=list)  # replies that answer no job, and why
    sent_by_client: dict[str, int] = field(default_factory=dict)  # sent_in_step by client id, until a resume
    seq: int = 0
    clock: float = 0.0
    incompatible: int = 0

    def busy(self) -> set[int]:
        return {job.node for job in self.jobs.values()} | {job.node for job, _ in self.buffer}

    def in_flight(self) -> int:
        return sum(1 for job in self.jobs.values() if not job.dropped)


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
        result, arrays, step, flight = Result(), initial_arrays, 1, _Flight()
        saved = checkpoint.load(strategy) if checkpoint is not None and checkpoint.resume else None
        if saved is not None:
            step, arrays, result = saved.server_round + 1, saved.arrays, saved.result
            try:
                flight = self.restore(strategy, saved.driver_state, saved.server_round)
            except fields.StateError as err:
                raise SetupError(str(err.in_file(str(checkpoint.path)))) from None
            log(INFO, "Resuming after step %d of %d from %s", saved.server_round, num_rounds, checkpoint.path)
        elif evaluate_fn:
            res = evaluate_fn(0, initial_arrays)
            log(INFO, "Initial global evaluation results: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
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
            if flight.in_flight() == 0:  # whatever the refill rule: nothing in flight would stall the run
                self._fill(strategy, grid, flight, step, arrays, train_config)
            if flight.in_flight() == 0 and flight.buffer:  # no more replies can come: the step takes what it has
                log(
                    WARNING,
                    "async: step %d takes %d replies: no job in flight, no idle client",
                    step,
                    len(flight.buffer),
                )
            else:
                job, reply = self._next(grid, flight, timeout, real_start)
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
            if checkpoint is not None:
                checkpoint.save(step, arrays, strategy, result, self.state_dict(strategy, flight))
                if checkpoint.stop_after_round == step and step < num_rounds:
                    log(WARNING, "Stopping after step %d as asked (stop-after-round)", step)
                    raise RunInterrupted(step, result)
            step += 1
            if step <= num_rounds:
                self._fill(strategy, grid, flight, step, arrays, train_config)
        left = flight.in_flight()
        if left:
            log(INFO, "%d jobs still in flight at the end were not waited for", left)
        if num_rounds >= 1:
            self.evaluate_round(strategy, num_rounds, grid, arrays, evaluate_config, timeout, None, result)
        log(INFO, "")
        log(INFO, "Strategy execution finished in %.2fs", time.time() - started)
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        return result

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
    def _fill(
        self, strategy: Any, grid: Grid, flight: _Flight, step: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> None:
        """Send new jobs until ``concurrency`` are in flight, to clients sampled from the idle ones."""
        need = self.concurrency - flight.in_flight()
        if need <= 0:
            return
        busy = flight.busy()
        idle = [n for n in strategy.sampler.connected(grid) if n not in busy and flight.sent_in_step.get(n) != step]
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
                version=step - 1,
                sent_round=step,
                started=flight.clock,
                finish=flight.clock + self.speed.duration(client, number),
                sent_at=time.monotonic(),
                group=f"pollen/async/{flight.seq}",
            )
            jobs.append(job)
            flight.sent_in_step[node] = step
        messages = strategy.job_messages(step, [(job.node, job.group) for job in jobs], arrays, config)
        if step - 1 not in flight.snapshots:
            flight.snapshots[step - 1] = np.array(strategy.params, copy=True)
            flight.records[step - 1] = arrays
        ids = list(grid.push_messages(messages))
        for job, message, message_id in zip(jobs, messages, ids):
            job.message_id = str(message_id or message.metadata.message_id)
            flight.jobs[job.message_id] = job
            heapq.heappush(flight.heap, (job.finish, job.seq, job.message_id))
        log(INFO, "async: step %d: sent %d jobs (%d in flight)", step, len(jobs), flight.in_flight())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, strategy: Any, flight: _Flight) -> dict[str, Any]:
        """What a resume needs beyond the strategy, taken after a step (the buffer is then empty): the clock,
        the job counters, every job in flight (by client id) and the model each of them started from."""
        live = sorted((job for job in flight.jobs.values() if not job.dropped), key=lambda job: job.seq)
        versions = sorted({job.version for job in live})
        return {
            "clock": float(flight.clock),
            "seq": int(flight.seq),
            "jobs": [[job.client, job.version, job.started, job.finish, job.seq] for job in live],
            "models": [
                [str(v), [[name, np.array(a)] for name, a in record_to_arrays(flight.records[v]).items()]]
                for v in versions
            ],
            "jobs_of_client": dict(flight.jobs_of_client),
            "sent_in_step": {strategy.sampler.key(node): int(s) for node, s in flight.sent_in_step.items()},
        }

    def restore(self, strategy: Any, state: Any, last_step: int) -> _Flight:
        """The run's moving parts from :meth:`state_dict`'s form, every field checked (a
        :class:`~pollen.core.state_fields.StateError` names the one that does not fit); jobs are keyed by client
        until :meth:`_resend` finds their nodes."""
        where = "driver"
        fields.mapping(state, where, keys=("clock", "seq", "jobs", "models", "jobs_of_client", "sent_in_step"))
        flight = _Flight()
        flight.clock = fields.finite_number(state["clock"], fields.join(where, "clock"), low=0.0)
        flight.seq = fields.whole(state["seq"], fields.join(where, "seq"))
        layout = strategy.model.layout
        for i, item in enumerate(fields.sequence(state["models"], fields.join(where, "models"))):
            at = fields.join(fields.join(where, "models"), i)
            version_text, pairs = fields.sequence(item, at, length=2)
            version = fields.whole(
                int(version_text) if str(version_text).isdigit() else -1, fields.join(at, 0), high=last_step
            )
            named = dict(fields.pairs(pairs, fields.join(at, 1)))
            try:
                layout.check_arrays(named, layout.trainable + layout.buffers)
            except ValueError as err:
                raise fields.StateError(fields.join(at, 1), str(err)) from None
            flight.records[version] = arrays_to_record({name: named[name] for name in strategy.model.key_order})
            flight.snapshots[version] = layout.flatten(named)
        for i, item in enumerate(fields.sequence(state["jobs"], fields.join(where, "jobs"))):
            at = fields.join(fields.join(where, "jobs"), i)
            client, version, started, finish, seq = fields.sequence(item, at, length=5)
            client = fields.text(client, fields.join(at, 0), most=256)
            version = fields.whole(version, fields.join(at, 1), high=last_step)
            if version not in flight.records:
                raise fields.StateError(fields.join(at, 1), f"is version {version}, whose model is not saved")
            started = fields.finite_number(started, fields.join(at, 2), low=0.0, high=flight.clock)
            finish = fields.finite_number(finish, fields.join(at, 3), low=started)
            seq = fields.whole(seq, fields.join(at, 4), low=1, high=flight.seq)
            job = Job(seq, -1, client, version, version + 1, started, finish, 0.0, f"pollen/async/{seq}")
            flight.jobs[f"saved/{seq}"] = job
        counts = fields.mapping(state["jobs_of_client"], fields.join(where, "jobs_of_client"))
        flight.jobs_of_client = {c: fields.whole(n, fields.join(where, c)) for c, n in counts.items()}
        steps = fields.mapping(state["sent_in_step"], fields.join(where, "sent_in_step"))
        flight.sent_by_client = {
            c: fields.whole(s, fields.join(where, c), high=last_step + 1) for c, s in steps.items()
        }
        return flight

    def _resend(
        self, strategy: Any, grid: Grid, flight: _Flight, step: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> None:
        """Send the saved jobs again, each to the node its client is on now, with the model and round it had
        (a client that kept its state in a file starts the job again from its state of before it); a job whose
        client is not connected is dropped. Then the rest of the jobs, as after any step."""
        nodes_of = {strategy.sampler.key(node): node for node in strategy.sampler.connected(grid)}
        saved, flight.jobs = sorted(flight.jobs.values(), key=lambda job: job.seq), {}
        flight.sent_in_step = {nodes_of[c]: s for c, s in flight.sent_by_client.items() if c in nodes_of}
        for job in saved:
            if job.client not in nodes_of:
                log(WARNING, "async: %s is not connected; its job in flight at the checkpoint is dropped", job.client)
                continue
            job.node, job.sent_at = nodes_of[job.client], time.monotonic()
            (message,) = strategy.job_messages(
                job.sent_round, [(job.node, job.group)], flight.records[job.version], config, count_in=step
            )
            (message_id,) = list(grid.push_messages([message]))
            job.message_id = str(message_id or message.metadata.message_id)
            flight.jobs[job.message_id] = job
            heapq.heappush(flight.heap, (job.finish, job.seq, job.message_id))
        strategy._adopt_global_model(arrays)  # the model of now again: the step reads replies against it
        log(INFO, "async: resumed with %d of %d saved jobs sent again", len(flight.jobs), len(saved))
        self._release(flight)
        self._fill(strategy, grid, flight, step, arrays, config)

    # ------------------------------------------------------------------ receiving
    def _pull(self, grid: Grid, flight: _Flight) -> None:
        """Keep every reply that came for a job in flight (the first per job; another is a failure later)."""
        waiting = [mid for mid in flight.jobs if mid not in flight.arrived]
        if not waiting:
            return
        for reply in grid.pull_messages(waiting):
            mid, node = reply.metadata.reply_to_message_id, reply.metadata.src_node_id
            job = flight.jobs.get(mid)
            if job is None:
                flight.extra.append((reply, "reply to no job in flight (an earlier or unknown message)"))
            elif node != job.node and not (reply.has_error() and node == SUPERLINK_NODE_ID):
                flight.extra.append((reply, f"reply to node {job.node}'s job came from node {node}"))
            elif mid in flight.arrived:
                flight.extra.append((reply, "second reply to one job"))
            else:
                flight.arrived[mid] = reply

    def _next(
        self, grid: Grid, flight: _Flight, timeout: float, real_start: float
    ) -> tuple[Job | None, Message | None]:
        """The next job to handle and its reply (``None``: dropped after the timeout, or a dropped job's late reply
        came). ``RuntimeError`` when no job is in flight and no late reply comes within ``timeout``."""
        waiting_since = time.monotonic()
        while True:
            self._pull(grid, flight)
            late = [mid for mid, job in flight.jobs.items() if job.dropped and mid in flight.arrived]
            if late:
                job = flight.jobs.pop(late[0])
                flight.arrived.pop(late[0])
                return job, None
            if self.clock == "virtual":
                while flight.heap and flight.jobs.get(flight.heap[0][2]) is None:
                    heapq.heappop(flight.heap)
                if not flight.heap:
                    self._stalled(flight, waiting_since, timeout)
                    time.sleep(self.poll_interval)
                    continue
                finish, _, mid = flight.heap[0]
                job = flight.jobs[mid]
                if mid in flight.arrived:
                    heapq.heappop(flight.heap)
                    flight.clock = max(flight.clock, finish)
                    return self._take(flight, mid), flight.arrived.pop(mid)
                if time.monotonic() - job.sent_at > timeout:
                    heapq.heappop(flight.heap)
                    flight.clock = max(flight.clock, finish)
                    return self._drop(flight, job), None
            else:
                ready = sorted((flight.jobs[mid].seq, mid) for mid in flight.arrived if not flight.jobs[mid].dropped)
                if ready:
                    mid = ready[0][1]
                    flight.clock = time.monotonic() - real_start
                    return self._take(flight, mid), flight.arrived.pop(mid)
                now = time.monotonic()
                overdue = [job for job in flight.jobs.values() if not job.dropped and now - job.sent_at > timeout]
                if overdue:
                    flight.clock = time.monotonic() - real_start
                    return self._drop(flight, min(overdue, key=lambda job: job.seq)), None
                if flight.in_flight() == 0:
                    self._stalled(flight, waiting_since, timeout)
            time.sleep(self.poll_interval)

    @staticmethod
    def _stalled(flight: _Flight, since: float, timeout: float) -> None:
        """Nothing in flight: wait up to ``timeout`` for a dropped job's late reply, then stop the run."""
        if time.monotonic() - since > timeout:
            dropped = sorted(job.node for job in flight.jobs.values() if job.dropped)
            raise RuntimeError(
                f"the asynchronous run stalled: no job in flight, no idle client to send one to, and no late reply "
                f"within {timeout:g} s (nodes holding dropped jobs: {dropped})"
            )

    @staticmethod
    def _take(flight: _Flight, mid: str) -> Job:
        return flight.jobs.pop(mid)

    @staticmethod
    def _drop(flight: _Flight, job: Job) -> Job:
        """A job past the timeout: it stays in the book, dropped, until its late reply (if any) comes."""
        job.dropped = True
        return job

    def _receive(self, strategy: Any, flight: _Flight, step: int, job: Job, reply: Message | None) -> None:
        """Put ``job``'s reply in the buffer, or count why not (timeout, late, error, too stale)."""
        refuse = strategy.replies.reject
        if reply is None:
            if job.dropped and job.message_id not in flight.jobs:
                refuse(step, job.node, "late reply to a job dropped after the timeout")
            else:
                refuse(step, job.node, "no reply before the timeout (train)")
            self._release(flight)
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
            self._release(flight)
            return
        if node != job.node:
            refuse(step, job.node, f"reply to node {job.node}'s job came from node {node}")
            self._release(flight)
            return
        tau = (step - 1) - job.version
        if self.max_staleness is not None and tau > self.max_staleness:
            refuse(step, job.node, f"reply {tau} steps stale, more than max_staleness={self.max_staleness}")
            stats = strategy.accounting.round(step).method
            stats["async_too_stale"] = stats.get("async_too_stale", 0) + 1
            self._release(flight)
            return
        flight.incompatible = 0
        flight.buffer.append((job, reply))

    @staticmethod
    def _release(flight: _Flight) -> None:
        """Forget snapshots no job in flight or in the buffer still starts from."""
        used = {job.version for job in flight.jobs.values() if not job.dropped}
        used |= {job.version for job, _ in flight.buffer}
        for version in [v for v in flight.snapshots if v not in used]:
            del flight.snapshots[version]
            flight.records.pop(version, None)

    # ------------------------------------------------------------------ stepping
    def _step(  # noqa: PLR0913
        self, strategy: Any, flight: _Flight, step: int, arrays: ArrayRecord, result: Result, started: float
    ) -> ArrayRecord:
        """One server step from the buffer through the strategy's ``aggregate_train``; the new arrays (or the old)."""
        buffer, flight.buffer = flight.buffer, []
        taus = {job.node: (step - 1) - job.version for job, _ in buffer}
        weights = {node: self.rule.staleness(tau) for node, tau in taus.items()}
        tau_max = max(taus.values())
        lr = float(getattr(strategy.server_step.optimizer, "lr", 1.0) or 1.0)
        rule = self.rule
        scale = delay_adaptive_scale(tau_max, rule.tau_c, lr, rule.da_form) if rule.delay_adaptive else 1.0
        strategy.replies.ask_jobs(step, TRAIN_PHASE, {job.node: job.group for job, _ in buffer})
        strategy.jobs = StepJobs(
            bases={job.node: flight.snapshots[job.version] for job, _ in buffer},
            weights=weights if not self.rule.staleness.is_one else {},
            sent_rounds={job.client: job.sent_round for job, _ in buffer},
            reference=self.rule.reference,
        )
        strategy.server_step.lr_scale = scale
        stats = strategy.accounting.round(step)
        stats.method.update(
            async_virtual_time=float(flight.clock),
            async_wall_seconds=time.time() - started,
            async_staleness_mean=float(np.mean(list(taus.values()))),
            async_staleness_max=int(tau_max),
            async_lr_scale=float(scale),
        )
        try:
            new_arrays, metrics = strategy.aggregate_train(step, [reply for _, reply in buffer])
        finally:
            strategy.jobs = None
            strategy.server_step.lr_scale = 1.0
        self._release(flight)
        log(
            INFO,
            "async: step %d at virtual time %.3f: %d replies, staleness mean %.2f max %d",
            step,
            flight.clock,
            len(buffer),
            stats.method["async_staleness_mean"],
            tau_max,
        )
        if new_arrays is not None:
            result.arrays = arrays = new_arrays
        else:
            log(WARNING, "async: step %d applied nothing; the model is unchanged", step)
        if metrics is not None:
            result.train_metrics_clientapp[step] = metrics
        return arrays
