"""The asynchronous driver's book of jobs in flight: what was sent, what came back, in which order to handle it.

:class:`Flight` holds one asynchronous run's moving parts (:mod:`~pollen.strategies.engine.buffered`): the
jobs in flight keyed by message id, the replies that arrived and wait their turn, the buffer of accepted
replies, the model each job started from, the clock and the job counters. It binds every reply pulled from
the grid to its job by message id *and* node (another node's reply and a reply to an unknown message are
set aside with their reason; two answers to one message are both refused: arrival order never decides), hands
the driver the next event in virtual-finish order (``clock="virtual"``) or in arrival order (``"real"``),
drops a job after its timeout, and writes and checks its state for a checkpoint.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from pollen.core import state_fields as fields
from pollen.wire.records import arrays_to_record, record_to_arrays

try:  # the node id the SuperLink signs its own error replies with (a message it could not deliver)
    from flwr.common.constant import SUPERLINK_NODE_ID
except ImportError:  # pragma: no cover - older Flower
    SUPERLINK_NODE_ID = 1


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
    #: Why the job ended without a reply to use (two answers to its message), once it has.
    refused: str = ""


@dataclass
class Flight:
    """The run's moving parts (module docstring)."""

    jobs: dict[str, Job] = field(default_factory=dict)  # message id -> job
    heap: list[tuple[float, int, str]] = field(default_factory=list)  # (finish, seq, message id)
    arrived: dict[str, Message] = field(default_factory=dict)
    buffer: list[tuple[Job, Message]] = field(default_factory=list)
    snapshots: dict[int, np.ndarray] = field(default_factory=dict)
    records: dict[int, ArrayRecord] = field(default_factory=dict)  # version -> the model as sent (for a resume)
    sent_in_step: dict[str, int] = field(default_factory=dict)  # client -> the step it was last sent a job in
    jobs_of_client: dict[str, int] = field(default_factory=dict)
    extra: list[tuple[Message, str]] = field(default_factory=list)  # replies that answer no job, and why
    seq: int = 0
    clock: float = 0.0
    #: Model versions: the steps that changed the model (a skipped step is not one; staleness counts these).
    version: int = 0
    incompatible: int = 0

    def busy(self) -> set[str]:
        """Clients that hold a job (dropped ones too, until their late reply) or a reply in the buffer, by client
        id: a client that came back under a new node id is still the same client."""
        return {job.client for job in self.jobs.values()} | {job.client for job, _ in self.buffer}

    def in_flight(self) -> int:
        """Jobs still expected to answer."""
        return sum(1 for job in self.jobs.values() if not job.dropped)

    def add(self, job: Job, message_id: str) -> None:
        """Book ``job``, sent as message ``message_id``."""
        job.message_id = message_id
        self.jobs[message_id] = job
        heapq.heappush(self.heap, (job.finish, job.seq, message_id))

    def release(self) -> None:
        """Forget the models no job in flight or in the buffer still starts from."""
        used = {job.version for job in self.jobs.values() if not job.dropped}
        used |= {job.version for job, _ in self.buffer}
        for version in [v for v in self.snapshots if v not in used]:
            del self.snapshots[version]
            self.records.pop(version, None)

    # ------------------------------------------------------------------ receiving
    def pull(self, grid: Grid) -> None:
        """Keep every reply that came for a job in flight; set the others aside with their reason."""
        waiting = [mid for mid in self.jobs if mid not in self.arrived]
        if not waiting:
            return
        for reply in grid.pull_messages(waiting):
            mid, node = reply.metadata.reply_to_message_id, reply.metadata.src_node_id
            job = self.jobs.get(mid)
            if job is None:
                self.extra.append((reply, "reply to no job in flight (an earlier or unknown message)"))
            elif node != job.node and not (reply.has_error() and node == SUPERLINK_NODE_ID):
                self.extra.append((reply, f"reply to node {job.node}'s job came from node {node}"))
            elif mid in self.arrived or job.refused:  # which answer is the node's own is not ours to guess
                job.refused = "two answers to one message: both refused"
                if mid in self.arrived:
                    self.extra.append((self.arrived.pop(mid), job.refused))
                self.extra.append((reply, job.refused))
            else:
                self.arrived[mid] = reply

    def next_event(  # noqa: PLR0913 - the driver's settings, passed through
        self, grid: Grid, *, virtual: bool, timeout: float, real_start: float, poll_interval: float
    ) -> tuple[Job | None, Message | None]:
        """The next job to handle and its reply (``None``: dropped after the timeout, or a dropped job's late
        reply came). ``RuntimeError`` when no job is in flight and no late reply comes within ``timeout``."""
        waiting_since = time.monotonic()
        while True:
            self.pull(grid)
            late = [mid for mid, job in self.jobs.items() if job.dropped and mid in self.arrived]
            if late:
                self.arrived.pop(late[0])
                return self.jobs.pop(late[0]), None
            refused = [mid for mid, job in self.jobs.items() if job.refused]
            if refused:  # its answers are counted already; the job ends now
                return self.jobs.pop(refused[0]), None
            event = self._virtual_event(timeout) if virtual else self._real_event(timeout, real_start)
            if event is not None:
                return event
            if self.in_flight() == 0:
                self._stalled(waiting_since, timeout)
            time.sleep(poll_interval)

    def _virtual_event(self, timeout: float) -> tuple[Job, Message | None] | None:
        """The job that finishes first on the virtual clock, once its reply is here (or its timeout passed)."""
        while self.heap and self.jobs.get(self.heap[0][2]) is None:
            heapq.heappop(self.heap)
        if not self.heap:
            return None
        finish, _, mid = self.heap[0]
        job = self.jobs[mid]
        if mid in self.arrived:
            heapq.heappop(self.heap)
            self.clock = max(self.clock, finish)
            return self.jobs.pop(mid), self.arrived.pop(mid)
        if time.monotonic() - job.sent_at > timeout:
            heapq.heappop(self.heap)
            self.clock = max(self.clock, finish)
            job.dropped = True  # stays in the book until its late reply (if any) comes
            return job, None
        return None

    def _real_event(self, timeout: float, real_start: float) -> tuple[Job, Message | None] | None:
        """The first reply that arrived (by job number within one pull), or the oldest job past its timeout."""
        ready = sorted((self.jobs[mid].seq, mid) for mid in self.arrived if not self.jobs[mid].dropped)
        if ready:
            mid = ready[0][1]
            self.clock = time.monotonic() - real_start
            return self.jobs.pop(mid), self.arrived.pop(mid)
        now = time.monotonic()
        overdue = [job for job in self.jobs.values() if not job.dropped and now - job.sent_at > timeout]
        if overdue:
            self.clock = now - real_start
            job = min(overdue, key=lambda job: job.seq)
            job.dropped = True
            return job, None
        return None

    def _stalled(self, since: float, timeout: float) -> None:
        """Nothing in flight: wait up to ``timeout`` for a dropped job's late reply, then stop the run."""
        if time.monotonic() - since > timeout:
            dropped = sorted(job.node for job in self.jobs.values() if job.dropped)
            raise RuntimeError(
                f"the asynchronous run stalled: no job in flight, no idle client to send one to, and no late reply "
                f"within {timeout:g} s (nodes holding dropped jobs: {dropped})"
            )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a resume needs beyond the strategy, taken after a step (the buffer is then empty): the clock,
        the job counters, every job in flight (by client id) and the model each of them started from."""
        live = sorted((job for job in self.jobs.values() if not job.dropped), key=lambda job: job.seq)
        versions = sorted({job.version for job in live})
        return {
            "kind": "async",
            "clock": float(self.clock),
            "seq": int(self.seq),
            "version": int(self.version),
            "jobs": [[job.client, job.version, job.started, job.finish, job.seq] for job in live],
            "models": [
                [str(v), [[name, np.array(a)] for name, a in record_to_arrays(self.records[v]).items()]]
                for v in versions
            ],
            "jobs_of_client": dict(self.jobs_of_client),
            "sent_in_step": {client: int(s) for client, s in self.sent_in_step.items()},
        }

    @classmethod
    def from_state(cls, state: Any, model: Any, last_step: int) -> Flight:
        """The book from :meth:`state_dict`'s form for ``model`` (the strategy's global model), every field
        checked (a :class:`~pollen.core.state_fields.StateError` names the one that does not fit); jobs are keyed
        by client until the driver finds their nodes."""
        where = "driver"
        keys = ("kind", "clock", "seq", "version", "jobs", "models", "jobs_of_client", "sent_in_step")
        fields.mapping(state, where, keys=keys)
        fields.text(state["kind"], fields.join(where, "kind"), allowed=("async",))
        flight = cls()
        flight.clock = fields.finite_number(state["clock"], fields.join(where, "clock"), low=0.0)
        flight.seq = fields.whole(state["seq"], fields.join(where, "seq"))
        flight.version = fields.whole(state["version"], fields.join(where, "version"), high=last_step)
        flight._load_models(state["models"], model, flight.version)
        counts = fields.mapping(state["jobs_of_client"], fields.join(where, "jobs_of_client"))
        flight.jobs_of_client = {
            c: fields.whole(n, fields.join(fields.join(where, "jobs_of_client"), c)) for c, n in counts.items()
        }
        for i, item in enumerate(fields.sequence(state["jobs"], fields.join(where, "jobs"))):
            at = fields.join(fields.join(where, "jobs"), i)
            client, version, started, finish, seq = fields.sequence(item, at, length=5)
            client = fields.text(client, fields.join(at, 0), most=256)
            if any(job.client == client for job in flight.jobs.values()):
                raise fields.StateError(fields.join(at, 0), f"is {client!r} again; a client holds one job at a time")
            if flight.jobs_of_client.get(client, 0) < 1:
                raise fields.StateError(fields.join(at, 0), f"is {client!r}, whom jobs_of_client counts no job")
            version = fields.whole(version, fields.join(at, 1), high=flight.version)
            if version not in flight.records:
                raise fields.StateError(fields.join(at, 1), f"is version {version}, whose model is not saved")
            started = fields.finite_number(started, fields.join(at, 2), low=0.0, high=flight.clock)
            finish = fields.finite_number(finish, fields.join(at, 3), low=started)
            seq = fields.whole(seq, fields.join(at, 4), low=1, high=flight.seq)
            if f"saved/{seq}" in flight.jobs:
                raise fields.StateError(fields.join(at, 4), f"is job number {seq} again; each job has its own")
            flight.jobs[f"saved/{seq}"] = Job(
                seq, -1, client, version, version + 1, started, finish, 0.0, f"pollen/async/{seq}"
            )
        steps = fields.mapping(state["sent_in_step"], fields.join(where, "sent_in_step"))
        flight.sent_in_step = {
            c: fields.whole(s, fields.join(fields.join(where, "sent_in_step"), c), high=last_step + 1)
            for c, s in steps.items()
        }
        return flight

    def _load_models(self, saved: Any, model: Any, last_version: int) -> None:
        where = fields.join("driver", "models")
        layout = model.layout
        for i, item in enumerate(fields.sequence(saved, where)):
            at = fields.join(where, i)
            version_text, pairs = fields.sequence(item, at, length=2)
            number = int(version_text) if str(version_text).isdigit() else -1
            version = fields.whole(number, fields.join(at, 0), high=last_version)
            named = dict(fields.pairs(pairs, fields.join(at, 1)))
            try:
                layout.check_arrays(named, layout.trainable + layout.buffers)
            except ValueError as err:
                raise fields.StateError(fields.join(at, 1), str(err)) from None
            self.records[version] = arrays_to_record({name: named[name] for name in model.key_order})
            self.snapshots[version] = layout.flatten(named)
