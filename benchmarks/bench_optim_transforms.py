"""Milliseconds per server-optimiser update at ResNet-18 size (d = 11,173,962 float32), transforms vs numpy.

For amsgrad (FedAMS, Option 1), adam and lamb (62 per-tensor segments), in the same run:

- ``transform, into=spare``: ``pollen.optim``'s update as a strategy runs it: the step into one reused
  vector, the new state into the spare state (the one discarded a round before), blocked kernels;
- ``transform, fresh state``: the same update without ``into=``: the new state's arrays are allocated
  (and page-faulted) every round, which is what ``into=`` avoids;
- ``numpy one-liners``: the same math written the obvious way (``m = b1 * m + (1 - b1) * d`` ...), a new
  temporary per operation, whole vectors;
- ``np.copyto`` of one d-vector, the memory-bandwidth yardstick, timed right before each repeat.

Each line prints the median and the minimum time and the median ratio to the copy timed next to it
(pairing keeps the ratio honest on a shared machine whose load drifts; the minimum is the least
disturbed repeat). The old mutating API is gone; its kernels are the
ones the transforms run (``tests/unit/test_optim_transforms.py`` proves the numbers are the same bits).

Run: ``python benchmarks/bench_optim_transforms.py [--repeats 7] [--dim 11173962]``; well under a minute.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from pollen.optim import make_server_optimizer, segments_from_sizes  # noqa: E402

D = 11_173_962  # ResNet-18 (CIFAR) trainable parameters, FedCAMS Table 2
F32 = np.float32


def paired(fn: Callable[[], object], yardstick: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """Median and minimum time of ``fn``, and the median of the ratios fn / yardstick, each pair timed
    back to back (the minimum is the least disturbed repeat on a shared machine)."""
    fn()
    yardstick()  # warm-up: first touch of freshly allocated pages
    times, ratios = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        yardstick()
        t_ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        times.append(t)
        ratios.append(t / t_ref)
    return statistics.median(times), min(times), statistics.median(ratios)


def transform_step(opt, delta: np.ndarray, params: np.ndarray, spare: bool) -> Callable[[], None]:  # noqa: ANN001
    """One update per call; with ``spare`` double-buffered as ``AdaptiveStrategy.apply_server_step``."""
    held = {"state": opt.init(delta.shape[0]), "spare": None}
    out = np.empty_like(delta)

    def run() -> None:
        _, new = opt.update(held["state"], delta, params, into=held["spare"] if spare else None, out=out)
        held["spare"], held["state"] = held["state"], new

    return run


def numpy_amsgrad(d: int, eta: float = 1.0, b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3):  # noqa: ANN201
    s = {"m": np.zeros(d, F32), "v": np.zeros(d, F32), "v_hat": np.full(d, eps, F32)}

    def step(delta: np.ndarray, params: np.ndarray) -> np.ndarray:
        s["m"] = b1 * s["m"] + (1 - b1) * delta
        s["v"] = b2 * s["v"] + (1 - b2) * delta * delta
        s["v_hat"] = np.maximum(np.maximum(s["v_hat"], s["v"]), eps)
        return eta * s["m"] / np.sqrt(s["v_hat"])

    return step


def numpy_adam(d: int, eta: float = 0.1, b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3):  # noqa: ANN201
    s = {"m": np.zeros(d, F32), "v": np.zeros(d, F32)}

    def step(delta: np.ndarray, params: np.ndarray) -> np.ndarray:
        s["m"] = b1 * s["m"] + (1 - b1) * delta
        s["v"] = b2 * s["v"] + (1 - b2) * delta * delta
        return eta * s["m"] / (np.sqrt(s["v"]) + eps)

    return step


def numpy_lamb(  # noqa: ANN201
    d: int,
    segments,
    eta: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,  # noqa: ANN001
):
    s = {"m": np.zeros(d, F32), "v": np.zeros(d, F32), "t": 0}

    def step(delta: np.ndarray, params: np.ndarray) -> np.ndarray:
        s["t"] += 1
        t = s["t"]
        s["m"] = b1 * s["m"] + (1 - b1) * delta
        s["v"] = b2 * s["v"] + (1 - b2) * delta * delta
        r = (s["m"] / (1 - b1**t)) / (np.sqrt(s["v"] / (1 - b2**t)) + eps)
        for a, b in segments:
            wn, rn = np.linalg.norm(params[a:b]), np.linalg.norm(r[a:b])
            r[a:b] *= eta * (wn / rn if wn > 0 and rn > 0 else 1.0)
        return r

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dim", type=int, default=D)
    args = parser.parse_args()
    d = args.dim

    rng = np.random.default_rng(0)
    delta = rng.standard_normal(d, dtype=F32) * F32(1e-2)
    params = rng.standard_normal(d, dtype=F32)
    src, dst = np.ones(d, F32), np.empty(d, F32)
    copy = lambda: np.copyto(dst, src)  # noqa: E731
    n_seg = 62  # ~ResNet-18's tensors
    segments = segments_from_sizes([d // n_seg] * (n_seg - 1) + [d - (n_seg - 1) * (d // n_seg)])

    print(
        f"d = {d:,} float32 ({d * 4 / 2**20:.1f} MiB per vector), median of {args.repeats} repeats; "
        f"numpy {np.__version__}, {platform.machine()}, {os.cpu_count()} CPUs"
    )
    t_copy, t_copy_min, _ = paired(copy, copy, args.repeats)
    line = "{:<44}: {:7.1f} ms (min {:6.1f})   x copyto {:5.2f}"
    print(line.format("np.copyto of one d-vector (yardstick)", t_copy * 1e3, t_copy_min * 1e3, 1.0))

    cases = {
        "amsgrad (eps_mode=max)": (
            make_server_optimizer("amsgrad", eta=1.0, eps=1e-3, eps_mode="max"),
            numpy_amsgrad(d),
        ),
        "adam": (make_server_optimizer("adam", eta=0.1, eps=1e-3), numpy_adam(d)),
        "lamb (62 segments)": (
            make_server_optimizer("lamb", eta=0.01, segments=segments, eps=1e-8, beta_2=0.999, bias_correction=True),
            numpy_lamb(d, segments),
        ),
    }
    for label, (opt, reference) in cases.items():
        print(f"{label}:")
        for what, fn in (
            ("transform, into=spare", transform_step(opt, delta, params, spare=True)),
            ("transform, fresh state each round", transform_step(opt, delta, params, spare=False)),
            ("numpy one-liners (same math)", lambda reference=reference: reference(delta, params)),
        ):
            t, t_min, r = paired(fn, copy, args.repeats)
            print(line.format(f"    {what}", t * 1e3, t_min * 1e3, r))
    print(f"(the fastest copy moved {2 * d * 4 / t_copy_min / 1e9:.1f} GB/s: d floats read + written)")


if __name__ == "__main__":
    main()
