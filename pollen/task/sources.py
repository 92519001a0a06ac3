"""Where the images come from: a user's directory, the machine, the Hugging Face hub, or the package.

A source yields one :class:`RawData`: the train and test splits as ``uint8`` numpy arrays in their
original order (``(N, H, W)`` for grey images, ``(N, H, W, C)`` for colour) plus one line saying where
they came from. Sources are tried in this order and the first that holds the dataset wins:

1. ``data-dir``, a directory the user names. It must hold the dataset (IDX files for (Fashion-)MNIST,
   the CIFAR python pickles, parquet files, or a ``DatasetDict`` written with ``save_to_disk``),
   directly or in a subdirectory named after the dataset. A directory that does not is an error; there
   is no silent fallback.
2. A copy installed on the machine (Debian's ``dataset-fashion-mnist`` puts the IDX files under
   ``/usr/share/datasets/fashion-mnist``).
3. The Hugging Face cache and hub, through ``flwr_datasets.FederatedDataset``. The hub is probed with a
   short timeout first; when it cannot be reached (or ``HF_HUB_OFFLINE`` is set) only the local cache
   is consulted, so an offline machine fails in well under a second instead of hanging on retries.
4. Fashion-MNIST only: the 12,000/2,000 image subset shipped in ``pollen/task/embedded``.

Nothing here imports Flower's app machinery; ``datasets`` and ``flwr_datasets`` are imported lazily
because they cost about a second at import time.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.resources
import logging
import os
import pickle
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

__all__ = [
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
    "read_idx",
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


# --------------------------------------------------------------------------- CIFAR pickles


def _pickle_files(spec: DatasetSpec, d: Path) -> dict[str, list[Path]] | None:
    if not spec.pickle_dir:
        return None
    if spec.name == "cifar10":
        train = [d / f"data_batch_{i}" for i in range(1, 6)]
        test = [d / "test_batch"]
    else:
        train, test = [d / "train"], [d / "test"]
    if all(p.is_file() for p in train + test):
        return {"train": train, "test": test}
    return None


def _load_pickles(spec: DatasetSpec, files: dict[str, list[Path]]) -> dict[str, np.ndarray]:
    # The CIFAR distribution's own format; like torchvision, this unpickles files the user named.
    label_key = b"fine_labels" if spec.name == "cifar100" else b"labels"
    out: dict[str, np.ndarray] = {}
    for split, paths in files.items():
        xs, ys = [], []
        for p in paths:
            try:
                with open(p, "rb") as f:
                    batch = pickle.load(f, encoding="bytes")
                xs.append(np.asarray(batch[b"data"], dtype=np.uint8))
                ys.append(np.asarray(batch[label_key], dtype=np.int64))
            except Exception as err:  # noqa: BLE001 - any failure means "not a CIFAR batch"
                raise DataSourceError(f"cannot read CIFAR batch {p}: {type(err).__name__}: {err}") from err
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
    if spec.pickle_dir:
        names = "data_batch_1..5 and test_batch" if spec.name == "cifar10" else "train and test"
        forms.append(f"the python pickles {names} (as in {spec.pickle_dir}/)")
    forms.append("parquet files train.parquet and test.parquet (or train-*.parquet and test-*.parquet)")
    forms.append("a DatasetDict with train and test splits written by datasets' save_to_disk")
    where = ", ".join(spec.subdirs)
    return "; or ".join(forms) + f" (in the directory itself or a subdirectory {where})"


def _candidate_dirs(spec: DatasetSpec, root: Path) -> list[Path]:
    dirs = [root] + [root / s for s in spec.subdirs]
    if spec.pickle_dir:
        dirs += [root / spec.pickle_dir] + [root / s / spec.pickle_dir for s in spec.subdirs]
    return [d for d in dirs if d.is_dir()]


def find_in_dir(spec: DatasetSpec, root: str | os.PathLike[str]) -> tuple[str, Path, Any] | None:
    """Which layout of ``spec`` ``root`` holds, without reading any data; ``None`` if none."""
    for d in _candidate_dirs(spec, Path(root)):
        if spec.idx_format:
            files = _idx_files(d)
            if len(files) == 4:
                return "IDX files", d, files
        pickles = _pickle_files(spec, d)
        if pickles:
            return "CIFAR python pickles", d, pickles
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
    elif kind == "CIFAR python pickles":
        arrays = _load_pickles(spec, files)
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


def _load_embedded() -> RawData:
    path = _embedded_path()
    if path is None:
        raise DataSourceError(f"embedded {EMBEDDED_FASHION_MNIST} not found beside pollen or on sys.path")
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    arrays = _check(SPECS["fashion-mnist"], arrays, f"embedded {EMBEDDED_FASHION_MNIST}")
    n_tr, n_te = len(arrays["y_train"]), len(arrays["y_test"])
    return _raw(arrays, f"embedded Fashion-MNIST subset ({n_tr:,} train / {n_te:,} test images, pollen/task/embedded)")


def _embedded_available() -> bool:
    return _embedded_path() is not None


# --------------------------------------------------------------------------- resolution


def load_raw(name: str, data_dir: str = "") -> RawData:
    """Both splits of dataset ``name`` from the first source that holds it (see the module doc).

    Raises :class:`DataSourceError` (one line) when ``data_dir`` is set but does not hold the dataset,
    or when no source does.
    """
    spec = SPECS[name]
    if data_dir:
        root = Path(data_dir).expanduser()
        if not root.is_dir():
            raise DataSourceError(f"data-dir={data_dir!r} is not a directory; it should hold {name}: {expected_files(spec)}")
        found = find_in_dir(spec, root)
        if found is None:
            raise DataSourceError(
                f"data-dir={data_dir!r} does not hold {name}: expected {expected_files(spec)}"
            )
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
        log.warning(
            "fashion-mnist: using the %s because no full copy was found (%s); for the full 60,000/10,000 "
            "set run `apt-get install dataset-fashion-mnist` or set data-dir=<directory with the IDX files>",
            raw.source.removeprefix("embedded "),
            "; ".join(tried),
        )
        return raw

    how = "set data-dir=<directory with "
    how += "its IDX files" if spec.idx_format else f"its {spec.pickle_dir}/ pickles"
    how += ", train/test parquet files or a save_to_disk copy>"
    if name in ("fashion-mnist", "mnist"):
        how = f"put the IDX files in {SYSTEM_DIRS[name][0]}, or " + how
    raise DataSourceError(
        f"no source holds dataset {name!r}; tried: {'; '.join(tried)}. To provide it, {how}, "
        "or make the Hugging Face hub reachable"
    )
