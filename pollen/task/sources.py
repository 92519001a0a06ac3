"""Where the images come from: a user's directory, the machine, the Hugging Face hub, or the package.

A source yields one :class:`RawData`: the train and test splits as ``uint8`` numpy arrays in their
original order (``(N, H, W)`` for grey images, ``(N, H, W, C)`` for colour) plus one line saying where
they came from. Sources are tried in this order and the first that holds the dataset wins:

1. ``data-dir``, a directory the user names. It must hold the dataset (IDX files for (Fashion-)MNIST,
   the CIFAR binary or python versions, parquet files, or a ``DatasetDict`` written with
   ``save_to_disk``), directly or in a subdirectory named after the dataset. A directory that does not
   is an error; there is no silent fallback.
2. A copy installed on the machine (Debian's ``dataset-fashion-mnist`` puts the IDX files under
   ``/usr/share/datasets/fashion-mnist``).
3. The Hugging Face cache and hub, through ``flwr_datasets.FederatedDataset``. The hub is probed with a
   short timeout first; when it cannot be reached (or ``HF_HUB_OFFLINE`` is set) only the local cache
   is consulted, so an offline machine fails in well under a second instead of hanging on retries.
4. Fashion-MNIST only: the 12,000/2,000 image subset shipped in ``pollen/task/embedded``.

Nothing here imports Flower's app machinery; ``datasets`` and ``flwr_datasets`` are imported lazily
because they cost about a second at import time.

A run-config can point ``data-dir`` at any directory, so nothing read from it may run code. The CIFAR
*binary* version (fixed-size records, no pickle) is preferred wherever it is found. The CIFAR *python*
version is read with :class:`CifarUnpickler`, which builds only dicts, lists, bytes, numbers and plain
numpy arrays (every other global is refused before anything is called), and the result is then checked
key by key (:func:`read_cifar_pickle`).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.resources
import io
import logging
import os
import pickle
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pollen.core.files import NpzError, read_npz

log = logging.getLogger(__name__)

__all__ = [
    "CifarUnpickler",
    "DataSourceError",
    "DatasetInfo",
    "DatasetSpec",
    "EMBEDDED_FASHION_MNIST",
    "HUB_TIMEOUT_S",
    "RawData",
    "SPECS",
    "SYSTEM_DIRS",
    "find_in_dir",
    "load_raw",
    "read_cifar_binary",
    "read_cifar_pickle",
    "read_idx",
    "source_fingerprint",
]

#: Seconds to wait for the Hugging Face hub before treating it as unreachable.
HUB_TIMEOUT_S = 5.0

#: Machine-wide installed copies, per dataset (module-level so tests and users can point elsewhere).
SYSTEM_DIRS: dict[str, tuple[str, ...]] = {
    "fashion-mnist": ("/usr/share/datasets/fashion-mnist",),
    "mnist": ("/usr/share/datasets/mnist",),
    "cifar10": (),
    "cifar100": (),
}

#: The subset of Fashion-MNIST that ships with the package (see ``tools/make_embedded_subset.py``).
EMBEDDED_FASHION_MNIST = "fashion_mnist_subset.npz"


class DataSourceError(ValueError):
    """No source holds the dataset, or a named source holds something unusable. One-line message."""


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about the inputs and outputs."""

    num_channels: int
    image_size: int
    num_classes: int


@dataclass(frozen=True)
class DatasetSpec:
    """Everything the loaders know about one dataset."""

    name: str
    info: DatasetInfo
    hub_id: str
    image_columns: tuple[str, ...]
    label_columns: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    idx_format: bool  # ships as IDX files (the (Fashion-)MNIST originals)
    pickle_dir: str  # name of the CIFAR python-pickle directory ("" if none)
    subdirs: tuple[str, ...]  # subdirectory names of data-dir that may hold this dataset
    hflip: bool  # horizontal flips are label-preserving (not for digits)
    binary_dir: str = ""  # name of the CIFAR binary-version directory ("" if none)


