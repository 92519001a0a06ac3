"""Client step time of pollen's LocalLAMB (Fed-LAMB / Fed-AMS local optimiser) vs torch.optim.AdamW.

What: per model (pollen's Fashion-MNIST CNN and its CIFAR ResNet-18), the time of (1) ``opt.step()``
alone, after a backward pass has filled ``.grad``, and (2) a whole training step (``zero_grad``,
forward, cross-entropy, backward, ``step``) for torch's AdamW and three LocalLAMB configurations:
LAMB as Fed-LAMB runs it on a sync round (``trust_ratio=True, track_v=True``), LAMB without the
uploaded ``v`` (``track_v=False``, as Mime-LAMB) and the AMSGrad step of Fed-AMS
(``trust_ratio=False``). Every LocalLAMB gets a global ``v_hat`` through
``pollen.clientside.steps.fedlamb.set_global_v_hat`` (a flat float32 vector of small positive values,
one per trainable scalar), as the Fed-LAMB client does.

Why: LocalLAMB is a plain per-tensor Python loop (trust ratio = two norms per tensor) while AdamW is
torch's tuned implementation; this shows what the local step costs a client, alone and as a share of
a training step.

How: one model initialisation (same seed) copied to every optimiser, the same synthetic batches (seeded,
already on the device: data loading is not timed), lr 1e-3 and decoupled weight decay 0.01 for all;
AdamW with torch's defaults (``foreach``/``fused`` left to torch: a per-tensor loop on the CPU, the
multi-tensor kernels on CUDA). Warm-up steps first (not timed); then each repeat runs ``--steps``
whole steps and ``--steps`` step-only calls per optimiser (the order rotates between repeats, so
drifting load on a shared machine hits every optimiser alike). A sample is the mean ms per step of a
block; the table shows the median over repeats with min-max, and median / AdamW's median. Clock:
``time.perf_counter``, with ``torch.cuda.synchronize()`` before each reading on CUDA.

Run: ``python benchmarks/bench_lamb_step.py [--models cnn resnet18] [--steps 5] [--repeats 3]
[--batch-size 32] [--device cpu|cuda] [--warmup 1] [--threads 1]``; the defaults take about
1.5 minutes on one CPU thread (ResNet-18's forward/backward dominates).
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pollen.clientside.lamb import LocalLAMB  # noqa: E402
from pollen.clientside.steps.fedlamb import set_global_v_hat  # noqa: E402
from pollen.task.data import dataset_info  # noqa: E402
from pollen.task.models import build_model, num_parameters  # noqa: E402

DATASETS = {"cnn": "fashion-mnist", "resnet18": "cifar10"}  # the model and the input it is built for
LR = 1e-3
WEIGHT_DECAY = 0.01
SEED = 0

# name -> LocalLAMB settings; None is the AdamW baseline (first: the ratios divide by it)
CONFIGS: dict[str, dict | None] = {
    "AdamW (torch)": None,
    "LAMB, track_v (Fed-LAMB)": {"trust_ratio": True, "track_v": True},
    "LAMB, no v (Mime-LAMB)": {"trust_ratio": True, "track_v": False},
    "AMSGrad (Fed-AMS)": {"trust_ratio": False, "track_v": True},
}
BASELINE = next(iter(CONFIGS))
Batch = tuple[torch.Tensor, torch.Tensor]


def make_optimizer(model: torch.nn.Module, settings: dict | None, v_hat: np.ndarray) -> torch.optim.Optimizer:
    """AdamW for ``None``, else a LocalLAMB with ``settings`` and the global ``v_hat`` installed."""
    params = list(model.parameters())
    if settings is None:
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    opt = LocalLAMB(params, lr=LR, weight_decay=WEIGHT_DECAY, **settings)
    set_global_v_hat(opt, v_hat)  # as the Fed-LAMB client step does, from one flat float32 vector
    return opt


def small_v_hat(d: int) -> np.ndarray:
    """A plausible server ``v_hat``: squared-gradient-sized values in [1e-6, 1e-4], seeded."""
    rng = np.random.default_rng(SEED)
    return rng.uniform(1e-6, 1e-4, size=d).astype(np.float32)


def make_batches(model_name: str, n: int, batch_size: int, device: torch.device) -> list[Batch]:
    """``n`` seeded synthetic batches shaped like the model's dataset, already on ``device``."""
    info = dataset_info(DATASETS[model_name])
    gen = torch.Generator().manual_seed(SEED)
    shape = (batch_size, info.num_channels, info.image_size, info.image_size)
    batches = []
    for _ in range(n):
        x = torch.randn(shape, generator=gen)
        y = torch.randint(info.num_classes, (batch_size,), generator=gen)
        batches.append((x.to(device), y.to(device)))
    return batches


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    x, y = batch
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def ms_per_step(fn: Callable[[int], object], steps: int, device: torch.device) -> float:
    """Mean milliseconds of ``fn(i)`` over ``i = 0 .. steps-1``, timed as one block."""
    started = clock(device)
    for i in range(steps):
        fn(i)
    return 1e3 * (clock(device) - started) / steps


