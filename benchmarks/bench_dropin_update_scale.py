"""How large FedAvg's round update is in each drop-in project: would a server step relative to it carry over?

An adaptive server step moves each coordinate by about ``eta`` in its first rounds (AMSGrad's first step is
``eta * sign(delta)``), whatever the clients' updates are. The drop-in table (``bench_dropin.py``) found that
``eta=0.01`` suits quickstart-pytorch (0.02-0.03 break it) and is too small for advanced-pytorch, so a step
size relative to the update's own scale was the next candidate. This prints, for each project and seed, the
root mean square and mean absolute value of FedAvg's aggregated update (the new global model minus the one
sent) over the floating-point parameters, and of the model itself, for the first ``--rounds`` rounds.

Run: ``python benchmarks/bench_dropin_update_scale.py [--rounds 3] [--seeds 1 2 3] [--projects ...]``
(about 30 s a seed for the three projects on one core).
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any

import numpy as np
from bench_dropin import PROJECTS
from flwr.serverapp.strategy import FedAvg

from pollen.testing.foreign import harness


class UpdateScale(FedAvg):
    """Flower's FedAvg that records the root mean square of each round's aggregated update."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rounds: dict[int, dict[str, float]] = {}
        self._sent: dict[str, np.ndarray] = {}

    def configure_train(self, server_round, arrays, config, grid):  # noqa: ANN001, ANN201
        self._sent = {name: array.numpy().copy() for name, array in arrays.items()}
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):  # noqa: ANN001, ANN201
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            floats = [name for name, value in self._sent.items() if value.dtype.kind == "f"]
            delta = np.concatenate([(arrays[name].numpy() - self._sent[name]).ravel() for name in floats])
            model = np.concatenate([self._sent[name].ravel() for name in floats])
            self.rounds[server_round] = {
                "rms": float(np.sqrt(np.mean(np.square(delta, dtype=np.float64)))),
                "mean_abs": float(np.mean(np.abs(delta))),
                "model_rms": float(np.sqrt(np.mean(np.square(model, dtype=np.float64)))),
            }
        return arrays, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--projects", nargs="*", choices=sorted(PROJECTS), default=sorted(PROJECTS))
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    print("FedAvg's aggregated update, mean over seeds", args.seeds, "(min-max)")
    print(f"{'project':20} {'round':>5} {'rms(update)':>26} {'mean |update|':>26} {'rms(model)':>10}")
    for name in args.projects:
        project = PROJECTS[name]
        runs = []
        for seed in args.seeds:
            probe = UpdateScale(fraction_train=project.fraction_train, fraction_evaluate=0.0)
            harness.run_project(project, probe, seed=seed, num_rounds=args.rounds)
            runs.append(probe.rounds)
        for rnd in range(1, args.rounds + 1):
            model = statistics.mean(run[rnd]["model_rms"] for run in runs)
            rms, mean_abs = (_cell([run[rnd][key] for run in runs]) for key in ("rms", "mean_abs"))
            print(f"{name:20} {rnd:5d} {rms:>26} {mean_abs:>26} {model:10.2e}")


def _cell(values: list[float]) -> str:
    return f"{statistics.mean(values):.2e} ({min(values):.1e}-{max(values):.1e})"


if __name__ == "__main__":
    main()