SPECS: dict[str, DatasetSpec] = {
    "fashion-mnist": DatasetSpec(
        name="fashion-mnist",
        info=DatasetInfo(1, 28, 10),
        hub_id="zalando-datasets/fashion_mnist",
        image_columns=("image", "img"),
        label_columns=("label",),
        mean=(0.2860,),
        std=(0.3530,),
        idx_format=True,
        pickle_dir="",
        subdirs=("fashion-mnist", "fashion_mnist", "fmnist", "FashionMNIST", "FashionMNIST/raw", "raw", "data"),
        hflip=True,
    ),
    "mnist": DatasetSpec(
        name="mnist",
        info=DatasetInfo(1, 28, 10),
        hub_id="ylecun/mnist",
        image_columns=("image", "img"),
        label_columns=("label",),
        mean=(0.1307,),
        std=(0.3081,),
        idx_format=True,
        pickle_dir="",
        subdirs=("mnist", "MNIST", "MNIST/raw", "raw", "data"),
        hflip=False,
    ),
    "cifar10": DatasetSpec(
        name="cifar10",
        info=DatasetInfo(3, 32, 10),
        hub_id="uoft-cs/cifar10",
        image_columns=("img", "image"),
        label_columns=("label",),
        # The FedCAMS code's constants (papers/fedcams.md, "Preprocessing").
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2023, 0.1994, 0.2010),
        idx_format=False,
        pickle_dir="cifar-10-batches-py",
        subdirs=("cifar10", "cifar-10", "CIFAR10", "plain_text", "data"),
        hflip=True,
        binary_dir="cifar-10-batches-bin",
    ),
    "cifar100": DatasetSpec(
        name="cifar100",
        info=DatasetInfo(3, 32, 100),
        hub_id="uoft-cs/cifar100",
        image_columns=("img", "image"),
        label_columns=("fine_label",),
        mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2762),
        idx_format=False,
        pickle_dir="cifar-100-python",
        subdirs=("cifar100", "cifar-100", "CIFAR100", "data"),
        hflip=True,
        binary_dir="cifar-100-binary",
    ),
}


@dataclass(frozen=True)
class RawData:
    """Both splits of one dataset as uint8 arrays, and where they came from."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str


# --------------------------------------------------------------------------- IDX files


_IDX_FILES = {
    "x_train": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "y_train": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "x_test": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "y_test": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read one IDX file (``.gz`` or uncompressed) of unsigned bytes into an array of its shape."""
    path = Path(path)
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as err:
        raise DataSourceError(f"cannot read IDX file {path}: {err}") from err
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataSourceError(f"{path} is not an IDX file (bad magic number {data[:4].hex()})")
    type_code, ndim = data[2], data[3]
    if type_code != 0x08:
        raise DataSourceError(f"{path}: IDX element type 0x{type_code:02x} is not unsigned byte (0x08)")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataSourceError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    payload = np.frombuffer(data, dtype=np.uint8, offset=header)
    if payload.size != int(np.prod(dims)):
        raise DataSourceError(f"{path}: IDX header says shape {dims} but holds {payload.size} bytes")
    return payload.reshape(dims)