class Run:
    """One optimiser on its own copy of the model, with its timing samples."""

    def __init__(self, model: torch.nn.Module, settings: dict | None, v_hat: np.ndarray) -> None:
        self.model = copy.deepcopy(model).train()
        self.opt = make_optimizer(self.model, settings, v_hat)
        self.step_only: list[float] = []
        self.whole: list[float] = []

    def whole_steps(self, batches: list[Batch], steps: int, device: torch.device) -> float:
        return ms_per_step(lambda i: train_step(self.model, self.opt, batches[i % len(batches)]), steps, device)

    def opt_steps(self, steps: int, device: torch.device) -> float:
        """Only ``opt.step()``, on the ``.grad`` the last whole step's backward left."""
        return ms_per_step(lambda i: self.opt.step(), steps, device)


def bench_model(model_name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Run]:
    torch.manual_seed(SEED)
    model = build_model(model_name, dataset_info(DATASETS[model_name])).to(device)
    d = num_parameters(model)
    v_hat = small_v_hat(d)
    batches = make_batches(model_name, args.steps, args.batch_size, device)
    runs = {name: Run(model, settings, v_hat) for name, settings in CONFIGS.items()}
    for run in runs.values():  # warm-up: optimiser state, allocator, first-touch pages; fills .grad
        run.whole_steps(batches, args.warmup, device)
        run.opt_steps(args.warmup, device)
    names = list(runs)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run = runs[name]
            run.whole.append(run.whole_steps(batches, args.steps, device))
            run.step_only.append(run.opt_steps(args.steps, device))
    diverged = [name for name, run in runs.items() if not all(bool(p.isfinite().all()) for p in run.model.parameters())]
    tensors = len(list(model.parameters()))
    print(f"{model_name}: d = {d:,} trainable parameters in {tensors} tensors, {DATASETS[model_name]}-shaped batches")
    if diverged:  # NaN/Inf arithmetic can run at a different speed: the numbers of these rows are suspect
        print(f"  warning: non-finite parameters after the run: {', '.join(diverged)}")
    return runs


def cell(samples: list[float]) -> str:
    return f"{statistics.median(samples):8.2f} ({min(samples):.2f}-{max(samples):.2f})"


def print_table(results: dict[str, dict[str, Run]]) -> None:
    header = (
        f"{'model':<9} {'configuration':<25} {'step-only ms (min-max)':>26} {'whole-step ms (min-max)':>30} "
        f"{'step/AdamW':>10} {'whole/AdamW':>11}"
    )
    print(header)
    print("-" * len(header))
    for model_name, runs in results.items():
        base = runs[BASELINE]
        base_step, base_whole = statistics.median(base.step_only), statistics.median(base.whole)
        for name, run in runs.items():
            step_ratio = statistics.median(run.step_only) / base_step
            whole_ratio = statistics.median(run.whole) / base_whole
            print(
                f"{model_name:<9} {name:<25} {cell(run.step_only):>26} {cell(run.whole):>30} "
                f"{step_ratio:>10.2f} {whole_ratio:>11.2f}"
            )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(DATASETS), default=["cnn", "resnet18"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repeat (N)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of N steps (R)")
    parser.add_argument("--batch-size", type=int, default=32, help="pollen's default batch-size")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per optimiser before the repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()
    for key in ("steps", "repeats", "batch_size", "warmup", "threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    print("command: " + shlex.join(["python", *sys.argv]))
    if args.device == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        print(f"device cuda: skipped ({why}; torch {torch.__version__}); run with --device cpu")
        return
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} thread(s)"
    print(
        f"torch {torch.__version__} on {name}; steps={args.steps} repeats={args.repeats} warmup={args.warmup} "
        f"batch-size={args.batch_size} lr={LR} weight-decay={WEIGHT_DECAY} seed={SEED}"
    )
    results = {model_name: bench_model(model_name, args, device) for model_name in args.models}
    print()
    print_table(results)


if __name__ == "__main__":
    main()
