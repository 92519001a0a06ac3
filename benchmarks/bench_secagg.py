"""Secure aggregation's cost and quality: pollen's SecAgg+ against plain uploads and Flower's SecAgg+ masking.

``--part protocol``: one round of the protocol (``pollen.secagg``) among ``--clients`` clients at the CNN's size
(29,034 trainable values) and ResNet-18's (11,173,962), for the codec at 8 and 16 bits: seconds per client and
for the server at each stage, and bytes per client up (keys, sealed shares, masked integers, unmask shares, each
counted as Flower counts the record that carries it), beside a plain float32 upload and Flower 1.39's SecAgg+
client masking of the same vector (``quantize`` to 2**22 levels, one ``pseudo_rand_gen`` per neighbour and for
the self mask, modulo 2**32: its int64 vector is what ``secaggplus_mod`` sends), in the same run.

``--part rounds``: whole rounds, in one process, of the same eight clients (each adds a fixed update to the model
it gets: no training, so the round is the protocol and its messages) under Flower 1.39's own SecAgg+ with legacy
FedAvg (``SecAggPlusWorkflow`` in a ``DefaultWorkflow``, ``LegacyContext``, a ``NumPyClient`` behind
``secaggplus_mod``: Flower's secure-aggregation example, without its training), pollen's FedAvg-equivalent
(``FedOpt(optimizer="sgd", eta=1)``) under secure aggregation at 8 and 16 bits, and the same pollen strategy
without it: seconds per round (the clients' part and the server's) and bytes per client per round both ways
(each message's content as Flower serialises it), at the CNN's size and ResNet-18's.

``--part quality``: pollen's app in process on Fashion-MNIST (the CNN with GroupNorm: BatchNorm's statistics
would leave the sum), FedAMS and FedCAMS, plain and under ``secagg`` at 8 and 16 bits, seeds 1-3: the final
test accuracy, mean and range.

Run: ``python benchmarks/bench_secagg.py --part protocol`` (about 20 seconds), ``--part rounds`` (about three
minutes) and ``python benchmarks/bench_secagg.py --part quality --rounds 10`` (about 30 minutes on two cores).
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np

CNN_DIM = 29_034
RESNET18_DIM = 11_173_962


def _bytes(record: object) -> int:
    return int(record.count_bytes())  # type: ignore[attr-defined]


def protocol_round(dim: int, clients: int, bits: int) -> dict[str, float]:
    """One SecAgg+ round of ``clients`` at ``dim``: seconds per stage (client mean, server) and bytes up a client."""
    from flwr.app import ConfigRecord

    from pollen.secagg.codec import SummableCodec
    from pollen.secagg.protocol import SecAggClient, SecAggServer
    from pollen.wire.records import arrays_to_record

    ids = [(1 << 63) + 7919 * i for i in range(clients)]  # Flower-sized node ids
    server = SecAggServer(ids, SummableCodec(clip=0.05, bits=bits, max_clients=clients), dim, seed=1)
    rng = np.random.default_rng(0)
    updates = {u: rng.normal(0, 0.01, dim).astype(np.float32) for u in ids}
    timing: dict[str, list[float]] = {}
    up: dict[str, int] = {}

    def timed(stage: str, fn, *args):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        out = fn(*args)
        timing.setdefault(stage, []).append(time.perf_counter() - start)
        return out

    setup = server.setup_messages()
    clients_of = {u: SecAggClient(u) for u in ids}
    wires = {}
    keys = {}
    for u in ids:
        keys[u] = timed("client advertise", clients_of[u].advertise, setup[u])
        codec = clients_of[u].codec
        wires[u], _ = timed("client encode", codec.encode, updates[u], None, np.random.default_rng(u & 0xFFFF))
    up["keys"] = _bytes(ConfigRecord(keys[ids[0]]))
    forwarded = timed("server keys", server.receive_keys, keys)
    shares = {u: timed("client share keys", clients_of[u].share_keys, forwarded[u]) for u in ids}
    first = shares[ids[0]]
    up["shares"] = _bytes(ConfigRecord({"to": sorted(first), "sealed": [first[v] for v in sorted(first)]}))
    sealed = timed("server shares", server.receive_shares, shares)
    masked = {u: timed("client mask", clients_of[u].masked_input, sealed[u], wires[u]) for u in ids}
    up["masked"] = _bytes(arrays_to_record({"masked": masked[ids[0]]}))
    requests = timed("server masked", server.receive_masked, masked)
    answers = {
        u: timed("client unmask", clients_of[u].unmask, r["alive"], r["dropped"], r["survivors"])
        for u, r in requests.items()
    }
    b = answers[ids[0]]["b"]
    up["unmask"] = _bytes(ConfigRecord({"b_ids": sorted(b), "b": [b[v] for v in sorted(b)]}))
    total, count = timed("server unmask", server.receive_unmask, answers)
    exact = sum(SummableCodec(0.05, bits, clients).signed_sum(w, 1) for w in wires.values())
    assert np.array_equal(server.codec.signed_sum(total, count), exact), "the unmasked sum is not the exact sum"
    out = {stage: statistics.mean(seconds) for stage, seconds in timing.items() if stage.startswith("client")}
    out |= {stage: sum(seconds) for stage, seconds in timing.items() if stage.startswith("server")}
    out["client total"] = sum(v for k, v in out.items() if k.startswith("client"))
    out["server total"] = sum(v for k, v in out.items() if k.startswith("server") and k != "server total")
    out["bytes up"] = float(sum(up.values()))
    out["masked bytes"] = float(up["masked"])
    out["lane bits"] = float(server.codec.wire_bits)
    return out


def flower_client_masking(dim: int, clients: int) -> dict[str, float]:
    """Flower 1.39's SecAgg+ client masking of one update at ``dim`` (its defaults) and the bytes it sends."""
    from flwr.app import ArrayRecord
    from flwr.common.secure_aggregation.ndarrays_arithmetic import parameters_addition, parameters_mod
    from flwr.common.secure_aggregation.quantization import quantize
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    from pollen.secagg.graph import default_degree

    neighbours = min(default_degree(clients), clients - 1)
    update = [np.random.default_rng(0).normal(0, 0.01, dim).astype(np.float32)]
    start = time.perf_counter()
    vector = quantize(update, 8.0, 1 << 22)
    for i in range(neighbours + 1):  # the self mask and one pairwise mask per neighbour
        vector = parameters_addition(vector, pseudo_rand_gen(bytes([i]) * 32, 1 << 32, [(dim,)]))
    vector = parameters_mod(vector, 1 << 32)
    seconds = time.perf_counter() - start
    return {"client mask": seconds, "masked bytes": float(ArrayRecord(vector).count_bytes()), "masks": neighbours + 1}


