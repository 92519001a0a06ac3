"""What one message at model size costs in Flower's simulation: pollen's ClientApp against a bare Flower ClientApp.

Issue 41: where a client's local work is short (Fed-LAMB's 1-2 steps, a GPU), a round is its messages. This
times the round trip of one train message through ``flwr.simulation.run_simulation`` (one SuperNode, Ray, one
CPU): the ServerApp's ``grid.send_and_receive`` from push to reply, with **no local training**, so what is left
is the message: Flower's transport (the message and the node's ``Context`` pickled to the Ray actor and back),
the ClientApp's reading of the records into a torch model, and its reply.

- **pollen**: pollen's own ClientApp path (its mods, ``run_train``: the run-config, the client state, the
  model loaded from the message, the reply built as the strategy asked) with the local step replaced by one
  that trains nothing (``untrained_sgd``: plain SGD's outcome without the SGD; ``untrained_lamb`` reads the
  server's ``v_hat`` and keeps its momentum as the real step does). The messages are those pollen's strategies
  send: ``FedAMS`` (the model; a full-model reply, as FedAvg's), ``FedCAMS`` with scaled sign (the model; a
  1-bit reply with error feedback), ``FedLAMB`` (the model and ``v_hat``; the model and ``v`` back).
- **bare Flower**: a ClientApp as Flower's quickstart writes one, minus the training: it loads the message's
  ``arrays`` into the same torch model (``to_torch_state_dict``, ``load_state_dict``) and replies with
  records of the same sizes (the model; the sign reply's packed bits; the model and a moment vector). It
  receives exactly the messages pollen's run sent (kept from that run and sent again).
- **floor**: in one process, what Flower's simulation must do for those bytes however small the app: pickle
  and unpickle the push message with its node's context and the reply with it (Ray's transport), and the
  arrays into and out of a torch model.

Per message kind and model size it prints the median over messages 2.. (the first pays the actor's imports and
the model's construction): the round trip of each app, pollen / bare, the ClientApp's own seconds (timed by a
mod around each app), the bytes each way and the bytes of the node's ``context.state`` (which Flower ships
with every message in simulation).

Run: ``python benchmarks/bench_message.py [--messages 8] [--sizes cnn resnet18] [--kinds full sign lamb] [--json F]
[--state-files DIR]`` (``--state-files``: pollen's app once more with its client state in files under DIR).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
SIZES = {"cnn": {"model": "cnn", "dataset": "fashion-mnist"}, "resnet18": {"model": "resnet18", "dataset": "cifar10"}}
KINDS = ("full", "sign", "lamb")
CLOCK = "bench.clock"


def run_config(size: str) -> dict[str, Any]:
    """pollen's run-config for ``size`` (``run_simulation`` hands a ClientApp none; ``flwr run`` would)."""
    from pollen.app.config import defaults_from_pyproject

    return {**defaults_from_pyproject(str(PYPROJECT)), **SIZES[size], "local-steps": 1, "partitioner": "iid"}


def make_strategy(kind: str) -> Any:
    from pollen.strategies import FedAMS, FedCAMS, FedLAMB

    common = {"fraction_train": 1.0, "fraction_evaluate": 0.0, "min_train_nodes": 1, "min_available_nodes": 1}
    if kind == "full":
        return FedAMS(**common)
    if kind == "sign":
        return FedCAMS(compressor="sign", **common)
    return FedLAMB(variant="fed-lamb", **common)


def record_bytes(content: RecordDict) -> int:
    return int(sum(record.count_bytes() for record in content.values()))


# ------------------------------------------------------------------------------------------- the apps
def untrained_sgd(work: Any) -> Any:
    """Plain SGD's outcome with no SGD: the model goes back as the message brought it."""
    from pollen.clientside.steps import StepOutcome

    return StepOutcome({"train-loss": 0.0, "num-examples": 1, "num-steps": 0})


