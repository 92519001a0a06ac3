"""What the harness needs to know of a foreign project: its ClientApp, its model, its data, its config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.clientapp import ClientApp


@dataclass(frozen=True)
class Project:
    """One of Flower's examples, as the harness runs it.

    ``make_app(mods)`` builds the project's ``ClientApp`` with ``mods`` (pollen's compression or lazy
    mod for the strategies that need one; the project's functions unchanged). ``net()`` is a fresh
    model; ``test_set(seed)`` the server-side test data; ``evaluate(net, data)`` its ``(loss, accuracy)``.
    ``num_clients`` and ``fraction_train`` are the project's federation and sampling; ``train_config``
    what its server sends each round (the learning rate, the epochs).
    """

    name: str
    make_app: Callable[[list], ClientApp]
    net: Callable[[], torch.nn.Module]
    test_set: Callable[[int], Any]
    evaluate: Callable[[torch.nn.Module, Any], tuple[float, float]]
    num_clients: int
    fraction_train: float
    train_config: dict[str, Any] = field(default_factory=dict)


def example_client_app(
    mods: list,
    net: Callable[[], torch.nn.Module],
    load_data: Callable[[int, int, int], tuple[Any, Any]],
    train_fn: Callable[..., float],
    test_fn: Callable[[torch.nn.Module, Any], tuple[float, float]],
) -> ClientApp:
    """The ``ClientApp`` every one of Flower's PyTorch examples writes (``client_app.py``), around a project's task.

    ``@app.train()`` loads the received ``"arrays"`` into a fresh model, trains on the node's partition
    (``context.node_config["partition-id"]``) with the round's ``config`` and replies
    ``{"arrays", "metrics": {"train_loss", "num-examples"}}``; ``@app.evaluate()`` replies
    ``{"metrics": {"eval_loss", "eval_acc", "num-examples"}}`` on the partition's held-out part.
    """
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict

    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        trainset, _ = load_data(
            int(context.node_config["partition-id"]),
            int(context.node_config["num-partitions"]),
            int(context.run_config.get("seed", 1)),  # a project without the key: seed 1
        )
        train_loss = train_fn(model, trainset, dict(msg.content["config"]))
        metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(trainset[1])})
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        _, valset = load_data(
            int(context.node_config["partition-id"]),
            int(context.node_config["num-partitions"]),
            int(context.run_config.get("seed", 1)),  # a project without the key: seed 1
        )
        eval_loss, eval_acc = test_fn(model, valset)
        metrics = MetricRecord({"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(valset[1])})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def batches(n: int, batch_size: int, shuffle: bool) -> list[torch.Tensor]:
    """Index batches over ``n`` examples as a ``DataLoader(batch_size, shuffle)`` draws them (torch's global RNG)."""
    order = torch.randperm(n) if shuffle else torch.arange(n)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]
