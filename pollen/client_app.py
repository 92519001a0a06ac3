"""pollen's ClientApp: local training on the node's own data and device.

Actions:

- ``train``: load the global model, run the local step the strategy names (``pollen.local-step``,
  default plain SGD for K steps or E epochs; see :mod:`pollen.clientside.steps`) on this node's
  partition, and reply with the trained model, or with a compressed, error-fed update straight
  from the flat update vector when the strategy asks for a codec;
- ``train.pollen_phase``: a mid-round message of a multi-phase round (``pollen.phase`` names the
  handler in the same table);
- ``evaluate``: loss and accuracy of the global model on the held-out split;
- ``query.pollen_identify``: the node's stable client id (node-config ``client-id``, else
  ``partition-<id>``) and cluster id (``cluster-id``, when set), so the server keys per-client
  state by something that survives a SuperNode reconnecting.

Node-config (SuperNode side) may set ``partition-id``, ``num-partitions``, ``data-dir``, ``device``,
``client-id``, ``cluster-id`` and ``state-dir`` (keep client state such as error-feedback residuals
in a file there, so a SuperNode restart or a resumed run loses nothing); those win over the
run-config.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log

from pollen.app.config import AppConfig, effective_run_config
from pollen.app.experiment import build_model, data_config
from pollen.clientside import compression_mod, secagg_mod
from pollen.clientside.compression_mod import client_state_for, compress_update, wants_compression
from pollen.clientside.identity import message_client_id, node_client_id, played_partition
from pollen.clientside.lazy_mod import lazy_mod
from pollen.clientside.steps import LOCAL_STEPS, PHASES, LocalWork, Step, StepOutcome, lookup, model_arrays
from pollen.core.layout import ModelLayout
from pollen.gossip import cluster_of
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record, record_to_arrays

app = ClientApp()


#: Seed offset of the i-th message of a round, so each phase draws its own batches.
_PHASE_SEED_STRIDE = 7_919


def node_setting(context: Context, key: str, default: Any) -> Any:
    value = context.node_config.get(key, default)
    return default if value in ("", None) else value


def client_id(context: Context) -> str:
    """The node's own client id (node-config ``client-id``, else ``partition-<partition-id>``)."""
    return node_client_id(context.node_config)


class LocalTask:
    """The config, data loaders, model and device of the client a message is for.

    That client is the node's own, or the partition the message names (population mode,
    :mod:`pollen.clientside.identity`): then its data is partition ``p`` of run-config ``population``.
    """

    def __init__(self, context: Context, config: ConfigRecord | None = None) -> None:
        from pollen.task.data import load_partition
        from pollen.task.device import resolve_device

        given = protocol.split_keys(str(config.get(protocol.CFG_GIVEN_KEYS, ""))) if config is not None else ()
        self.cfg = AppConfig.from_run_config(context.run_config, check_strategy=False, given=given)
        played = played_partition(config)
        if played is not None and not played < self.cfg["population"]:
            allowed = (
                f"a partition in 0..{self.cfg['population'] - 1}"
                if self.cfg["population"]
                else "none (population 0: each node is its own client)"
            )
            raise ValueError(
                f"message config '{protocol.CFG_PARTITION}' = {played} but run-config 'population' = "
                f"{self.cfg['population']}; allowed: {allowed}"
            )
        self.partition_id = int(node_setting(context, "partition-id", 0)) if played is None else played
        num_partitions = int(node_setting(context, "num-partitions", 1)) if played is None else self.cfg["population"]
        data_dir = str(node_setting(context, "data-dir", self.cfg["data-dir"]))
        self.device = resolve_device(str(node_setting(context, "device", self.cfg["device"])))
        self.data_cfg = data_config(self.cfg, num_partitions=num_partitions, data_dir=data_dir)
        self.batch_size = self.cfg["batch-size"]
        self.loaders = lambda batch_size: load_partition(self.data_cfg, self.partition_id, batch_size)
        self.model = _model_for(self.cfg)
        self.client_id = message_client_id(context.node_config, config)

    def load_global(self, msg: Message) -> None:
        self.model.load_state_dict(msg.content.array_records[protocol.ARRAYS_RECORD].to_torch_state_dict())

    def seed(self, server_round: int, phase_index: int = 0) -> int:
        return (
            self.cfg["seed"] * 1_000_003 + server_round * 1_009 + self.partition_id + phase_index * _PHASE_SEED_STRIDE
        )


