#!/usr/bin/env python3
"""Compare two pollen runs' final models (e.g. the same round on CPU and on CUDA).

    python deploy/scripts/compare_final_models.py results/check-cpu results/check-cuda [--atol 1e-4] [--rtol 1e-3]

Each argument is a run directory (holding ``final_model.npz`` and ``metrics.json``) or an npz file.
Prints the largest absolute difference per tensor and the final accuracies; exits 1 when a tensor
differs by more than ``atol + rtol * |reference|`` anywhere, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def _npz(path: Path) -> Path:
    return path / "final_model.npz" if path.is_dir() else path


def _accuracy(path: Path) -> float | None:
    metrics = (path if path.is_dir() else path.parent) / "metrics.json"
    if not metrics.exists():
        return None
    return json.loads(metrics.read_text()).get("summary", {}).get("final_accuracy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=Path)
    parser.add_argument("candidate", type=Path)
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--rtol", type=float, default=1e-3)
    args = parser.parse_args(argv)

    with np.load(_npz(args.reference)) as ref, np.load(_npz(args.candidate)) as cand:
        if sorted(ref.files) != sorted(cand.files):
            print(f"different tensors: {sorted(set(ref.files) ^ set(cand.files))}")
            return 1
        ok = True
        for name in ref.files:
            a, b = ref[name].astype(np.float64), cand[name].astype(np.float64)
            if a.shape != b.shape:
                print(f"{name}: shape {a.shape} vs {b.shape}")
                ok = False
                continue
            diff = np.abs(a - b)
            within = bool(np.all(diff <= args.atol + args.rtol * np.abs(a)))
            ok &= within
            print(f"{name:<40} max |diff| {diff.max() if diff.size else 0.0:.3e}  {'ok' if within else 'DIFFERS'}")
    print(f"final accuracy: {_accuracy(args.reference)} vs {_accuracy(args.candidate)}")
    print("match within tolerance" if ok else "models differ beyond tolerance")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
