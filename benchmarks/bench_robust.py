"""Issue 24: robust aggregators against the mean, with 10% and 20% of clients sending plausible wrong updates.

Two parts:

1. **Accuracy** (``--part accuracy``): pollen's real ServerApp and ClientApp in one process
   (:func:`pollen.testing.inprocess.run_inprocess`) on Debian's Fashion-MNIST, 20 clients (Dirichlet 0.5),
   10 sampled per round, the task's MLP (the CNN trains 10x slower on this shared 2-core machine), FedAMS
   (Option 1) on the server. A fixed, seeded set of 0, 2 or 4 clients (0, 10, 20%) are attackers: they
   train honestly, then upload their update sign-flipped (``x -1``) or scaled by ``-3`` (both within 3x
   of an honest norm, so the 10x outlier screen lets them through). Dense uploads
   (the identity codec) compare the mean, the coordinate-wise median and the trimmed mean (beta 0.2);
   scaled-sign uploads compare the mean (FedCAMS, error feedback on) with the majority vote (signSGD's, error
   feedback off: a vote has no per-client share to tell an error-fed client, issue 43). The attack
   is a wrapper around the ClientApp's upload (``compress_update``), so every reply is read by the real
   server as any other.
2. **Cost** (``--part cost``): the server's whole ``aggregate_train`` (read 10 replies, aggregate, AMSGrad
   step) per round, ms, for each aggregator side by side with the streamed mean, at the task's CNN size and
   at ResNet-18 size (synthetic full-model replies on the fake grid).

    python benchmarks/bench_robust.py [--rounds 20] [--seeds 1 2] [--jobs 2] [--part all]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLIENTS = 20
SETUP = {
    "model": "mlp",
    "dataset": "fashion-mnist",
    "partitioner": "dirichlet",
    "dirichlet-alpha": 0.5,
    "fraction-train": 0.5,
    "min-train-nodes": 10,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "local-steps": 10,
    "batch-size": 32,
    "local-lr": 0.05,
    "server-lr": 0.1,
    "eps": 0.001,
    "eps-mode": "max",
    "eval-batch-size": 1000,
}
#: name -> run-config of the method and aggregator.
AGGREGATORS = {
    "mean": {"strategy": "fedcams", "compressor": "none", "aggregator": "mean"},
    "median": {"strategy": "fedcams", "compressor": "none", "aggregator": "median"},
    "trimmed mean (0.2)": {
        "strategy": "fedcams",
        "compressor": "none",
        "aggregator": "trimmed-mean",
        "trim-fraction": 0.2,
    },
    "sign, mean": {"strategy": "fedcams", "compressor": "sign", "aggregator": "mean"},
    # signSGD's vote without error feedback: a vote has no per-client share to tell an error-fed client (issue 43)
    "sign, majority vote": {
        "strategy": "fedcams",
        "compressor": "sign",
        "aggregator": "majority-vote",
        "error-feedback": False,
    },
}
#: name -> (number of attackers out of CLIENTS, the factor they multiply their update by).
ATTACKS = {
    "none": (0, 1.0),
    "10% sign-flipped": (2, -1.0),
    "20% sign-flipped": (4, -1.0),
    "10% scaled by -3": (2, -3.0),
    "20% scaled by -3": (4, -3.0),
}

_attack = {"factor": 1.0, "attackers": frozenset(), "current": False}


def _attacking_upload(original):  # noqa: ANN001, ANN202
    """``compress_update`` with the update multiplied by the attack factor when the current client attacks."""

    def upload(delta, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if _attack["current"]:
            delta = delta * np.float32(_attack["factor"])
        return original(delta, *args, **kwargs)

    return upload


def _attack_app():  # noqa: ANN202
    """pollen's ClientApp whose attackers (by partition id) upload ``factor x`` their honest update."""
    from flwr.clientapp import ClientApp

    import pollen.client_app as client_module

    client_module.compress_update = _attacking_upload(client_module.compress_update)
    app = ClientApp()

    @app.train(mods=list(client_module.TRAIN_MODS))
    def train(msg, context):  # noqa: ANN001, ANN202
        _attack["current"] = int(context.node_config["partition-id"]) in _attack["attackers"]
        try:
            return client_module.run_train(msg, context)
        finally:
            _attack["current"] = False

    @app.evaluate()
    def evaluate(msg, context):  # noqa: ANN001, ANN202
        return client_module.evaluate(msg, context)

    app.query("pollen_identify")(client_module.identify)
    return app


def one_run(out: str, name: str, attack: str, seed: int, rounds: int) -> None:
    """One run; writes its final accuracy to ``out/<name>|<attack>|<seed>.json``."""
    from pollen.testing.inprocess import run_inprocess

    count, factor = ATTACKS[attack]
    chosen = np.random.default_rng(1000 + seed).permutation(CLIENTS)[:count]
    _attack.update(factor=factor, attackers=frozenset(int(c) for c in chosen))
    overrides = {
        **SETUP,
        **AGGREGATORS[name],
        "seed": seed,
        "num-server-rounds": rounds,
        "eval-every": rounds,
        "results-dir": out,
        "run-name": f"{name}-{attack}-{seed}".replace(" ", "_").replace("%", "pc").replace("(", "").replace(")", ""),
    }
    started = time.perf_counter()
    rows = run_inprocess(overrides, CLIENTS, client_app=_attack_app())
    final = [r for r in rows if r.get("central_accuracy") is not None or r.get("accuracy") is not None][-1]
    accuracy = final.get("central_accuracy", final.get("accuracy"))
    failures = sum(int(r.get("failures", 0) or 0) for r in rows)
    result = {"accuracy": accuracy, "failures": failures, "seconds": time.perf_counter() - started}
    Path(out, f"{name}|{attack}|{seed}.json").write_text(json.dumps(result))


