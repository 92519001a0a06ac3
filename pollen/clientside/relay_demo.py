"""Client side of :class:`pollen.strategies.RelayAverage` (the round-protocol example).

``relay-first-half`` (local step of the train message): K1 = K // 2 SGD steps from the global model
``x_t``; ``x_t`` and the result ``x_i`` (and the model's buffers) stay in client state for the
second message of the round. ``relay-mix`` (mid-round phase): mix ``x_i' = w x_i + (1 - w) r`` with
the relay ``r`` the server sent, run the other K - K1 steps from there and report the squared
norm of each tensor's move as the extra ``layer-sq-norms``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from pollen.wire import protocol
from pollen.clientside.steps import LocalWork, Step, StepOutcome, load_flat, model_arrays, run_sgd, train_metrics
from pollen.wire.records import record_to_arrays

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
    relay = record_to_arrays(work.msg.content.array_records[protocol.extra_record("relay")])[protocol.EXTRA_ARRAY]
    weight = float(work.config["pollen.relay-weight"])
    if relay.shape != x_first.shape or not 0.0 < weight <= 1.0:
        raise ValueError(f"relay of shape {relay.shape} / weight {weight} does not fit a model of {x_first.size} values")
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
    return StepOutcome(train_metrics(result), extras={"layer-sq-norms": norms}, reference=x_start)


#: Test/demo steps, not in pollen's production tables (:mod:`pollen.clientside.steps`): an app that runs
#: :class:`pollen.strategies.RelayAverage` adds them with ``with_steps(local_steps=RELAY_STEPS, phases=RELAY_PHASES)``.
RELAY_STEPS: Mapping[str, Step] = MappingProxyType({"relay-first-half": first_half})
RELAY_PHASES: Mapping[str, Step] = MappingProxyType({"relay-mix": relay_mix})
