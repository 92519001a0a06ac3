"""RelayAverage: local SGD with one relayed averaging half-way through the round (server and client side).

The worked example of pollen's round protocol (``docs/concepts.md``, "A round"): it uses each
extension point once, on a method small enough to read in one sitting. It is a demo, not a method of
the product: the test harness's apps run it (:mod:`pollen.testing.apps`, strategy ``relay-demo``),
the product's method table does not list it. Round t:

1. **train** (local step ``relay-first-half``): every sampled client runs the first half of its
   ``local-steps`` from ``x_t`` and uploads its model ``x_i``;
2. **mid-round exchange** ``relay-mix`` (:meth:`mid_round` / :meth:`exchange`, a *per-client
   downlink*): the server sends client i the weighted mean of the *other* clients' models,
   ``r_i = (sum_j w_j x_j - w_i x_i) / (1 - w_i)``, and its weight ``w_i``; the client mixes
   ``x_i' = w_i x_i + (1 - w_i) r_i`` (the same weighted mean of all models for everyone), runs
   the second half of its steps from there and uploads its model with one **extra record**,
   ``layer-sq-norms`` (``||x_i'' - x_i'||^2`` per trainable tensor);
3. **aggregate**: the mean of the updates, ``x_{t+1} = x_t + eta * mean_i (x_i'' - x_t)``.

With ``eta = 1`` and one client it is FedAvg; with several it is local SGD with one intermediate
synchronisation, the simplest member of HA-Fed's family (one cluster, fully connected, one gossip).

Client side: ``relay-first-half`` (local step of the train message): K1 = K // 2 SGD steps from the
global model ``x_t``; ``x_t`` and the result ``x_i`` (and the model's buffers) stay in client state for
the second message of the round. ``relay-mix`` (mid-round phase): mix ``x_i' = w x_i + (1 - w) r`` with
the relay ``r`` the server sent, run the other K - K1 steps from there and report the squared norm of
each tensor's move as the extra ``layer-sq-norms``. A ClientApp runs them from its step tables:
:data:`CLIENT_STEPS` and :data:`CLIENT_PHASES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from pollen.app.methods.common import adaptive_kwargs
from pollen.app.registry import Method
from pollen.clientside.steps import LocalWork, StepOutcome, load_flat, model_arrays, run_sgd, train_metrics
from pollen.optim import sgd
from pollen.strategies.engine.replies import ClientUpdate, Extra, ReplySpec
from pollen.strategies.engine.sinks import weights_of
from pollen.strategies.engine.strategy import AdaptiveStrategy
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record, record_to_arrays

RELAY_PHASE = "relay-mix"
FIRST_HALF_STEP = "relay-first-half"
RELAY_EXTRA = "relay"
NORMS_EXTRA = "layer-sq-norms"
CFG_WEIGHT = "pollen.relay-weight"


class RelayAverage(AdaptiveStrategy):
    """Local SGD with one relayed averaging in the middle of every round.

    Parameters
    ----------
    eta : float (default: 1.0)
        Server learning rate of the final step (1.0: plain averaging).
    **kwargs
        Sampling and aggregation options of :class:`AdaptiveStrategy`; ``aggregation="weighted"``
        also weights the mid-round mix by ``num-examples``.
    """

    #: The final replies carry one extra vector: the squared norm of each tensor's second-half move.
    reply_spec = ReplySpec(extras=(Extra(NORMS_EXTRA, size="tensors", nonnegative=True),))
    secagg_refusal = "its mid-round relay sends each client the others' models"
    #: The first-half replies carry only the model.
    first_half_spec = ReplySpec()

    def __init__(self, *, eta: float = 1.0, **kwargs: Any) -> None:
        super().__init__(optimizer=sgd(eta=eta), **kwargs)
        self.last_layer_sq_norms: np.ndarray | None = None

    def train_config(self, server_round: int) -> dict[str, Any]:
        return {protocol.CFG_LOCAL_STEP: FIRST_HALF_STEP}

    def mid_round(self, server_round: int, grid: Grid, replies: list[Message], timeout: float) -> list[Message]:
        """Read the first-half models, send each client its relay, return the second-half replies."""
        firsts = self.collect(server_round, replies, spec=self.first_half_spec)
        if not firsts:
            return []
        relays = self.relays(firsts)
        buffer_keys = protocol.join_keys(self.layout.buffer_keys) if self.layout.buffer_keys else None
        contents = {}
        for update in firsts:
            relay, weight = relays[update.node_id]
            config = ConfigRecord({CFG_WEIGHT: weight})
            if buffer_keys:
                config[protocol.CFG_BUFFER_KEYS] = buffer_keys
            contents[update.node_id] = RecordDict(
                {
                    protocol.extra_record(RELAY_EXTRA): arrays_to_record({protocol.EXTRA_ARRAY: relay}),
                    protocol.CONFIG_RECORD: config,
                }
            )
        return self.exchange(server_round, grid, contents, phase=RELAY_PHASE, timeout=timeout)

    def relays(self, firsts: list[ClientUpdate]) -> dict[int, tuple[np.ndarray, float]]:
        """Node -> (the weighted mean of the other clients' models, this client's weight)."""
        weights = weights_of(firsts, weighted=self.aggregation == "weighted")
        mean_delta = np.zeros(self.layout.dim, dtype=np.float64)
        for weight, update in zip(weights, firsts):
            mean_delta += weight * update.delta
        out = {}
        for weight, update in zip(weights, firsts):
            if weight >= 1.0:  # alone: nothing to mix with
                others = update.delta.astype(np.float64)
            else:
                others = (mean_delta - weight * update.delta) / (1.0 - weight)
            out[update.node_id] = ((self.params + others).astype(np.float32), float(weight))
        return out

    def after_round(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """Keep the round's mean per-tensor squared norms (also in the round's train metrics)."""
        norms = [u.extras[NORMS_EXTRA] for u in updates if NORMS_EXTRA in u.extras]
        if norms:
            self.last_layer_sq_norms = np.mean(norms, axis=0)
            self.accounting.round(server_round).train_metrics["layer-sq-norm-max"] = float(
                self.last_layer_sq_norms.max()
            )

    def extra_summary(self) -> dict[str, Any]:
        return {"relay": f"one mid-round exchange '{RELAY_PHASE}' after half of the local steps"}


# ----------------------------------------------------------------------------------------- client side
X_START = "relay.x_t"
X_FIRST = "relay.x_i"
BUFFER_PREFIX = "relay.buffer:"


def _halves(work: LocalWork) -> tuple[int, int]:
    total = int(work.setting("local-steps"))
    if total < 2:
        raise ValueError(f"relay-demo needs local-steps >= 2 (one half before the relay, one after); got {total}")
    return total // 2, total - total // 2


def first_half(work: LocalWork) -> StepOutcome:
    """The first K // 2 steps; keep x_t, x_i and the buffers for the relay phase."""
    first, _ = _halves(work)
    layout = work.layout()
    work.state.set(X_START, layout.flatten(model_arrays(work.task.model)))
    result = run_sgd(work, first)
    arrays = model_arrays(work.task.model)
    work.state.set(X_FIRST, layout.flatten(arrays))
    for name in layout.buffer_keys:
        work.state.set(BUFFER_PREFIX + name, arrays[name])
    return StepOutcome(train_metrics(result))