def untrained_lamb(work: Any) -> Any:
    """Fed-LAMB's step with no steps: reads the server's ``v_hat`` and the momentum from client state, keeps
    both and uploads ``v``, as :func:`pollen.clientside.steps.fedlamb.run` does around its training."""
    from pollen.clientside.steps import StepOutcome, model_arrays
    from pollen.clientside.steps import fedlamb as lamb
    from pollen.wire.protocol import CFG_STAT, CFG_SYNC

    layout = work.layout()
    lamb._round_v_hat(work, layout.dim)
    momentum = work.state.get(lamb.MOMENTUM, shape=(layout.dim,), dtype=np.float32)
    work.state.set(lamb.MOMENTUM, np.zeros(layout.dim, np.float32) if momentum is None else momentum)
    extras = {}
    if bool(work.config[CFG_SYNC]) and str(work.config[CFG_STAT]) == "v":
        # a d-vector >= 0 that grows each round, as trained clients' v does: the server's v_hat changes every
        # round, so every message carries it (a v_hat that stood still would be sent once)
        extras["v"] = np.square(layout.flatten(model_arrays(work.task.model))) + np.float32(work.server_round)
    return StepOutcome({"train-loss": 0.0, "num-examples": 1, "num-steps": 0, "grad-evals": 0}, extras=extras)


def clock_mod(config: dict[str, Any]) -> Any:
    """The outermost mod of both apps: hands the app pollen's run-config and times the app inside it."""

    def clock(msg: Message, context: Context, call_next: Any) -> Message:
        import torch

        torch.set_num_threads(1)
        given = Context(  # the same node and state; Flower refuses a change to the run's own run_config
            run_id=context.run_id,
            node_id=context.node_id,
            node_config=context.node_config,
            state=context.state,
            run_config=config,
        )
        started = time.perf_counter()
        reply = call_next(msg, given)
        seconds = time.perf_counter() - started
        state = sum(int(record.count_bytes()) for record in context.state.values())
        reply.content[CLOCK] = MetricRecord({"seconds": seconds, "state-bytes": state})
        return reply

    return clock


def pollen_app(config: dict[str, Any]) -> ClientApp:
    from pollen.client_app import TRAIN_MODS, identify, run_train
    from pollen.clientside.steps import LOCAL_STEPS
    from pollen.wire import protocol

    steps = {**LOCAL_STEPS, "sgd": untrained_sgd, protocol.ADAPTIVE_LOCAL_STEP: untrained_lamb}
    app = ClientApp()

    @app.train(mods=[clock_mod(config), *TRAIN_MODS])
    def train(msg: Message, context: Context) -> Message:
        return run_train(msg, context, steps)

    app.query("pollen_identify")(identify)  # the strategies ask each node who it is
    return app


_BARE_MODEL: dict[str, Any] = {}