def run_protocol(clients: int) -> None:
    from flwr.app import ArrayRecord

    print(f"SecAgg+ among {clients} clients, one round (seconds; bytes up per client)")
    for name, dim in (("CNN", CNN_DIM), ("ResNet-18", RESNET18_DIM)):
        dense = ArrayRecord([np.zeros(dim, np.float32)]).count_bytes()
        flower = flower_client_masking(dim, clients)
        print(f"\n{name} (d = {dim:,}): a plain float32 upload is {dense:,} B")
        print(
            f"  Flower 1.39 SecAgg+ client masking (quantize, {flower['masks']:.0f} PRG expansions, mod): "
            f"{flower['client mask']:.3f} s, masked vector {flower['masked bytes']:,.0f} B "
            f"({flower['masked bytes'] / dense:.2f}x float32)"
        )
        for bits in (8, 16):
            row = protocol_round(dim, clients, bits)
            print(
                f"  pollen {bits:>2} bits ({row['lane bits']:.0f}-bit lanes): bytes up {row['bytes up']:,.0f} "
                f"({row['bytes up'] / dense:.2f}x float32; masked integers {row['masked bytes']:,.0f}); "
                f"client {row['client total']:.3f} s (encode {row['client encode']:.3f}, mask "
                f"{row['client mask']:.3f}); server {row['server total']:.3f} s (unmask {row['server unmask']:.3f})"
            )