_MODELS: dict[tuple, Any] = {}


def _model_for(cfg: AppConfig) -> Any:
    """This process's model for ``cfg``, built once and reused by later messages (simulation workers).

    Train and evaluate messages overwrite all of it with the global model; a message without one
    (a mid-round phase) starts from the initial values again (:func:`_reset_model`), as a freshly
    built model would.
    """
    key = (cfg["model"], cfg["dataset"], cfg["norm"], cfg["seed"])
    if key not in _MODELS:
        _MODELS.clear()  # one model per process: a new run's model replaces the old one
        model = build_model(cfg)
        _MODELS[key] = (model, {k: v.clone() for k, v in model.state_dict().items()})
    return _MODELS[key][0]


def _reset_model(cfg: AppConfig) -> None:
    """Put the cached model back to its initial values (a message that carries no global model)."""
    model, initial = _MODELS[(cfg["model"], cfg["dataset"], cfg["norm"], cfg["seed"])]
    model.load_state_dict(initial)


def _config(msg: Message) -> ConfigRecord:
    return msg.content.config_records.get(protocol.CONFIG_RECORD, ConfigRecord())


def _run(
    msg: Message, context: Context, handler_table: Mapping[str, Step], handler_name: str, what: str, phase_index: int
) -> Message:
    """Run one handler of the step table and build the reply the strategy asked for."""
    config = _config(msg)
    task = LocalTask(context, config)
    handler = lookup(handler_table, handler_name, what)
    server_round = int(config.get(protocol.CFG_SERVER_ROUND, 0))
    global_arrays = None
    if protocol.ARRAYS_RECORD in msg.content.array_records:
        task.load_global(msg)
    else:
        _reset_model(task.cfg)
    state = client_state_for(context, config, first_message=phase_index == 0)
    work = LocalWork(
        task=task,
        msg=msg,
        config=config,
        state=state,
        server_round=server_round,
        seed=task.seed(server_round, phase_index),
        settings=task.cfg.values,
    )
    layout = work.layout() if wants_compression(config) else None
    if layout is not None and protocol.ARRAYS_RECORD in msg.content.array_records:
        global_arrays = record_to_arrays(msg.content.array_records[protocol.ARRAYS_RECORD])  # views, no copy
    outcome = handler(work)
    content = _reply_records(work, outcome, layout, global_arrays)
    state.commit()
    log(
        INFO,
        "[pollen] %s trained %d steps on %s",
        task.client_id,
        int(outcome.metrics.get("num-steps", 0)),
        task.device,
    )
    return Message(content=content, reply_to=msg)