def accuracy_part(rounds: int, seeds: list[int], jobs: int) -> None:
    from pollen.testing.inprocess import run_parallel

    out = tempfile.mkdtemp(prefix="pollen-robust-")
    calls = [(out, n, a, s, rounds) for n in AGGREGATORS for a in ATTACKS for s in seeds]
    started = time.perf_counter()
    run_parallel(one_run, calls, jobs)
    print(
        f"\nFashion-MNIST, {CLIENTS} clients (Dirichlet 0.5), 10 per round, MLP, K=10 steps of batch 32, "
        f"eta_l=0.05, FedAMS Option 1 eta=0.1 eps=1e-3, {rounds} rounds, seeds {seeds}; "
        f"{len(calls)} runs in {time.perf_counter() - started:.0f} s ({jobs} at a time)"
    )
    print("final test accuracy, mean ± sd over seeds (rejected replies in all runs of the cell)\n")
    print("| aggregator | " + " | ".join(ATTACKS) + " |")
    print("|---|" + "---|" * len(ATTACKS))
    for name in AGGREGATORS:
        cells = []
        for attack in ATTACKS:
            results = [json.loads(Path(out, f"{name}|{attack}|{s}.json").read_text()) for s in seeds]
            accs = [r["accuracy"] for r in results]
            spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
            failures = sum(r["failures"] for r in results)
            cells.append(f"{statistics.mean(accs):.3f} ± {spread:.3f}" + (f" ({failures} rej.)" if failures else ""))
        print(f"| {name} | " + " | ".join(cells) + " |")


def _sizes(model: str) -> dict[str, tuple[int, ...]]:
    from pollen.task.data import dataset_info
    from pollen.task.models import build_model

    info = dataset_info("cifar10" if model == "resnet18" else "fashion-mnist")
    return {k: tuple(v.shape) for k, v in build_model(model, info).state_dict().items()}


def cost_part(repeats: int = 3, models: tuple[str, ...] = ("cnn", "resnet18")) -> None:
    from flwr.app import ConfigRecord

    from pollen.aggregate import MajorityVote, Mean, Median, TrimmedMean
    from pollen.strategies import FedAMS
    from pollen.testing.fakes import FakeGrid, full_model_reply, global_arrays_of, model_record

    nodes = list(range(1, 11))
    print("\nServer aggregate_train per round (read 10 full-model replies, aggregate, AMSGrad step), ms, median of")
    print(f"{repeats} rounds after one warm-up; synthetic deltas on the fake grid; this machine's CPU\n")
    print("| model (d) | mean (streamed) | median | trimmed mean (0.2) | majority vote* |")
    print("|---|---|---|---|---|")
    for model in models:
        shapes = _sizes(model)
        rng = np.random.default_rng(0)
        initial = {k: rng.standard_normal(s).astype(np.float32) * 0.1 for k, s in shapes.items()}
        for k in initial:
            if k.endswith("num_batches_tracked"):
                initial[k] = np.array(0, dtype=np.int64)
        deltas = {
            n: {k: (rng.standard_normal(v.shape) * 0.01).astype(v.dtype) for k, v in initial.items()} for n in nodes
        }

        def client(msg, deltas=deltas):  # noqa: ANN001, ANN202
            start = global_arrays_of(msg)
            local = {k: (start[k] + deltas[msg.metadata.dst_node_id][k]).astype(start[k].dtype) for k in start}
            return full_model_reply(msg, local, num_examples=10)

        cells = []
        dim = 0
        for aggregator in (Mean(), Median(), TrimmedMean(0.2), MajorityVote()):
            strategy = FedAMS(fraction_train=1.0, min_train_nodes=10, min_available_nodes=10, fraction_evaluate=0.0)
            strategy.aggregator = aggregator  # the vote too: timed on dense replies (see the note below)
            grid = FakeGrid(nodes, client, keep_history=False)
            arrays = model_record(initial)
            times = []
            for server_round in range(1, repeats + 2):
                messages = strategy.configure_train(server_round, arrays, ConfigRecord(), grid)
                replies = list(grid.send_and_receive(messages, timeout=60.0))
                started = time.perf_counter()
                new, _ = strategy.aggregate_train(server_round, replies)
                times.append((time.perf_counter() - started) * 1000)
                arrays = new if new is not None else arrays
                del replies, messages
            dim = strategy.layout.dim
            cells.append(statistics.median(times[1:]))
        base = cells[0]
        print(
            f"| {model} ({dim:,}) | {base:.1f} | " + " | ".join(f"{c:.1f} ({c / base:.1f}x)" for c in cells[1:]) + " |"
        )
    print("\n* the vote timed on dense replies (FedAMS with the identity codec); with sign uploads the server")
    print("  decodes each reply to +-scale first, the same vector length, so the vote's own cost is this one.")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--part", choices=("all", "accuracy", "cost"), default="all")
    args = parser.parse_args()
    if args.part in ("all", "cost"):
        cost_part()
    if args.part in ("all", "accuracy"):
        accuracy_part(args.rounds, args.seeds, args.jobs)


if __name__ == "__main__":
    main()
