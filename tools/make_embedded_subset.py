#!/usr/bin/env python3
"""Build ``pollen/task/embedded/fashion_mnist_subset.npz`` from the original Fashion-MNIST IDX files.

Takes a class-balanced random subset (default 1,200 training and 200 test images per class, i.e.
12,000 / 2,000) with a fixed seed and writes it in ``np.savez_compressed``'s format (a deflated zip
of ``.npy`` files), with fixed zip timestamps so the same inputs give byte-identical output.

Arrays: ``x_train`` (12000, 28, 28) uint8, ``y_train`` (12000,) uint8, ``x_test`` (2000, 28, 28) uint8,
``y_test`` (2000,) uint8, ``idx_train`` / ``idx_test`` (uint16: the rows taken from the original files,
in increasing order), and ``meta`` (a JSON string: source, files' SHA-256, seed, counts).

Usage::

    python tools/make_embedded_subset.py [--src /usr/share/datasets/fashion-mnist] [--out ...]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import struct
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SRC = Path("/usr/share/datasets/fashion-mnist")
DEFAULT_OUT = ROOT / "pollen" / "task" / "embedded" / "fashion_mnist_subset.npz"
FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}


def read_idx(data: bytes) -> np.ndarray:
    if data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise ValueError("not an unsigned-byte IDX file")
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def balanced_subset(labels: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
    picks = []
    for c in range(10):
        members = np.flatnonzero(labels == c)
        picks.append(rng.choice(members, size=per_class, replace=False))
    return np.sort(np.concatenate(picks))


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez_compressed`` layout, but with fixed timestamps (reproducible bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for key, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asanyarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue(), compresslevel=9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC, help="directory with the four IDX .gz files")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=2017)
    ap.add_argument("--train-per-class", type=int, default=1200)
    ap.add_argument("--test-per-class", type=int, default=200)
    args = ap.parse_args()

    raw, digests = {}, {}
    for key, name in FILES.items():
        blob = (args.src / name).read_bytes()
        digests[name] = hashlib.sha256(blob).hexdigest()
        raw[key] = read_idx(gzip.decompress(blob))

    rng = np.random.default_rng(args.seed)
    idx_train = balanced_subset(raw["y_train"], args.train_per_class, rng)
    idx_test = balanced_subset(raw["y_test"], args.test_per_class, rng)
    meta = {
        "source": "Fashion-MNIST (Xiao, Rasul, Vollgraf 2017; Zalando SE; MIT), Debian dataset-fashion-mnist",
        "source_files_sha256": digests,
        "seed": args.seed,
        "train_per_class": args.train_per_class,
        "test_per_class": args.test_per_class,
        "tool": "tools/make_embedded_subset.py",
    }
    arrays = {
        "x_train": raw["x_train"][idx_train],
        "y_train": raw["y_train"][idx_train],
        "x_test": raw["x_test"][idx_test],
        "y_test": raw["y_test"][idx_test],
        "idx_train": idx_train.astype(np.uint16),
        "idx_test": idx_test.astype(np.uint16),
        "meta": np.array(json.dumps(meta, sort_keys=True)),
    }
    write_npz(args.out, arrays)
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes, sha256 {digest})")
    print(
        f"train {arrays['x_train'].shape}, test {arrays['x_test'].shape}, per-class counts "
        f"{np.bincount(arrays['y_train']).tolist()} / {np.bincount(arrays['y_test']).tolist()}"
    )


if __name__ == "__main__":
    main()
