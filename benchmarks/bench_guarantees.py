"""What issue 24's guarantees cost per round at ResNet-18 size: the fixed reply order and the applied ledger.

Same harness as ``bench_round.py`` (d = 11,173,962; M replies through the Message API and the in-process
grid that frees messages after each round; ``configure_train`` + ``aggregate_train`` timed, the clients'
work not). Each strategy runs twice in this one process, alternating: as shipped (replies read in a fixed
order; error-fed uploads tell each client what was applied, which gives every node its own config
record), and with both taken away (arrival order, no ledger): the difference is what the guarantees cost.

Run: ``python benchmarks/bench_guarantees.py [--rounds 6] [--replies 10]``.
"""

from __future__ import annotations

import argparse
import statistics

from bench_round import ReplyBank, resnet_arrays, run  # this script's folder is on sys.path when run by path

from pollen.strategies import FedAMS, FedCAMS
from pollen.strategies.engine.collector import ReplyCollector
from pollen.strategies.engine.ledger import AppliedLedger


def without_guarantees() -> tuple:
    """Arrival order and no ledger; returns what puts them back."""
    order, told = ReplyCollector.in_fixed_order, AppliedLedger.told
    ReplyCollector.in_fixed_order = lambda self, replies: list(replies)
    AppliedLedger.told = lambda self, content, *_: content
    return order, told


def restore(saved: tuple) -> None:
    ReplyCollector.in_fixed_order, AppliedLedger.told = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--replies", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    arrays = resnet_arrays()
    nodes = list(range(1, args.replies + 1))
    common = dict(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=len(nodes))
    cases = [
        ("FedAMS, dense", lambda: FedAMS(eta=0.1, **common), ReplyBank(arrays, nodes, None)),
        (
            "FedCAMS, sign + EF",
            lambda: FedCAMS(compressor="sign", eta=0.1, granularity="model", **common),
            ReplyBank(arrays, nodes, "sign"),
        ),
    ]
    print(f"{len(nodes)} replies per round, ResNet-18; median ms of rounds 2..{args.rounds}, {args.repeats} repeats")
    print(f"{'strategy':<22} {'with guarantees':>16} {'without':>9} {'ratio':>7}")
    for name, make, bank in cases:
        shipped, bare = [], []
        for _ in range(args.repeats):
            shipped += run(make(), arrays, bank, nodes, args.rounds)[1:]
            saved = without_guarantees()
            try:
                bare += run(make(), arrays, bank, nodes, args.rounds)[1:]
            finally:
                restore(saved)
        with_ms, without_ms = 1e3 * statistics.median(shipped), 1e3 * statistics.median(bare)
        print(f"{name:<22} {with_ms:>16.0f} {without_ms:>9.0f} {with_ms / without_ms:>7.2f}")


if __name__ == "__main__":
    main()