class _Clients:
    """Eight in-process clients behind one ClientApp: each message and reply serialised to Flower's protobuf and
    back (each node decodes its own copy, as over the transport), each call timed, every message's bytes counted
    both ways."""

    def __init__(self, app: object, nodes: list[int]) -> None:
        from flwr.app import Context, RecordDict

        self.app, self.seconds, self.down, self.up = app, 0.0, 0, 0
        self.contexts = {
            n: Context(run_id=1, node_id=n, node_config={"partition-id": i}, state=RecordDict(), run_config={})
            for i, n in enumerate(nodes)
        }

    def __call__(self, msg: object) -> object:
        from flwr.common.serde import message_from_proto, message_to_proto

        wire = message_to_proto(msg)
        self.down += wire.content.ByteSize()
        msg = message_from_proto(wire)  # each node gets its own copy off the wire, as in Flower
        start = time.perf_counter()
        reply = self.app(msg, self.contexts[msg.metadata.dst_node_id])  # type: ignore[attr-defined,operator]
        self.seconds += time.perf_counter() - start
        wire = message_to_proto(reply)
        self.up += wire.content.ByteSize()
        return message_from_proto(wire)


def _update(node: int, dim: int) -> np.ndarray:
    return np.random.default_rng(node).normal(0, 0.01, dim).astype(np.float32)


def flower_secaggplus_rounds(dim: int, nodes: list[int], rounds: int) -> _Clients:
    """Flower 1.39's SecAgg+ example's shape: legacy FedAvg through ``SecAggPlusWorkflow``, ``secaggplus_mod``."""
    from flwr.app import RecordDict
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    from pollen.testing.fakes import FakeGrid

    class Adds(NumPyClient):
        def __init__(self, node: int) -> None:
            self.node = node

        def fit(self, parameters, config):  # noqa: ANN001, ANN202
            return [parameters[0] + _update(self.node, dim)], 10, {}

    def client_fn(context: Context):  # noqa: ANN202
        return Adds(int(context.node_id)).to_client()

    clients = _Clients(ClientApp(client_fn=client_fn, mods=[secaggplus_mod]), nodes)
    strategy = FedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_available_clients=len(nodes),
        min_fit_clients=len(nodes),
        initial_parameters=ndarrays_to_parameters([np.zeros(dim, np.float32)]),
    )
    workflow = DefaultWorkflow(
        fit_workflow=SecAggPlusWorkflow(num_shares=min(len(nodes) - 1, 7), reconstruction_threshold=5, max_weight=1)
    )
    context = LegacyContext(
        context=Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
        config=ServerConfig(num_rounds=rounds),
        strategy=strategy,
    )
    grid = FakeGrid(nodes, clients, keep_history=False)
    grid.set_run(SimpleNamespace(run_id=1))  # Flower's legacy client manager asks the grid for its run
    workflow(grid, context)
    return clients


