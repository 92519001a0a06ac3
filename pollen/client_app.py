"""pollen's ClientApp: local training on the node's own data and device.

Actions:

- ``train``: load the global model, run K local SGD steps or E epochs on this
  node's partition, reply with the trained model; ``compression_mod`` turns that
  into a compressed, error-fed update when the strategy asks for one.
- ``evaluate``: loss and accuracy of the global model on the held-out split.
- ``query.pollen_identify``: the node's stable client id (node-config ``client-id``,
  else ``partition-<id>``), so the server keys per-client state by something that
  survives a SuperNode reconnecting.

Node-config (SuperNode side) may set ``partition-id``, ``num-partitions``,
``data-dir``, ``device`` and ``client-id``; those win over the run-config.
"""

from __future__ import annotations

from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log

from pollen import protocol
from pollen.clientside import compression_mod
from pollen.config import AppConfig
from pollen.experiment import build_model, data_config

app = ClientApp()

_TRAIN_KEYS = ("local-lr", "local-epochs", "local-steps", "batch-size", "momentum", "weight-decay")


def node_setting(context: Context, key: str, default: Any) -> Any:
    value = context.node_config.get(key, default)
    return default if value in ("", None) else value


def client_id(context: Context) -> str:
    configured = node_setting(context, "client-id", "")
    return str(configured) if configured else f"partition-{int(node_setting(context, 'partition-id', 0))}"


class LocalTask:
    """This node's config, data loaders, model and device for one message."""

    def __init__(self, context: Context) -> None:
        from pollen.task.data import load_partition
        from pollen.task.device import resolve_device

        self.cfg = AppConfig.from_run_config(context.run_config)
        self.partition_id = int(node_setting(context, "partition-id", 0))
        num_partitions = int(node_setting(context, "num-partitions", 1))
        data_dir = str(node_setting(context, "data-dir", self.cfg["data-dir"]))
        self.device = resolve_device(str(node_setting(context, "device", self.cfg["device"])))
        self.data_cfg = data_config(self.cfg, num_partitions=num_partitions, data_dir=data_dir)
        self.batch_size = self.cfg["batch-size"]
        self.loaders = lambda batch_size: load_partition(self.data_cfg, self.partition_id, batch_size)
        self.model = build_model(self.cfg)

    def load_global(self, msg: Message) -> None:
        self.model.load_state_dict(msg.content.array_records[protocol.ARRAYS_RECORD].to_torch_state_dict())


def _setting(config: ConfigRecord, cfg: AppConfig, key: str) -> Any:
    return config[key] if key in config else cfg[key]


@app.train(mods=[compression_mod])
def train(msg: Message, context: Context) -> Message:
    """Train the global model locally and reply with the trained model."""
    from pollen.task.train import train as local_train

    task = LocalTask(context)
    task.load_global(msg)
    config = msg.content.config_records.get(protocol.CONFIG_RECORD, ConfigRecord())
    settings = {key: _setting(config, task.cfg, key) for key in _TRAIN_KEYS}
    trainloader, _ = task.loaders(int(settings["batch-size"]))
    server_round = int(config.get(protocol.CFG_SERVER_ROUND, 0))
    steps = int(settings["local-steps"])
    result = local_train(
        task.model,
        trainloader,
        lr=float(settings["local-lr"]),
        local_steps=steps if steps > 0 else None,
        local_epochs=None if steps > 0 else int(settings["local-epochs"]),
        momentum=float(settings["momentum"]),
        weight_decay=float(settings["weight-decay"]),
        device=task.device,
        seed=task.cfg["seed"] * 1_000_003 + server_round * 1_009 + task.partition_id,
    )
    log(INFO, "[pollen] %s trained %d steps on %s", client_id(context), result.num_steps, task.device)
    metrics = MetricRecord(
        {
            "train-loss": float(result.train_loss),
            "num-examples": int(result.num_examples),
            "num-steps": int(result.num_steps),
            "on-gpu": int(task.device.type == "cuda"),
        }
    )
    info = ConfigRecord({"device": str(task.device), protocol.IDENTITY_CLIENT_ID: client_id(context)})
    content = RecordDict(
        {
            protocol.ARRAYS_RECORD: ArrayRecord(task.model.state_dict()),
            protocol.METRICS_RECORD: metrics,
            protocol.CLIENT_INFO_RECORD: info,
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the global model on this node's held-out split."""
    from pollen.task.train import evaluate as local_evaluate

    task = LocalTask(context)
    task.load_global(msg)
    _, valloader = task.loaders(task.cfg["eval-batch-size"])
    loss, accuracy, count = local_evaluate(task.model, valloader, task.device)
    metrics = MetricRecord({"loss": float(loss), "accuracy": float(accuracy), "num-examples": int(count)})
    return Message(content=RecordDict({protocol.METRICS_RECORD: metrics}), reply_to=msg)


@app.query("pollen_identify")
def identify(msg: Message, context: Context) -> Message:
    """Tell the server this node's stable client id."""
    identity = ConfigRecord({protocol.IDENTITY_CLIENT_ID: client_id(context)})
    return Message(content=RecordDict({protocol.IDENTITY_RECORD: identity}), reply_to=msg)