def bare_app(config: dict[str, Any], keep_state: bool = False) -> ClientApp:
    """The quickstart's ClientApp minus training; ``keep_state``: it also keeps, in ``context.state``, the vectors
    the method needs across rounds (sign: an error-feedback residual; Fed-LAMB: its momentum, as ``v_hat`` comes
    with every message), a new array each message, as a Flower app that implements the method must."""
    app = ClientApp()

    @app.train(mods=[clock_mod(config)])
    def train(msg: Message, context: Context) -> Message:
        """A quickstart's ClientApp without the training: the model in, records of pollen's reply sizes out."""
        from pollen.wire import protocol

        key = f"{config['model']}/{config['dataset']}"
        if key not in _BARE_MODEL:
            from pollen.app.config import AppConfig
            from pollen.app.experiment import build_model

            _BARE_MODEL.clear()
            _BARE_MODEL[key] = build_model(AppConfig.from_run_config(config, check_strategy=False))
        model = _BARE_MODEL[key]
        model.load_state_dict(msg.content[protocol.ARRAYS_RECORD].to_torch_state_dict())
        content = RecordDict({"metrics": MetricRecord({"num-examples": 1})})
        kind = str(msg.content[protocol.CONFIG_RECORD].get("bench.kind", "full"))
        state = model.state_dict()
        if kind == "sign":  # the scaled sign's bits and scale, and the buffers
            dim = sum(p.numel() for p in model.parameters())
            content["update"] = ArrayRecord(
                {"bits": Array(np.zeros(-(-dim // 8), np.uint8)), "scale": Array(np.ones(1, np.float32))}
            )
            buffers = {k: v for k, v in state.items() if k not in dict(model.named_parameters())}
            content["buffers"] = ArrayRecord(buffers) if buffers else ArrayRecord()
        else:
            content["arrays"] = ArrayRecord(state)
        if kind == "lamb":  # the server's moment read as a user would, and a moment of the model's size back
            sent = msg.content.array_records.get(protocol.extra_record("v_hat"))
            dim = sum(p.numel() for p in model.parameters())
            moment = np.concatenate(sent.to_numpy_ndarrays()) if sent is not None else np.zeros(dim, np.float32)
            content["v"] = ArrayRecord({"v": Array(np.zeros_like(moment))})
        if keep_state and kind != "full":
            dim = sum(p.numel() for p in model.parameters())
            names = ("residual",) if kind == "sign" else ("m",)
            context.state["bench.state"] = ArrayRecord({name: Array(np.zeros(dim, np.float32)) for name in names})
        return Message(content=content, reply_to=msg)

    return app


# ------------------------------------------------------------------------------------------ the server
APPS = {"pollen": pollen_app, "bare": bare_app, "bare+state": lambda config: bare_app(config, keep_state=True)}


def timed_exchange(grid: Grid, messages: list[Message]) -> tuple[float, list[Message]]:
    started = time.perf_counter()
    replies = list(grid.send_and_receive(messages))
    return time.perf_counter() - started, replies


def server_app(app_name: str, size: str, kind: str, count: int, kept: dict, rows: list) -> ServerApp:
    """The ServerApp of one run (one SuperNode, one kind of message): pollen's strategy's messages, timed one at a
    time; the pollen run keeps them, and the bare apps' runs send them again."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        import torch

        from pollen.app.config import AppConfig
        from pollen.app.experiment import build_model

        torch.manual_seed(0)
        model = build_model(AppConfig.from_run_config(run_config(size), check_strategy=False))
        gaps = kept.setdefault((size, kind, "gaps"), [])
        if app_name == "pollen":
            strategy, record = make_strategy(kind), ArrayRecord(model.state_dict())
            received = time.perf_counter()
            for index in range(count):
                messages = list(strategy.configure_train(index + 1, record, ConfigRecord({"bench.kind": kind}), grid))
                kept.setdefault((size, kind), []).append(messages[0].content)
                gaps.append(time.perf_counter() - received)
                seconds, replies = timed_exchange(grid, messages)
                received = time.perf_counter()
                note(rows, app_name, size, kind, index, seconds, messages[0], replies[0])
                kept[(size, kind, "reply")] = replies[0].content
                new, _ = strategy.aggregate_train(index + 1, replies)
                record = new if new is not None else record
        else:
            node = next(iter(grid.get_node_ids()))
            for index, content in enumerate(kept[(size, kind)]):
                message = Message(content=content, dst_node_id=node, message_type="train")
                time.sleep(gaps[index])  # the pollen run's server work between a reply and the next message
                seconds, replies = timed_exchange(grid, [message])
                note(rows, app_name, size, kind, index, seconds, message, replies[0])

    return server


def note(
    rows: list, app_name: str, size: str, kind: str, index: int, seconds: float, sent: Message, got: Message
) -> None:
    if got.has_error():
        raise RuntimeError(f"{app_name} {size} {kind}: the ClientApp failed: {got.error.reason}")
    clock = got.content[CLOCK]
    rows.append(
        {
            "app": app_name,
            "size": size,
            "kind": kind,
            "index": index,
            "seconds": seconds,
            "client_seconds": float(clock["seconds"]),
            "state_bytes": int(clock["state-bytes"]),
            "push_bytes": record_bytes(sent.content),
            "reply_bytes": record_bytes(got.content),
        }
    )


def pickle_floor(push: RecordDict, reply: RecordDict) -> float:
    """Seconds to pickle and unpickle the push message with a node context and the reply with it (best of 3)."""
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    message = Message(content=push, dst_node_id=1, message_type="train")
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for item in ((message, context), (Message(content=reply, reply_to=message), context)):
            pickle.loads(pickle.dumps(item, protocol=5))
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    from flwr.simulation import run_simulation

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=8)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--json", help="also write every message's row here")
    parser.add_argument("--state-files", type=Path, help="also run pollen's app with its client state in files here")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        for kind in args.kinds:  # a run per app and kind: one node, whose client state is this method's alone
            kept: dict = {}
            apps = dict(APPS)
            if args.state_files:  # pollen's app again, its client state in a file only (node-config state-dir)
                files = {"state-dir": str(args.state_files), "client-state-in-memory": False}
                apps["pollen+files"] = lambda config, files=files: pollen_app({**config, **files})
            for app_name, make_app in apps.items():
                run_simulation(
                    server_app=server_app(app_name, size, kind, args.messages, kept, rows),
                    client_app=make_app(run_config(size)),
                    num_supernodes=1,
                    backend_config={"client_resources": {"num_cpus": 1}},
                )
            floor = pickle_floor(kept[(size, kind)][-1], kept[(size, kind, "reply")])
            rows.append({"app": "floor", "size": size, "kind": kind, "seconds": floor})
    report(rows, args.sizes, args.kinds)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def report(rows: list[dict[str, Any]], sizes: list[str], kinds: list[str]) -> None:
    """One line per model size and message: bytes, the round trip of each app (mean over messages 2..; Flower's
    simulation polls for new messages and for replies every 0.1 s, so a single round trip is coarse), pollen
    over the bare app that keeps the same state, the apps' own seconds and the pickle floor."""

    def mean(app: str, size: str, kind: str, key: str) -> float:
        values = [r[key] for r in rows if (r["app"], r["size"], r["kind"]) == (app, size, kind) and r.get("index")]
        return statistics.fmean(values)

    print(
        f"\n{'size':<9} {'message':<7} {'push':>6} {'reply':>6} {'state':>6} | round trip s: {'pollen':>6} {'bare':>6} "
        f"{'+state':>6} {'ratio':>6} | app s: {'pollen':>6} {'bare':>6} {'+state':>6} | {'floor s':>7}"
    )
    for size in sizes:
        for kind in kinds:
            floor = next(r["seconds"] for r in rows if (r["app"], r["size"], r["kind"]) == ("floor", size, kind))
            trip = {app: mean(app, size, kind, "seconds") for app in APPS}
            own = {app: mean(app, size, kind, "client_seconds") for app in APPS}
            megabytes = [mean("pollen", size, kind, key) / 1e6 for key in ("push_bytes", "reply_bytes", "state_bytes")]
            print(
                f"{size:<9} {kind:<7} {megabytes[0]:>5.1f}M {megabytes[1]:>5.1f}M {megabytes[2]:>5.1f}M | "
                f"{'':>13} {trip['pollen']:>6.3f} {trip['bare']:>6.3f} {trip['bare+state']:>6.3f} "
                f"{trip['pollen'] / trip['bare+state']:>6.2f} | {'':>6} {own['pollen']:>6.3f} {own['bare']:>6.3f} "
                f"{own['bare+state']:>6.3f} | {floor:>7.3f}"
            )
    for size in sizes:
        for kind in kinds:
            if any(r["app"] == "pollen+files" and (r["size"], r["kind"]) == (size, kind) for r in rows):
                trip, own = (mean("pollen+files", size, kind, key) for key in ("seconds", "client_seconds"))
                print(f"{size:<9} {kind:<7} pollen, client state in files: round trip {trip:.3f} s, app {own:.3f} s")
    print(
        "push / reply / state: MB of the message's records each way and of pollen's context.state (the bare app's "
        "'+state' keeps the same); ratio: pollen / bare+state; floor: pickling both messages with a context"
    )


if __name__ == "__main__":
    main()