def pollen_rounds(dim: int, nodes: list[int], rounds: int, bits: int | None) -> _Clients:
    """pollen's FedAvg-equivalent (``FedOpt`` SGD, eta 1), under secure aggregation at ``bits`` (``None``: plain)."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from pollen.clientside import secagg_mod
    from pollen.strategies import FedOpt
    from pollen.strategies.engine.parts import EngineParts
    from pollen.strategies.engine.secure import SecureAggregation
    from pollen.testing.fakes import FakeGrid
    from pollen.wire.records import arrays_to_record

    app = ClientApp(mods=[secagg_mod] if bits else [])

    @app.train()
    def train(msg: Message, context: object) -> Message:
        weights = msg.content.array_records["arrays"]["w"].numpy()
        arrays = arrays_to_record({"w": weights + _update(int(msg.metadata.dst_node_id), dim)})
        metrics = MetricRecord({"num-examples": 10})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    clients = _Clients(app, nodes)
    parts = EngineParts(secagg=SecureAggregation(bits=bits, seed=1)) if bits else None
    strategy = FedOpt(optimizer="sgd", eta=1.0, fraction_evaluate=0.0, min_available_nodes=len(nodes), parts=parts)
    strategy.start(
        grid=FakeGrid(nodes, clients, keep_history=False),
        initial_arrays=arrays_to_record({"w": np.zeros(dim, np.float32)}),
        num_rounds=rounds,
    )
    assert isinstance(strategy.global_arrays(), ArrayRecord)
    return clients


def run_rounds(clients: int, rounds: int) -> None:
    import logging

    logging.getLogger("flwr").setLevel(logging.ERROR)
    nodes = [(1 << 63) + 7919 * i for i in range(clients)]
    print(f"{rounds} rounds of {clients} in-process clients adding a fixed update (no training); per round:")
    for name, dim in (("CNN", CNN_DIM), ("ResNet-18", RESNET18_DIM)):
        print(f"\n{name} (d = {dim:,})")
        runs = (
            ("Flower SecAgg+ (legacy FedAvg)", flower_secaggplus_rounds, ()),
            ("pollen FedOpt-SGD, secagg 16 bits", pollen_rounds, (16,)),
            ("pollen FedOpt-SGD, secagg 8 bits", pollen_rounds, (8,)),
            ("pollen FedOpt-SGD, plain", pollen_rounds, (None,)),
        )
        for label, run, more in runs:
            start = time.perf_counter()
            counted = run(dim, nodes, rounds, *more)
            total = (time.perf_counter() - start) / rounds
            client = counted.seconds / rounds
            print(
                f"  {label:<34} {total:7.3f} s a round (clients {client:.3f}, server {total - client:.3f}); "
                f"per client up {counted.up / rounds / clients:,.0f} B, down {counted.down / rounds / clients:,.0f} B"
            )


def run_quality(rounds: int, seeds: list[int], nodes: int) -> None:
    from pollen.testing.inprocess import run_inprocess

    print(
        f"Fashion-MNIST, CNN with GroupNorm, {nodes} clients, {rounds} rounds: final test accuracy over seeds {seeds}"
    )
    for strategy in ("fedams", "fedcams"):
        for label, extra in (
            ("plain", {}),
            ("secagg 8 bits", {"secagg": True, "secagg-bits": 8}),
            ("secagg 16 bits", {"secagg": True, "secagg-bits": 16}),
        ):
            finals, seconds = [], []
            for seed in seeds:
                start = time.perf_counter()
                rows = run_inprocess(
                    {
                        "strategy": strategy,
                        "norm": "gn",
                        "seed": seed,
                        "num-server-rounds": rounds,
                        "run-name": f"bench-secagg-{strategy}-{label.replace(' ', '-')}-{seed}",
                        "results-dir": "/tmp/pollen-bench-secagg",
                        "fraction-evaluate": 0.0,
                        **extra,
                    },
                    num_nodes=nodes,
                )
                seconds.append(time.perf_counter() - start)
                finals.append(float(rows[-1]["accuracy"]))
            print(
                f"  {strategy:<8} {label:<15} {statistics.mean(finals):.3f} ({min(finals):.3f}-{max(finals):.3f})  "
                f"{statistics.mean(seconds) / rounds:.1f} s a round"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("protocol", "rounds", "quality"), default="protocol")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--nodes", type=int, default=10)
    args = parser.parse_args()
    if args.part == "protocol":
        run_protocol(args.clients)
    elif args.part == "rounds":
        run_rounds(args.clients, 3)
    else:
        import logging

        logging.getLogger("flwr").setLevel(logging.WARNING)
        run_quality(args.rounds, args.seeds, args.nodes)


if __name__ == "__main__":
    main()
