"""What central DP adds to a server round at ResNet-18 size: clipping and noise, against the same round without.

The harness of ``bench_round.py`` (its reply bank and timed rounds: ``configure_train`` + ``aggregate_train``
through the Message API, a grid that frees every message after its round), on ResNet-18 for CIFAR-10 with
GroupNorm (d = 11,173,962; central DP refuses BatchNorm's running statistics, which are averaged outside the
clipped update), M dense replies a round (each the global model plus its own fixed move of norm about 3.3,
so the clip of 1.0 scales every one). Side by side, in one run:

- FedAMS without DP (the default outlier screen on), and with the screen off (what DP runs with);
- FedAMS with ``CentralPrivacy(clip=1.0, noise_multiplier=1.0)``: each update's float64 norm and its scaling,
  the sum, ``d`` Gaussian draws (Philox) and the division, before the same AMSGrad step;
- FedCAMS (scaled sign, error feedback) without and with it (each client clips ``Delta + e`` before its sign).

Times are medians over rounds 2.. in ms, and the ratio to the same method without DP.

Run: ``python benchmarks/bench_privacy_round.py [--rounds 6] [--replies 10]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_round import ReplyBank, copyto_seconds, run  # noqa: E402

from pollen.strategies import CentralPrivacy, EngineParts, FedAMS, FedCAMS  # noqa: E402
from pollen.strategies.engine.screening import UpdateScreen  # noqa: E402


def resnet_gn_arrays() -> dict[str, np.ndarray]:
    import torch

    from pollen.task.data import dataset_info
    from pollen.task.models import build_model

    torch.manual_seed(0)
    model = build_model("resnet18", dataset_info("cifar10"), norm="gn")
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--replies", type=int, default=10)
    args = parser.parse_args()
    arrays = resnet_gn_arrays()
    dim = sum(v.size for v in arrays.values() if v.dtype.kind == "f")
    nodes = list(range(1, args.replies + 1))
    common = dict(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=len(nodes))

    def private() -> EngineParts:
        return EngineParts(privacy=CentralPrivacy(clip=1.0, noise_multiplier=1.0, seed=0))

    dense, sign = ReplyBank(arrays, nodes, None), ReplyBank(arrays, nodes, "sign")
    cases = [
        ("FedAMS, no DP", "FedAMS", lambda: FedAMS(eta=0.1, **common), dense),
        (
            "FedAMS, no DP, screen off",
            None,
            lambda: FedAMS(eta=0.1, parts=EngineParts(screen=UpdateScreen(rule="off")), **common),
            dense,
        ),
        ("FedAMS, central DP", "FedAMS", lambda: FedAMS(eta=0.1, parts=private(), **common), dense),
        (
            "FedCAMS sign, no DP",
            "FedCAMS",
            lambda: FedCAMS(compressor="sign", eta=0.1, granularity="model", **common),
            sign,
        ),
        (
            "FedCAMS sign, central DP",
            "FedCAMS",
            lambda: FedCAMS(compressor="sign", eta=0.1, granularity="model", parts=private(), **common),
            sign,
        ),
    ]
    yardstick = copyto_seconds(dim)
    print(f"d = {dim:,}, {len(nodes)} replies per round; one np.copyto of a d-vector: {1e3 * yardstick:.1f} ms")
    print(f"{'round (configure + aggregate)':<30} {'median ms':>10} {'x copyto':>9} {'x no DP':>8}")
    plain: dict[str, float] = {}
    for name, family, make, bank in cases:
        median = statistics.median(run(make(), arrays, bank, nodes, args.rounds)[1:])
        if family is not None and family not in plain:
            plain[family] = median
        ratio = f"{median / plain[family]:>8.2f}" if family is not None else f"{'':>8}"
        print(f"{name:<30} {1e3 * median:>10.0f} {median / yardstick:>9.1f} {ratio}")


if __name__ == "__main__":
    main()
