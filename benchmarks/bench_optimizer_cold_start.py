"""A fresh process's local training with each client optimiser: what a deployed message pays for it.

What: in a new interpreter each time (a SuperNode starts one ``flwr-clientapp`` per message), import torch and
pollen's training loop, build the Fashion-MNIST CNN, train ``--steps`` steps on seeded synthetic batches with one
optimiser, then ``zero_grad`` and ``state_dict`` (what a client keeps between rounds; PlainSGD has none).
Optimisers: pollen's ``LocalLAMB`` (Fed-LAMB / Mime-LAMB / Fed-AMS) and ``PlainSGD`` (every other method),
against what a user would otherwise write, ``torch.optim.AdamW`` and ``torch.optim.SGD``.

Why: torch.optim's methods (``add_param_group``, ``zero_grad``, ``state_dict``, ``step``'s hooks) import the
compiler (``torch._dynamo``) at their first call to keep it out of the method: seconds of a small machine's CPU
in every message of a deployment. LocalLAMB calls those methods without the guard; PlainSGD is no
``torch.optim`` class at all. The table shows each optimiser's whole process time and whether the compiler was
imported.

How: the four run alternately, ``--repeats`` times each, ``OMP_NUM_THREADS=1`` (a SuperNode's ClientApp on a
small machine); the table gives the median with min-max and the ratio to ``torch.optim.AdamW``'s median.

Run: ``python benchmarks/bench_optimizer_cold_start.py [--repeats 5] [--steps 5]``; about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_FRESH = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from pollen.task.data import dataset_info
from pollen.task.models import build_model
from pollen.task.train import train
from torch.utils.data import DataLoader, TensorDataset
t1 = time.perf_counter()
name, steps = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = build_model("cnn", dataset_info("fashion-mnist"))
data = TensorDataset(torch.randn(32 * steps, 1, 28, 28), torch.randint(0, 10, (32 * steps,)))
if name == "LocalLAMB":
    from pollen.clientside.lamb import LocalLAMB
    optimizer = LocalLAMB(model.parameters(), lr=0.01, weight_decay=0.01)
elif name == "PlainSGD":
    from pollen.task.sgd import PlainSGD
    optimizer = PlainSGD(model.parameters(), lr=0.01)
elif name == "torch.optim.AdamW":
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.001, weight_decay=0.01)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
train(model, DataLoader(data, batch_size=32), lr=0.01, local_steps=steps, optimizer=optimizer)
optimizer.zero_grad()
kept = optimizer.state_dict() if hasattr(optimizer, "state_dict") else None  # PlainSGD keeps none
t2 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "train_and_keep": t2 - t1, "compiler": "torch._dynamo" in sys.modules}))
"""

OPTIMIZERS = ("LocalLAMB", "PlainSGD", "torch.optim.AdamW", "torch.optim.SGD")


def one(name: str, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _FRESH, name, str(steps)], capture_output=True, text=True, check=True, env=env
    )
    sample = json.loads(done.stdout.strip().splitlines()[-1])
    sample["process"] = time.perf_counter() - start
    return sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    one("PlainSGD", 1)  # warm the page cache: the first interpreter reads torch from disk
    samples: dict[str, list[dict]] = {name: [] for name in OPTIMIZERS}
    for _ in range(args.repeats):
        for name in OPTIMIZERS:
            samples[name].append(one(name, args.steps))
    reference = statistics.median(s["process"] for s in samples["torch.optim.AdamW"])
    print(f"fresh process, CNN, {args.steps} steps, zero_grad + state_dict; median (min-max) of {args.repeats}")
    print(f"{'optimiser':<20} {'process s':>22} {'of which training s':>20} {'compiler':>9} {'x AdamW':>8}")
    for name, rows in samples.items():
        total = [r["process"] for r in rows]
        training = statistics.median(r["train_and_keep"] for r in rows)
        compiler = "yes" if any(r["compiler"] for r in rows) else "no"
        print(
            f"{name:<20} {statistics.median(total):>8.2f} ({min(total):.2f}-{max(total):.2f}) "
            f"{training:>20.2f} {compiler:>9} {statistics.median(total) / reference:>8.2f}"
        )


if __name__ == "__main__":
    main()
