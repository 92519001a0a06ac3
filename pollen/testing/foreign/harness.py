"""Run a strategy on a foreign project in process, as ``flwr run`` runs it on a local simulation.

:func:`run_project` builds one persistent ``Context`` per node (``partition-id``, ``num-partitions``),
hands every message to the project's ``ClientApp`` through a :class:`~pollen.testing.fakes.FakeGrid`
(an exception in the ClientApp becomes an ``Error`` reply, as the SuperNode's runtime makes it), and
measures the server's test accuracy each round with a centralised ``evaluate_fn``. :data:`STRATEGIES`
are the strategies a user of such a project can drop in, each with its constructor defaults and the
project's own sampling, and the mod it needs in the ClientApp (if any).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict

from pollen.testing.fakes import FakeGrid
from pollen.testing.foreign.project import Project


@dataclass(frozen=True)
class DropIn:
    """A strategy as a user drops it in: ``make(fraction_train)`` with its defaults, and the mods it needs."""

    name: str
    make: Callable[[float], object]
    mods: tuple = ()


def drop_ins() -> list[DropIn]:
    """Flower's FedAvg and FedAdam (the bars) and every pollen strategy that works with a foreign ClientApp."""
    from flwr.serverapp.strategy import FedAdam, FedAvg

    from pollen.clientside import compression_mod
    from pollen.clientside.lazy_mod import lazy_mod
    from pollen.strategies import FedAdaVR, FedAMS, FedCAMS, FedLAMB, FedLazy, FedOpt, HAFed

    def sampling(fraction: float) -> dict:
        return {"fraction_train": fraction, "fraction_evaluate": 0.0}

    return [
        DropIn("FedAvg()", lambda f: FedAvg(**sampling(f))),
        DropIn("FedAdam()", lambda f: FedAdam(**sampling(f))),
        DropIn("FedAMS()", lambda f: FedAMS(**sampling(f))),
        DropIn("FedAMS(option=2)", lambda f: FedAMS(option=2, **sampling(f))),
        DropIn("FedCAMS() + compression_mod", lambda f: FedCAMS(**sampling(f)), (compression_mod,)),
        DropIn("FedOpt('adabelief')", lambda f: FedOpt(optimizer="adabelief", **sampling(f))),
        DropIn("FedAdaVR()", lambda f: FedAdaVR(**sampling(f))),
        DropIn("FedAdaVR('mifa')", lambda f: FedAdaVR(variant="mifa", **sampling(f))),
        DropIn("FedAdaVR('fedvarp')", lambda f: FedAdaVR(variant="fedvarp", **sampling(f))),
        DropIn("FedLAMB('fed-sgd')", lambda f: FedLAMB(variant="fed-sgd", **sampling(f))),
        DropIn("FedLAMB('adp-fed')", lambda f: FedLAMB(variant="adp-fed", **sampling(f))),
        DropIn("HAFed(identity)", lambda f: HAFed(topology="identity", clustered=False, **sampling(f))),
        DropIn("FedLazy() + lazy_mod", lambda f: FedLazy(**sampling(f)), (lazy_mod,)),
    ]


def run_project(
    project: Project,
    strategy: object,
    *,
    seed: int,
    num_rounds: int,
    mods: tuple = (),
    train_losses: dict[tuple[int, int], float] | None = None,
) -> list[float]:
    """Test accuracy after each round (index 0: the initial model); NaN where the loss is not finite.

    ``train_losses``, when given, receives each train reply's ``train_loss`` by ``(round, node)`` (what
    tells an honest client whose local training diverged from one whose update the server mistook).
    """
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    random.seed(seed)  # Flower's FedAvg samples nodes with Python's random
    client_app = project.make_app(list(mods))
    contexts = {
        node: Context(
            run_id=1,
            node_id=node,
            node_config={"partition-id": node - 1, "num-partitions": project.num_clients},
            state=RecordDict(),
            run_config={"seed": seed},
        )
        for node in range(1, project.num_clients + 1)
    }

    def client_fn(msg: Message) -> Message:
        try:
            reply = client_app(msg, contexts[msg.metadata.dst_node_id])
        except Exception as err:  # noqa: BLE001 - the runtime turns it into an error reply
            return Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=msg)
        metrics = reply.content.metric_records.get("metrics") if not reply.has_error() else None
        if train_losses is not None and metrics is not None and "train_loss" in metrics:
            server_round = int(msg.content.config_records["config"].get("server-round", 0))
            train_losses[(server_round, msg.metadata.dst_node_id)] = float(metrics["train_loss"])
        return reply

    test = project.test_set(seed)
    accuracy: dict[int, float] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = project.net()
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = project.evaluate(net, test)
        accuracy[server_round] = acc if math.isfinite(loss) else float("nan")
        return MetricRecord({"loss": loss, "accuracy": acc})

    net = project.net()
    strategy.start(
        grid=FakeGrid(list(contexts), client_fn, keep_history=False),
        initial_arrays=ArrayRecord(net.state_dict()),
        num_rounds=num_rounds,
        train_config=ConfigRecord(dict(project.train_config)),
        evaluate_fn=evaluate_fn,
    )
    return [accuracy.get(r, float("nan")) for r in range(num_rounds + 1)]