def relay_mix(work: LocalWork) -> StepOutcome:
    """Mix with the relay, run the second half, report per-tensor squared norms of the move."""
    import torch

    _, second = _halves(work)
    x_start, x_first = work.state.get(X_START), work.state.get(X_FIRST)
    if x_start is None or x_first is None:
        raise ValueError("relay-mix without the first half of this round in client state")
    relay = record_to_arrays(work.msg.content.array_records[protocol.extra_record(RELAY_EXTRA)])[protocol.EXTRA_ARRAY]
    weight = float(work.config[CFG_WEIGHT])
    if relay.shape != x_first.shape or not 0.0 < weight <= 1.0:
        raise ValueError(
            f"relay of shape {relay.shape} / weight {weight} does not fit a model of {x_first.size} values"
        )
    mixed = (weight * x_first + (1.0 - weight) * relay).astype(np.float32)
    layout = work.layout()
    state = work.task.model.state_dict()
    with torch.no_grad():
        for name in layout.buffer_keys:
            state[name].copy_(torch.from_numpy(np.array(work.state.get(BUFFER_PREFIX + name))))
    load_flat(work.task.model, layout, mixed)
    result = run_sgd(work, second)
    moved = layout.flatten(model_arrays(work.task.model)) - mixed
    norms = np.array([np.sum(np.square(moved[a:b], dtype=np.float64)) for a, b in layout.segments], dtype=np.float32)
    for name in [X_START, X_FIRST, *(BUFFER_PREFIX + n for n in layout.buffer_keys)]:
        work.state.pop(name)
    return StepOutcome(train_metrics(result), extras={NORMS_EXTRA: norms}, reference=x_start)


#: The client side, for a ClientApp's step tables (the testing ClientApp adds them to pollen's).
CLIENT_STEPS = {FIRST_HALF_STEP: first_half}
CLIENT_PHASES = {RELAY_PHASE: relay_mix}


# ----------------------------------------------------------------------------------------- app
def build_relay_demo(cfg: Mapping[str, Any]) -> RelayAverage:
    """``strategy=relay-demo`` from the run-config (the test harness's method table)."""
    return RelayAverage(**adaptive_kwargs(cfg), eta=cfg["server-lr"])


#: The harness's methods beyond the product's.
METHODS = {
    "relay-demo": Method(
        build_relay_demo,
        "pollen.testing.relay_demo.RelayAverage (the round-protocol example: one relayed mix per round)",
        "relay_demo",
    ),
}