def _reply_records(
    work: LocalWork, outcome: StepOutcome, layout: ModelLayout | None, global_arrays: dict[str, np.ndarray] | None
) -> RecordDict:
    """The reply: the model (full or compressed from the flat update), extras, flags, metrics, client info."""
    content = RecordDict()
    if outcome.upload_model:
        if layout is None:
            content[protocol.ARRAYS_RECORD] = ArrayRecord(work.task.model.state_dict())
        else:
            local = model_arrays(work.task.model)
            if global_arrays is not None:  # x_local - x_global, tensor by tensor, one pass
                delta = layout.difference(local, global_arrays)
            elif outcome.reference is not None:
                delta = layout.flatten(local)
                delta -= outcome.reference
            else:
                raise ValueError("a compressed upload needs the global model or the step's reference vector")
            buffers = {key: local[key] for key in layout.buffer_keys}
            content.update(compress_update(delta, work.config, work.state, segments=layout.segments, buffers=buffers))
    if outcome.extras and work.config.get(protocol.CFG_DP_MODE) == "local":
        raise ValueError(
            f"{protocol.SETUP_ERROR_PREFIX}local DP privatises the model update only, but this method's local step "
            f"also uploads {sorted(outcome.extras)}, which would leave the node un-noised; allowed: local DP with "
            "a method whose client sends only its update, or central DP"
        )
    for name, vector in outcome.extras.items():
        content[protocol.extra_record(name)] = arrays_to_record(
            {protocol.EXTRA_ARRAY: np.asarray(vector, dtype=np.float32)}
        )
    if outcome.flags:
        content[protocol.FLAGS_RECORD] = ConfigRecord(dict(outcome.flags))
    metrics = dict(outcome.metrics)
    metrics["on-gpu"] = int(work.task.device.type == "cuda")
    content[protocol.METRICS_RECORD] = MetricRecord(metrics)
    content[protocol.CLIENT_INFO_RECORD] = ConfigRecord(
        {"device": str(work.task.device), protocol.IDENTITY_CLIENT_ID: work.task.client_id}
    )
    return content


#: The mods of a round's train message and of a mid-round phase message (another app reuses them).
TRAIN_MODS = (secagg_mod, lazy_mod, compression_mod)
PHASE_MODS = (secagg_mod, compression_mod)


def run_train(msg: Message, context: Context, steps: Mapping[str, Step] = LOCAL_STEPS) -> Message:
    """A round's train message: the local step the strategy names, from ``steps`` (default: pollen's)."""
    step = str(_config(msg).get(protocol.CFG_LOCAL_STEP, "sgd"))
    return _run(msg, context, steps, step, "local step", phase_index=0)


def run_phase(msg: Message, context: Context, phases: Mapping[str, Step] = PHASES) -> Message:
    """A later message of a multi-phase round: the handler ``pollen.phase`` names, from ``phases``."""
    config = _config(msg)
    name = str(config.get(protocol.CFG_PHASE, ""))
    return _run(msg, context, phases, name, "phase", phase_index=int(config.get(protocol.CFG_PHASE_INDEX, 1)))


@app.train(mods=list(TRAIN_MODS))
def train(msg: Message, context: Context) -> Message:
    """Train the global model locally with the strategy's local step and reply with the update."""
    return run_train(msg, context)


@app.train("pollen_phase", mods=list(PHASE_MODS))
def train_phase(msg: Message, context: Context) -> Message:
    """A later message of a multi-phase round: run the handler ``pollen.phase`` names."""
    return run_phase(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the global model on this node's held-out split."""
    from pollen.task.train import evaluate as local_evaluate

    task = LocalTask(context, _config(msg))
    task.load_global(msg)
    _, valloader = task.loaders(task.cfg["eval-batch-size"])
    loss, accuracy, count = local_evaluate(task.model, valloader, task.device)
    metrics = MetricRecord({"loss": float(loss), "accuracy": float(accuracy), "num-examples": int(count)})
    return Message(content=RecordDict({protocol.METRICS_RECORD: metrics}), reply_to=msg)


@app.query("pollen_identify")
def identify(msg: Message, context: Context) -> Message:
    """Tell the server this node's stable client id and cluster id.

    The cluster is node-config ``cluster-id`` when set (deployment), else ``partition-id // cluster-size``
    when run-config ``cluster-size`` > 0 (simulation, HA-Fed spec §9: client i in cluster i // n).
    """
    identity = ConfigRecord({protocol.IDENTITY_CLIENT_ID: client_id(context)})
    cluster = node_setting(context, "cluster-id", "")
    size = int(effective_run_config(context.run_config).get("cluster-size", 0) or 0)
    if cluster == "" and size > 0:  # simulation: client i is in cluster i // n
        cluster = cluster_of(int(node_setting(context, "partition-id", 0)), size)
    if cluster != "":
        identity[protocol.IDENTITY_CLUSTER_ID] = str(cluster)
    return Message(content=RecordDict({protocol.IDENTITY_RECORD: identity}), reply_to=msg)
