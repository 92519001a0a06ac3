"""What a client step gets and returns: :class:`LocalWork`, :class:`StepOutcome`, and the helpers steps share.

A step is a plain function ``run(work: LocalWork) -> StepOutcome``. It trains ``work.task.model`` in
place (the ClientApp uploads it as the method asks: full model, or a compressed update with error
feedback), may keep vectors for later messages in ``work.state``
(:class:`~pollen.clientside.state.ClientState`) and may return named extras and flags for the reply.
The tables that name the steps are in :mod:`pollen.clientside.steps`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import ConfigRecord, Message

from pollen.clientside.state import ClientState
from pollen.core.layout import ModelLayout
from pollen.optim.schedule import schedule_factor
from pollen.wire import protocol


class Task(Protocol):
    """What a step uses of the node's task: pollen's ClientApp passes its ``LocalTask``; any object with these works."""

    model: Any  # a torch.nn.Module, trained in place
    device: Any  # the torch.device it trains on
    partition_id: int  # this node's data partition (HA-Fed seeds its batch stream with it)

    def loaders(self, batch_size: int) -> tuple[Any, Any]:
        """``(train, validation)`` data loaders of this node's partition."""
        ...


@dataclass
class LocalWork:
    """Everything a local step or phase handler gets for one message.

    ``settings`` is a plain mapping of the local-training settings the message may leave out
    (``local-lr``, ``local-steps``, ``local-epochs``, ``batch-size``, ``momentum``, ``weight-decay``), the
    run's ``seed`` (HA-Fed) and, optionally, the learning-rate schedule (``lr-schedule``,
    ``lr-decay-rounds``, ``lr-decay-factor``). pollen's ClientApp passes its validated run-config; a
    program without pollen's app passes its own dict.
    """

    task: Task
    msg: Message
    config: ConfigRecord
    state: ClientState
    server_round: int
    seed: int
    settings: Mapping[str, Any] = field(default_factory=dict)

    def setting(self, key: str) -> Any:
        """A local-training setting: the message's config wins over ``settings``.

        ``local-lr`` is the base rate; when ``settings`` has an ``lr-schedule`` it scales the rate for
        this round (:mod:`pollen.optim.schedule`); without one the rate is constant.
        """
        if key in self.config:
            value = self.config[key]
        elif key in self.settings:
            value = self.settings[key]
        else:
            raise KeyError(
                f"local setting {key!r} is neither in the message's config nor in the settings given to the step"
            )
        if key == "local-lr" and "lr-schedule" in self.settings:
            return float(value) * schedule_factor(self.settings, self.server_round)
        return value

    def layout(self) -> ModelLayout:
        """The model's layout (trainable tensors and buffers) as the server flattens it."""
        keys = self.config.get(protocol.CFG_BUFFER_KEYS)
        buffer_keys = protocol.split_keys(str(keys)) if keys is not None else None
        return ModelLayout.from_arrays(model_arrays(self.task.model), buffer_keys)


@dataclass
class StepOutcome:
    """What a step did and what its reply adds to the model upload.

    ``reference`` is the flat model the update is measured from, when the message carried no
    global model (a mid-round phase); ``upload_model=False`` sends no update at all (a lazy
    client that sends only a flag).
    """

    metrics: dict[str, int | float]
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    flags: dict[str, bool] = field(default_factory=dict)
    reference: np.ndarray | None = None
    upload_model: bool = True


Step = Callable[[LocalWork], StepOutcome]
"""A local step or a phase handler: ``run(work) -> StepOutcome``."""


def model_arrays(model: Any) -> dict[str, np.ndarray]:
    """The model's state dict as numpy arrays (CPU copies for a model on a GPU)."""
    return {name: tensor.detach().cpu().numpy() for name, tensor in model.state_dict().items()}


def load_flat(model: Any, layout: ModelLayout, vector: np.ndarray) -> None:
    """Load the trainable tensors of ``model`` from a flat vector (buffers are left as they are)."""
    import torch

    named = layout.unflatten(np.asarray(vector, dtype=np.float32))
    state = model.state_dict()
    with torch.no_grad():
        for name, value in named.items():
            state[name].copy_(torch.from_numpy(value))


def run_sgd(work: LocalWork, steps: int | None, *, seed: int | None = None, optimizer: Any = None) -> Any:
    """``pollen.task.train.train`` with the message's settings; ``steps`` overrides K/E when given.

    ``optimizer`` (built over the model's parameters) replaces plain SGD.
    """
    from pollen.task.train import train

    configured = int(work.setting("local-steps"))
    local_steps = steps if steps is not None else (configured if configured > 0 else None)
    trainloader, _ = work.task.loaders(int(work.setting("batch-size")))
    return train(
        work.task.model,
        trainloader,
        lr=float(work.setting("local-lr")),
        local_steps=local_steps,
        local_epochs=None if local_steps else int(work.setting("local-epochs")),
        momentum=float(work.setting("momentum")),
        weight_decay=float(work.setting("weight-decay")),
        device=work.task.device,
        seed=work.seed if seed is None else seed,
        optimizer=optimizer,
    )


def train_metrics(result: Any) -> dict[str, int | float]:
    return {
        "train-loss": float(result.train_loss),
        protocol.NUM_EXAMPLES: int(result.num_examples),
        "num-steps": int(result.num_steps),
    }
