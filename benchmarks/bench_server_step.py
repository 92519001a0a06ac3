"""Cost of one server step at ResNet-18 size (d = 11,173,962 float32), relative to one np.copyto.

Times, as the median of a few repeats:
  (a) averaging 10 client replies + one FedAMS (amsgrad, Option 1) update,
  (b) the amsgrad update alone,
  (c) every other server optimiser's update alone,
each divided by the time of one ``np.copyto`` of a d-vector (a memory-bandwidth yardstick)
timed right before it (the printed ratio is the median of those paired ratios). Updates run as a
strategy runs them: the step into a reused vector, the new state into the spare state (double-buffered).

Run: ``python benchmarks/bench_server_step.py [--repeats 7]``; takes well under a minute.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

from pollen.optim import SERVER_OPTIMIZERS, make_server_optimizer, segments_from_sizes

D = 11_173_962  # ResNet-18 (CIFAR) trainable parameters, FedCAMS Table 2
N_REPLIES = 10


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired(fn, yardstick, repeats: int) -> tuple[float, float]:
    """Median time of ``fn`` and median of the ratios fn / yardstick, each pair timed back to back.

    Pairing keeps the ratio honest on a shared machine whose load drifts between repeats.
    """
    fn()
    yardstick()  # warm-up: first touch of freshly allocated pages
    times, ratios = [], []
    for _ in range(repeats):
        t_ref = timed(yardstick)
        t = timed(fn)
        times.append(t)
        ratios.append(t / t_ref)
    return statistics.median(times), statistics.median(ratios)


def stepper(opt, delta_of, params: np.ndarray | None = None):  # noqa: ANN001, ANN201
    """One server step per call, as ``AdaptiveStrategy.apply_server_step`` takes it: the step into one
    reused vector, the new state into the spare state (the one discarded a call before)."""
    held = {"state": opt.init(D), "spare": None}
    out = np.empty(D, dtype=np.float32)

    def run() -> None:
        _, new = opt.update(held["state"], delta_of(), params, into=held["spare"], out=out)
        held["spare"], held["state"] = held["state"], new

    return run


def mean_into(acc: np.ndarray, replies: list[np.ndarray], block: int | None = None) -> np.ndarray:
    """Unweighted mean of the replies, in place in ``acc`` (no temporaries).

    With ``block``, one block of ``acc`` at a time stays in cache while every reply is
    added into it: each reply is read once and ``acc`` written once.
    """
    n = acc.shape[0]
    step = block or n
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        a = acc[lo:hi]
        np.add(replies[0][lo:hi], replies[1][lo:hi], out=a)
        for r in replies[2:]:
            a += r[lo:hi]
        a *= 1.0 / len(replies)
    return acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    replies = [rng.standard_normal(D, dtype=np.float32) * np.float32(1e-2) for _ in range(N_REPLIES)]
    params = rng.standard_normal(D, dtype=np.float32)
    src, dst = replies[0], np.empty(D, dtype=np.float32)
    acc = np.empty(D, dtype=np.float32)

    print(
        f"d = {D:,} float32 ({D * 4 / 2**20:.1f} MiB per vector), {N_REPLIES} replies, "
        f"median of {args.repeats} repeats; numpy {np.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )

    copy = lambda: np.copyto(dst, src)  # noqa: E731
    t_copy, _ = paired(copy, copy, args.repeats)
    line = "{:<48}: {:8.2f} ms   ratio to copyto {:6.2f}"
    print(line.format("np.copyto of one d-vector (yardstick)", t_copy * 1e3, 1.0))

    block = 1 << 16
    t_mean, r_mean = paired(lambda: mean_into(acc, replies), copy, args.repeats)
    print(line.format(f"mean of {N_REPLIES} replies (whole-vector in place)", t_mean * 1e3, r_mean))
    t_mean, r_mean = paired(lambda: mean_into(acc, replies, block), copy, args.repeats)
    print(line.format(f"mean of {N_REPLIES} replies (blocked, {block} elements)", t_mean * 1e3, r_mean))

    opt = make_server_optimizer("amsgrad", eta=1.0, eps=1e-3, eps_mode="max")
    delta = mean_into(acc, replies).copy()
    t_a, r_a = paired(stepper(opt, lambda: mean_into(acc, replies)), copy, args.repeats)
    print(line.format(f"(a) mean of {N_REPLIES} replies + amsgrad update", t_a * 1e3, r_a))
    t_a, r_a = paired(stepper(opt, lambda: mean_into(acc, replies, block)), copy, args.repeats)
    print(line.format("(a) same, blocked mean", t_a * 1e3, r_a))
    t_b, r_b = paired(stepper(opt, lambda: delta), copy, args.repeats)
    print(line.format("(b) amsgrad update alone (FedAMS, Option 1)", t_b * 1e3, r_b))

    segments = segments_from_sizes([D // 62] * 61 + [D - 61 * (D // 62)])  # ~ResNet-18's 62 tensors
    configs = {
        "amsgrad eps_mode=add": ("amsgrad", dict(eps_mode="add")),
        "amsgrad bias_correction=True": ("amsgrad", dict(bias_correction=True)),
        **{name: (name, {}) for name in SERVER_OPTIMIZERS if name not in ("amsgrad", "lamb")},
        "sgd momentum=0.9": ("sgd", dict(momentum=0.9)),
        "adam bias_correction=True": ("adam", dict(bias_correction=True)),
        "lamb, 62 segments": ("lamb", dict(segments=segments)),
    }
    print("other optimisers, update alone:")
    for label, (name, kw) in configs.items():
        o = make_server_optimizer(name, **kw)
        t, r = paired(stepper(o, lambda: delta, params), copy, max(3, args.repeats // 2))
        print(line.format(f"    {label}", t * 1e3, r))


if __name__ == "__main__":
    main()