def _idx_files(d: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for key, stems in _IDX_FILES.items():
        for stem in stems:
            for suffix in (".gz", ""):
                if (d / (stem + suffix)).is_file():
                    found.setdefault(key, d / (stem + suffix))
    return found


def _load_idx(files: dict[str, Path]) -> dict[str, np.ndarray]:
    return {key: read_idx(p) for key, p in files.items()}


# --------------------------------------------------------------------------- CIFAR (binary and python versions)


_CIFAR_PIXELS = 3 * 32 * 32  # one row: 1024 red, 1024 green, 1024 blue bytes
_CIFAR100_COARSE = 20  # CIFAR-100's superclasses (``coarse_labels``, the first label byte)


def _cifar_names(spec: DatasetSpec) -> tuple[list[str], list[str]]:
    if spec.name == "cifar10":
        return [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]
    return ["train"], ["test"]


def _cifar_files(spec: DatasetSpec, d: Path, suffix: str) -> dict[str, list[Path]] | None:
    train, test = _cifar_names(spec)
    files = {"train": [d / (n + suffix) for n in train], "test": [d / (n + suffix) for n in test]}
    if all(p.is_file() for paths in files.values() for p in paths):
        return files
    return None


def _binary_files(spec: DatasetSpec, d: Path) -> dict[str, list[Path]] | None:
    return _cifar_files(spec, d, ".bin") if spec.binary_dir else None


def _pickle_files(spec: DatasetSpec, d: Path) -> dict[str, list[Path]] | None:
    return _cifar_files(spec, d, "") if spec.pickle_dir else None


def read_cifar_binary(path: str | os.PathLike[str], dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch of the CIFAR binary version: ``(rows (N, 3072) uint8, labels (N,) int64)``.

    CIFAR-10 records are 1 label byte + 3072 pixel bytes; CIFAR-100 records are a coarse and a fine
    label byte + 3072 pixel bytes (the fine label is returned).
    """
    path = Path(path)
    num_classes = SPECS[dataset].info.num_classes
    label_bytes = 2 if dataset == "cifar100" else 1
    record = label_bytes + _CIFAR_PIXELS
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataSourceError(f"cannot read CIFAR binary batch {path}: {err}") from err
    if not data or len(data) % record:
        raise DataSourceError(
            f"CIFAR binary batch {path}: {len(data)} bytes is not a whole number of {record}-byte {dataset} "
            f"records ({label_bytes} label byte(s) + {_CIFAR_PIXELS} pixel bytes)"
        )
    rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, record)
    checks = [(label_bytes - 1, num_classes, "label")]
    if label_bytes == 2:
        checks.append((0, _CIFAR100_COARSE, "coarse label"))
    for col, limit, what in checks:
        bad = np.flatnonzero(rows[:, col] >= limit)
        if len(bad):
            raise DataSourceError(
                f"CIFAR binary batch {path}: record {bad[0]} has {what} {rows[bad[0], col]}, allowed 0..{limit - 1}"
            )
    return np.ascontiguousarray(rows[:, label_bytes:]), rows[:, label_bytes - 1].astype(np.int64)


def _numpy_reconstruct() -> Any:
    try:
        from numpy._core.multiarray import _reconstruct  # noqa: PLC0415 - numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct  # noqa: PLC0415
    return _reconstruct


_RECONSTRUCT = _numpy_reconstruct()


class _NdarrayName:
    """What ``numpy.ndarray`` unpickles to: a name ``_reconstruct`` accepts, nothing that can be called."""

    def __repr__(self) -> str:
        return "numpy.ndarray"


_NDARRAY = _NdarrayName()
_PLAIN_DTYPE = re.compile(r"[<>|=]?(?:[iu][1248]|b1)")


def _safe_reconstruct(subtype: object, shape: object, typecode: object) -> np.ndarray:
    # numpy pickles every array as _reconstruct(ndarray, (0,), b"b") followed by __setstate__.
    if subtype is not _NDARRAY or shape != (0,) or typecode not in (b"b", "b"):
        raise pickle.UnpicklingError(f"unexpected array constructor arguments ({subtype!r}, {shape!r}, {typecode!r})")
    return _RECONSTRUCT(np.ndarray, (0,), b"b")


def _safe_dtype(obj: object, align: object = False, copy: object = False) -> np.dtype:
    name = obj.decode("ascii", "replace") if isinstance(obj, bytes) else obj
    if not isinstance(name, str) or not _PLAIN_DTYPE.fullmatch(name):
        raise pickle.UnpicklingError(f"refuses array dtype {obj!r} (only plain integer dtypes)")
    return np.dtype(name, align=bool(align), copy=bool(copy))


def _latin1_bytes(obj: object, encoding: object = "latin1") -> bytes:
    # How Python 3 writes ``bytes`` at protocol 2: _codecs.encode(str, "latin1").
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"unexpected _codecs.encode arguments ({type(obj).__name__}, {encoding!r})")
    return obj.encode("latin-1")


def _empty_bytes(*args: object) -> bytes:
    # How Python 3 writes b"" at protocol 2: a call of bytes() without arguments.
    if args:
        raise pickle.UnpicklingError("unexpected bytes() arguments")
    return b""


class CifarUnpickler(pickle.Unpickler):
    """Unpickler for the CIFAR python version: refuses every global a CIFAR batch does not need.

    Python 2's cPickle wrote those files (protocol 2): a dict of byte-string keys to lists of ints,
    lists of byte strings and ``uint8`` numpy arrays. Arrays need ``numpy.core.multiarray._reconstruct``
    (``numpy._core`` when written by numpy 2), ``numpy.ndarray`` and ``numpy.dtype``; a Python 3
    protocol-2 pickle of bytes also needs ``_codecs.encode`` (and ``bytes`` for ``b""``). Each of these resolves to a
    guarded stand-in that accepts only the arguments numpy and pickle themselves write (no object arrays);
    every other global raises ``UnpicklingError`` before anything is called. Persistent ids are refused
    by ``pickle.Unpickler`` itself.
    """

    _ALLOWED: ClassVar[dict[tuple[str, str], Any]] = {
        ("numpy.core.multiarray", "_reconstruct"): _safe_reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _safe_reconstruct,
        ("numpy", "ndarray"): _NDARRAY,
        ("numpy", "dtype"): _safe_dtype,
        ("_codecs", "encode"): _latin1_bytes,
        ("__builtin__", "bytes"): _empty_bytes,
        ("builtins", "bytes"): _empty_bytes,
    }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refuses global {module}.{name} (a CIFAR batch holds only numpy arrays, lists, bytes and ints)"
            ) from None


def _cifar_keys(dataset: str) -> tuple[bytes, frozenset[bytes]]:
    if dataset == "cifar100":
        return b"fine_labels", frozenset({b"data", b"fine_labels", b"coarse_labels", b"filenames", b"batch_label"})
    return b"labels", frozenset({b"data", b"labels", b"filenames", b"batch_label"})


def _int_labels(value: object, n: int, limit: int, what: str) -> np.ndarray:
    """``value`` (list of ints or 1-D integer array) as int64; ``ValueError`` saying what is wrong."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu" or value.dtype.fields is not None or value.ndim != 1:
            raise ValueError(
                f"{what} is an array of dtype {value.dtype} and shape {value.shape}, not a 1-D integer array"
            )
        y = value.astype(np.int64)
    elif isinstance(value, list):
        if not all(type(v) is int for v in value):
            bad = next(v for v in value if type(v) is not int)
            raise ValueError(f"{what} holds a {type(bad).__name__}, not only ints")
        if any(not 0 <= v < limit for v in value):
            bad = next(v for v in value if not 0 <= v < limit)
            raise ValueError(f"{what} holds {bad}, allowed 0..{limit - 1}")
        y = np.asarray(value, dtype=np.int64)
    else:
        raise ValueError(f"{what} is a {type(value).__name__}, not a list of ints")
    if len(y) != n:
        raise ValueError(f"{what} has {len(y)} entries for {n} images")
    if len(y) and (y.min() < 0 or y.max() >= limit):
        raise ValueError(f"{what} span {y.min()}..{y.max()}, allowed 0..{limit - 1}")
    return y


def _check_cifar_batch(batch: object, dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """The images and labels of one unpickled batch; ``ValueError`` (one line) if it is not one."""
    label_key, allowed = _cifar_keys(dataset)
    if not isinstance(batch, dict):
        raise ValueError(f"holds a {type(batch).__name__}, not a dict")
    if not all(isinstance(k, (bytes, str)) for k in batch):
        raise ValueError("has keys that are not strings")
    batch = {(k.encode("utf-8") if isinstance(k, str) else k): v for k, v in batch.items()}
    unexpected = sorted(set(batch) - allowed)
    if unexpected:
        raise ValueError(f"has unexpected key(s) {unexpected}; a {dataset} batch has only {sorted(allowed)}")
    missing = sorted({b"data", label_key} - set(batch))
    if missing:
        raise ValueError(f"lacks key(s) {missing}")
    x = batch[b"data"]
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != _CIFAR_PIXELS:
        what = (
            f"an array of dtype {x.dtype} and shape {x.shape}" if isinstance(x, np.ndarray) else f"a {type(x).__name__}"
        )
        raise ValueError(f"b'data' is {what}, not a uint8 array of shape (N, {_CIFAR_PIXELS})")
    n = len(x)
    y = _int_labels(batch[label_key], n, SPECS[dataset].info.num_classes, repr(label_key))
    if b"coarse_labels" in batch:
        _int_labels(batch[b"coarse_labels"], n, _CIFAR100_COARSE, "b'coarse_labels'")
    names = batch.get(b"filenames", [])
    if not isinstance(names, list) or not all(isinstance(v, (bytes, str)) for v in names):
        raise ValueError("b'filenames' is not a list of strings")
    if b"filenames" in batch and len(names) != n:
        raise ValueError(f"b'filenames' has {len(names)} entries for {n} images")
    if not isinstance(batch.get(b"batch_label", b""), (bytes, str)):
        raise ValueError("b'batch_label' is not a string")
    return np.ascontiguousarray(x), y


def read_cifar_pickle(path: str | os.PathLike[str], dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch of the CIFAR python version, safely: ``(rows (N, 3072) uint8, labels (N,) int64)``.

    Read with :class:`CifarUnpickler` (nothing but numpy arrays, lists, bytes and ints can be built),
    then checked: a dict with only the CIFAR keys, ``uint8`` data of shape ``(N, 3072)``, ``N`` labels
    in range. Anything else raises :class:`DataSourceError` naming the file and what is wrong.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise DataSourceError(f"cannot read CIFAR batch {path}: {err}") from err
    try:
        batch = CifarUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as err:  # noqa: BLE001 - any failure means "not a CIFAR batch"
        raise DataSourceError(f"refused CIFAR batch {path}: {_one_line(err, 240)}") from err
    try:
        return _check_cifar_batch(batch, dataset)
    except ValueError as err:
        raise DataSourceError(f"refused CIFAR batch {path}: {' '.join(str(err).split())}") from err


def _load_cifar(spec: DatasetSpec, files: dict[str, list[Path]], reader: Any) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for split, paths in files.items():
        xs, ys = zip(*(reader(p, spec.name) for p in paths))
        x = np.concatenate(xs).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        out[f"x_{split}"] = np.ascontiguousarray(x)
        out[f"y_{split}"] = np.concatenate(ys)
    return out


# --------------------------------------------------------------------------- parquet / save_to_disk


def _parquet_files(d: Path) -> dict[str, list[Path]] | None:
    found = {}
    for split in ("train", "test"):
        files = sorted(d.glob(f"{split}.parquet")) + sorted(d.glob(f"{split}-*.parquet"))
        if not files:
            return None
        found[split] = files
    return found


def _is_saved_dataset_dict(d: Path) -> bool:
    return (d / "dataset_dict.json").is_file() or all(
        (d / split / "dataset_info.json").is_file() for split in ("train", "test")
    )


def _hf_arrays(ds: Any, spec: DatasetSpec, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of a Hugging Face ``Dataset`` as uint8 / int64 arrays."""
    import datasets  # noqa: PLC0415 - lazy, heavy

    cols = ds.column_names
    img_col = next((c for c in spec.image_columns if c in cols), None)
    lab_col = next((c for c in spec.label_columns if c in cols), None)
    if img_col is None or lab_col is None:
        raise DataSourceError(
            f"{where}: columns {cols} lack an image column ({'/'.join(spec.image_columns)}) "
            f"or a label column ({'/'.join(spec.label_columns)}) for {spec.name}"
        )
    feature = ds.features[img_col]
    if isinstance(feature, dict) and "bytes" in feature:  # encoded images without HF metadata
        ds = ds.cast_column(img_col, datasets.Image())
    x = ds.with_format("numpy", columns=[img_col])[:][img_col]
    y = ds.with_format("numpy", columns=[lab_col])[:][lab_col]
    if x.dtype == object:  # images of different shapes or modes
        raise DataSourceError(f"{where}: images in column '{img_col}' do not share one shape")
    return np.asarray(x, dtype=np.uint8), np.asarray(y, dtype=np.int64)


def _load_parquet(spec: DatasetSpec, files: dict[str, list[Path]]) -> dict[str, np.ndarray]:
    import datasets  # noqa: PLC0415
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    out: dict[str, np.ndarray] = {}
    for split, paths in files.items():
        try:
            table = pa.concat_tables([pq.read_table(p) for p in paths])
        except Exception as err:  # noqa: BLE001
            raise DataSourceError(f"cannot read parquet file(s) {paths[0]}: {err}") from err
        # An in-memory Dataset: features come from the files' Hugging Face metadata; no cache written.
        x, y = _hf_arrays(datasets.Dataset(table), spec, f"{paths[0].parent}/{split}*.parquet")
        out[f"x_{split}"], out[f"y_{split}"] = x, y
    return out


def _load_saved(spec: DatasetSpec, d: Path) -> dict[str, np.ndarray]:
    import datasets  # noqa: PLC0415

    try:
        dd = datasets.load_from_disk(str(d), keep_in_memory=True)
    except Exception as err:  # noqa: BLE001
        raise DataSourceError(f"cannot load the saved dataset in {d}: {type(err).__name__}: {err}") from err
    if not isinstance(dd, datasets.DatasetDict) or not {"train", "test"} <= set(dd):
        raise DataSourceError(f"{d}: a save_to_disk copy must be a DatasetDict with 'train' and 'test' splits")
    out: dict[str, np.ndarray] = {}
    for split in ("train", "test"):
        out[f"x_{split}"], out[f"y_{split}"] = _hf_arrays(dd[split], spec, f"{d}/{split}")
    return out


# --------------------------------------------------------------------------- directories


def expected_files(spec: DatasetSpec) -> str:
    """One phrase listing the on-disk layouts a directory may use for ``spec``."""
    forms = []
    if spec.idx_format:
        forms.append(
            "the IDX files train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
            "t10k-labels-idx1-ubyte (each optionally .gz)"
        )
    if spec.binary_dir:
        names = "data_batch_1..5.bin and test_batch.bin" if spec.name == "cifar10" else "train.bin and test.bin"
        forms.append(f"the binary batches {names} (as in {spec.binary_dir}/)")
    if spec.pickle_dir:
        names = "data_batch_1..5 and test_batch" if spec.name == "cifar10" else "train and test"
        forms.append(f"the python batches {names} (as in {spec.pickle_dir}/)")
    forms.append("parquet files train.parquet and test.parquet (or train-*.parquet and test-*.parquet)")
    forms.append("a DatasetDict with train and test splits written by datasets' save_to_disk")
    where = ", ".join(spec.subdirs)
    return "; or ".join(forms) + f" (in the directory itself or a subdirectory {where})"


def _candidate_dirs(spec: DatasetSpec, root: Path) -> list[Path]:
    dirs = [root] + [root / s for s in spec.subdirs]
    for named in (spec.binary_dir, spec.pickle_dir):
        if named:
            dirs += [root / named] + [root / s / named for s in spec.subdirs]
    return [d for d in dirs if d.is_dir()]


def find_in_dir(spec: DatasetSpec, root: str | os.PathLike[str]) -> tuple[str, Path, Any] | None:
    """Which layout of ``spec`` ``root`` holds, without reading any data; ``None`` if none.

    The CIFAR binary version (no unpickling at all) wins wherever under ``root`` it is found.
    """
    dirs = _candidate_dirs(spec, Path(root))
    for d in dirs:
        binary = _binary_files(spec, d)
        if binary:
            return "CIFAR binary batches", d, binary
    for d in dirs:
        if spec.idx_format:
            files = _idx_files(d)
            if len(files) == 4:
                return "IDX files", d, files
        pickles = _pickle_files(spec, d)
        if pickles:
            return "CIFAR python batches", d, pickles
        parquet = _parquet_files(d)
        if parquet:
            return "parquet files", d, parquet
        if _is_saved_dataset_dict(d):
            return "save_to_disk DatasetDict", d, d
    return None


def _check(spec: DatasetSpec, arrays: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    info = spec.info
    shape = (info.image_size, info.image_size) + ((info.num_channels,) if info.num_channels > 1 else ())
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim == 4 and x.shape[-1] == 1 and info.num_channels == 1:
            x = arrays[f"x_{split}"] = x[..., 0]
        if x.shape[1:] != shape:
            raise DataSourceError(f"{where}: {split} images have shape {x.shape[1:]}, {spec.name} needs {shape}")
        if y.ndim != 1 or len(y) != len(x):
            raise DataSourceError(f"{where}: {len(x)} {split} images but labels of shape {y.shape}")
        if len(y) and (y.min() < 0 or y.max() >= info.num_classes):
            raise DataSourceError(
                f"{where}: {split} labels span {y.min()}..{y.max()}, {spec.name} has {info.num_classes} classes"
            )
        arrays[f"y_{split}"] = y.astype(np.int64, copy=False)
    return arrays


def _load_found(spec: DatasetSpec, found: tuple[str, Path, Any]) -> dict[str, np.ndarray]:
    kind, d, files = found
    if kind == "IDX files":
        arrays = _load_idx(files)
    elif kind == "CIFAR binary batches":
        arrays = _load_cifar(spec, files, read_cifar_binary)
    elif kind == "CIFAR python batches":
        arrays = _load_cifar(spec, files, read_cifar_pickle)
    elif kind == "parquet files":
        arrays = _load_parquet(spec, files)
    else:
        arrays = _load_saved(spec, d)
    return _check(spec, arrays, str(d))


def _raw(arrays: dict[str, np.ndarray], source: str) -> RawData:
    return RawData(arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"], source)


# --------------------------------------------------------------------------- hub and cache


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


@contextlib.contextmanager
def _offline(enabled: bool) -> Iterator[None]:
    """Force ``datasets``/``huggingface_hub`` into offline (cache-only) mode for the block."""
    if not enabled:
        yield
        return
    import datasets.config as dconf  # noqa: PLC0415
    import huggingface_hub.constants as hconst  # noqa: PLC0415

    saved = (hconst.HF_HUB_OFFLINE, dconf.HF_HUB_OFFLINE, dconf.HF_DATASETS_OFFLINE)
    hconst.HF_HUB_OFFLINE = dconf.HF_HUB_OFFLINE = dconf.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        hconst.HF_HUB_OFFLINE, dconf.HF_HUB_OFFLINE, dconf.HF_DATASETS_OFFLINE = saved


def _one_line(err: BaseException, limit: int = 160) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _load_hub(spec: DatasetSpec) -> tuple[RawData | None, str]:
    """The dataset through ``FederatedDataset`` (hub, else local cache); or ``None`` and why not."""
    offline = _env_true("HF_HUB_OFFLINE") or _env_true("HF_DATASETS_OFFLINE")
    why = "HF_HUB_OFFLINE is set" if offline else ""
    if not offline:
        try:
            from huggingface_hub import HfApi  # noqa: PLC0415

            HfApi().dataset_info(spec.hub_id, timeout=HUB_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - any failure: treat the hub as unreachable
            offline, why = True, f"hub unreachable ({_one_line(err, 100)})"
    try:
        from flwr_datasets import FederatedDataset  # noqa: PLC0415

        with _offline(offline):
            # Partitioning happens later on the labels (same partitioners for every source), so
            # the FederatedDataset only fetches the splits; shuffle=False keeps the original order.
            fds = FederatedDataset(dataset=spec.hub_id, partitioners={"train": 1}, shuffle=False)
            arrays = {}
            for split in ("train", "test"):
                where = f"Hugging Face {spec.hub_id} [{split}]"
                arrays[f"x_{split}"], arrays[f"y_{split}"] = _hf_arrays(fds.load_split(split), spec, where)
    except DataSourceError:
        raise
    except Exception as err:  # noqa: BLE001
        reason = f"{why}; not in the local cache" if offline else _one_line(err, 120)
        return None, f"Hugging Face {spec.hub_id} ({reason})"
    origin = "Hugging Face cache" if offline else "Hugging Face hub"
    return _raw(_check(spec, arrays, spec.hub_id), f"{origin} {spec.hub_id} via flwr-datasets"), ""


# --------------------------------------------------------------------------- embedded subset


def _embedded_path() -> Path | None:
    """The shipped subset: beside this module, or in another copy of pollen on ``sys.path``.

    ``flwr run`` executes the app from a FAB, which carries only source files, so the
    copy of pollen that runs may lack the npz while the installed package has it.
    """
    import sys

    ref = importlib.resources.files("pollen.task") / "embedded" / EMBEDDED_FASHION_MNIST
    if ref.is_file():
        return Path(str(ref))
    for entry in sys.path:
        candidate = Path(entry or ".") / "pollen" / "task" / "embedded" / EMBEDDED_FASHION_MNIST
        if candidate.is_file():
            return candidate
    return None


#: The shipped subset inflates to about 11 MB; anything claiming far more is not it.
_EMBEDDED_MAX_BYTES = 256 * 2**20


def _load_embedded() -> RawData:
    path = _embedded_path()
    if path is None:
        raise DataSourceError(f"embedded {EMBEDDED_FASHION_MNIST} not found beside pollen or on sys.path")
    try:  # the shipped file is deflated (np.savez_compressed's format); read_npz bounds what it inflates to
        members = read_npz(path, allow_compressed=True, max_bytes=_EMBEDDED_MAX_BYTES)
    except NpzError as err:
        raise DataSourceError(f"embedded {EMBEDDED_FASHION_MNIST} at {path} is unusable: it {err.why}") from err
    missing = sorted({"x_train", "y_train", "x_test", "y_test"} - set(members))
    if missing:
        raise DataSourceError(f"embedded {EMBEDDED_FASHION_MNIST} at {path} is unusable: it has no {missing}")
    arrays = {k: members[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    arrays = _check(SPECS["fashion-mnist"], arrays, f"embedded {EMBEDDED_FASHION_MNIST}")
    n_tr, n_te = len(arrays["y_train"]), len(arrays["y_test"])
    return _raw(arrays, f"embedded Fashion-MNIST subset ({n_tr:,} train / {n_te:,} test images, pollen/task/embedded)")


#: Datasets this process has said it uses the embedded subset of (the warning is said once per process).
_SAID_EMBEDDED: set[str] = set()


def _embedded_available() -> bool:
    return _embedded_path() is not None


# --------------------------------------------------------------------------- resolution


def _found_paths(found: tuple[str, Path, Any]) -> list[Path]:
    kind, d, files = found
    if kind == "save_to_disk DatasetDict":
        return sorted(p for p in d.rglob("*") if p.is_file())
    out: list[Path] = []
    for value in files.values():
        out.extend(value if isinstance(value, list) else [value])
    return out


def source_fingerprint(name: str, data_dir: str = "") -> str | None:
    """A string that changes whenever what ``load_raw(name, data_dir)`` returns may change; no data read.

    It names the layout and every file :func:`load_raw` would read, with its resolved path, size and
    modification time. ``None`` when the source cannot be known without loading it (the Hugging Face
    hub or its cache, the embedded subset) or when no local source holds the dataset.
    """
    spec = SPECS[name]
    found = None
    if data_dir:
        root = Path(data_dir).expanduser()
        found = find_in_dir(spec, root) if root.is_dir() else None
    else:
        for sysdir in SYSTEM_DIRS.get(name, ()):
            found = find_in_dir(spec, sysdir) if Path(sysdir).is_dir() else None
            if found is not None:
                break
    if found is None:
        return None
    parts = [found[0]]
    try:
        for p in _found_paths(found):
            st = p.stat()
            parts.append(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    except OSError:
        return None
    return "|".join(parts)


def load_raw(name: str, data_dir: str = "") -> RawData:
    """Both splits of dataset ``name`` from the first source that holds it (see the module doc).

    Raises :class:`DataSourceError` (one line) when ``data_dir`` is set but does not hold the dataset,
    or when no source does.
    """
    spec = SPECS[name]
    if data_dir:
        root = Path(data_dir).expanduser()
        if not root.is_dir():
            raise DataSourceError(
                f"data-dir={data_dir!r} is not a directory; it should hold {name}: {expected_files(spec)}"
            )
        found = find_in_dir(spec, root)
        if found is None:
            raise DataSourceError(f"data-dir={data_dir!r} does not hold {name}: expected {expected_files(spec)}")
        return _raw(_load_found(spec, found), f"data-dir {found[1]} ({found[0]})")

    tried: list[str] = ["data-dir (not set)"]
    for sysdir in SYSTEM_DIRS.get(name, ()):
        found = find_in_dir(spec, sysdir) if Path(sysdir).is_dir() else None
        if found is not None:
            return _raw(_load_found(spec, found), f"installed copy {found[1]} ({found[0]})")
        tried.append(f"{sysdir} (absent)")

    raw, why_not = _load_hub(spec)
    if raw is not None:
        return raw
    tried.append(why_not)

    if name == "fashion-mnist" and _embedded_available():
        raw = _load_embedded()
        if name not in _SAID_EMBEDDED:  # once per process: a ClientApp loads the data for every message
            _SAID_EMBEDDED.add(name)
            hub = why_not.removeprefix(f"Hugging Face {spec.hub_id} (").removesuffix(")").removeprefix("hub ")
            log.warning(
                "fashion-mnist: pollen's %s/%s-image subset (no data-dir, no installed copy; hub: %s); "
                "the full set: apt-get install dataset-fashion-mnist, or data-dir=<directory with the IDX files>",
                f"{len(raw.y_train):,}",
                f"{len(raw.y_test):,}",
                hub if len(hub) <= 60 else hub[:57] + "...",
            )
        return raw

    how = "set data-dir=<directory with "
    how += "its IDX files" if spec.idx_format else f"its {spec.binary_dir}/ or {spec.pickle_dir}/ batches"
    how += ", train/test parquet files or a save_to_disk copy>"
    if name in ("fashion-mnist", "mnist"):
        how = f"put the IDX files in {SYSTEM_DIRS[name][0]}, or " + how
    raise DataSourceError(
        f"no source holds dataset {name!r}; tried: {'; '.join(tried)}. To provide it, {how}, "
        "or make the Hugging Face hub reachable"
    )
