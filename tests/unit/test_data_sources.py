"""Data sources: every on-disk layout, the installed copy, the hub wrapper, the embedded subset, errors."""

from __future__ import annotations

import dataclasses
import gzip
import logging
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from pollen.task import data as D
from pollen.task import sources as S
from pollen.task.sources import DataSourceError

DEBIAN = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No network, no machine-wide copies, an empty HF cache, fresh in-process caches."""
    import datasets.config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("POLLEN_CACHE_DIR", str(tmp_path / "partition-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setitem(S.SYSTEM_DIRS, "fashion-mnist", ())
    monkeypatch.setitem(S.SYSTEM_DIRS, "mnist", ())
    monkeypatch.setattr(S, "_SAID_EMBEDDED", set())  # a fresh process: the subset not yet announced
    D.clear_caches()
    yield
    D.clear_caches()


# --------------------------------------------------------------------------- helpers


def _images(n: int, labels: np.ndarray, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Images whose mean brightness encodes the label, so each sample is recognisable."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 40, size=(n, *shape), dtype=np.uint8)
    return (base + (labels.reshape(-1, *([1] * len(shape))) * 20)).astype(np.uint8)


def tiny(n_train=200, n_test=50, shape=(28, 28), classes=10, seed=0):
    rng = np.random.default_rng(seed)
    y_tr = np.arange(n_train) % classes
    y_te = np.arange(n_test) % classes
    rng.shuffle(y_tr)
    return (
        _images(n_train, y_tr, shape, seed),
        y_tr.astype(np.uint8),
        _images(n_test, y_te, shape, seed + 1),
        y_te.astype(np.uint8),
    )


def write_idx(path: Path, arr: np.ndarray, gz: bool = True) -> Path:
    magic = bytes([0, 0, 0x08, arr.ndim])
    blob = magic + struct.pack(f">{arr.ndim}I", *arr.shape) + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(blob))
    else:
        path.write_bytes(blob)
    return path


def write_mnist_dir(d: Path, gz: bool = True, dotted: bool = False):
    x_tr, y_tr, x_te, y_te = tiny()
    sep = "." if dotted else "-"
    write_idx(d / f"train-images{sep}idx3-ubyte", x_tr, gz)
    write_idx(d / f"train-labels{sep}idx1-ubyte", y_tr, gz)
    write_idx(d / f"t10k-images{sep}idx3-ubyte", x_te, gz)
    write_idx(d / f"t10k-labels{sep}idx1-ubyte", y_te, gz)
    return x_tr, y_tr, x_te, y_te


def hf_dataset_dict(x_tr, y_tr, x_te, y_te, image_col="image", label_col="label", classes=10):
    import datasets
    from PIL import Image

    feats = datasets.Features({image_col: datasets.Image(), label_col: datasets.ClassLabel(num_classes=classes)})

    def split(x, y):
        return datasets.Dataset.from_dict(
            {image_col: [Image.fromarray(a) for a in x], label_col: [int(v) for v in y]}, features=feats
        )

    return datasets.DatasetDict({"train": split(x_tr, y_tr), "test": split(x_te, y_te)})


def assert_same(raw: S.RawData, arrays) -> None:
    x_tr, y_tr, x_te, y_te = arrays
    np.testing.assert_array_equal(raw.x_train, x_tr)
    np.testing.assert_array_equal(raw.y_train, y_tr)
    np.testing.assert_array_equal(raw.x_test, x_te)
    np.testing.assert_array_equal(raw.y_test, y_te)
    assert raw.y_train.dtype == np.int64 and raw.x_train.dtype == np.uint8


# --------------------------------------------------------------------------- IDX


def test_read_idx_gz_and_plain(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    np.testing.assert_array_equal(S.read_idx(write_idx(tmp_path / "a", arr, gz=True)), arr)
    np.testing.assert_array_equal(S.read_idx(write_idx(tmp_path / "b", arr, gz=False)), arr)


def test_read_idx_rejects_bad_magic_and_truncation(tmp_path):
    bad = tmp_path / "bad-idx"
    bad.write_bytes(b"\x12\x34\x08\x01" + struct.pack(">I", 3) + b"abc")
    with pytest.raises(DataSourceError, match="bad magic"):
        S.read_idx(bad)
    short = tmp_path / "short-idx"
    short.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"abc")
    with pytest.raises(DataSourceError, match="holds 3 bytes"):
        S.read_idx(short)


@pytest.mark.parametrize("gz,dotted", [(True, False), (False, False), (False, True)])
def test_idx_directory(tmp_path, gz, dotted):
    arrays = write_mnist_dir(tmp_path, gz=gz, dotted=dotted)
    raw = S.load_raw("mnist", str(tmp_path))
    assert_same(raw, arrays)
    assert "IDX files" in raw.source and str(tmp_path) in raw.source


def test_idx_in_torchvision_layout(tmp_path):
    arrays = write_mnist_dir(tmp_path / "FashionMNIST" / "raw", gz=False)
    raw = S.load_raw("fashion-mnist", str(tmp_path))
    assert_same(raw, arrays)


def test_idx_wrong_image_size_is_reported(tmp_path):
    x = np.zeros((10, 20, 20), np.uint8)
    y = np.zeros(10, np.uint8)
    for split in ("train", "t10k"):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte", x)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", y)
    with pytest.raises(DataSourceError, match=r"shape \(20, 20\)"):
        S.load_raw("mnist", str(tmp_path))


# --------------------------------------------------------------------------- HF save_to_disk / parquet / pickles


def test_save_to_disk_directory(tmp_path):
    arrays = tiny(60, 20)
    hf_dataset_dict(*arrays).save_to_disk(str(tmp_path / "saved"))
    raw = S.load_raw("fashion-mnist", str(tmp_path / "saved"))
    assert_same(raw, arrays)
    assert "save_to_disk" in raw.source


def test_save_to_disk_cifar100_columns(tmp_path):
    arrays = tiny(40, 10, shape=(32, 32, 3), classes=100)
    hf_dataset_dict(*arrays, image_col="img", label_col="fine_label", classes=100).save_to_disk(
        str(tmp_path / "cifar100")
    )
    raw = S.load_raw("cifar100", str(tmp_path))  # found in the subdirectory named after the dataset
    assert_same(raw, arrays)
    assert raw.x_train.shape == (40, 32, 32, 3)


def test_parquet_files(tmp_path):
    arrays = tiny(60, 20)
    dd = hf_dataset_dict(*arrays)
    dd["train"].to_parquet(str(tmp_path / "train.parquet"))
    dd["test"].to_parquet(str(tmp_path / "test.parquet"))
    raw = S.load_raw("fashion-mnist", str(tmp_path))
    assert_same(raw, arrays)
    assert "parquet" in raw.source


def test_parquet_shards_in_hub_layout(tmp_path):
    """A snapshot of uoft-cs/cifar10: plain_text/train-0000x-of-00002.parquet, img/label columns."""
    arrays = tiny(40, 10, shape=(32, 32, 3))
    dd = hf_dataset_dict(*arrays, image_col="img")
    sub = tmp_path / "plain_text"
    sub.mkdir()
    dd["train"].select(range(25)).to_parquet(str(sub / "train-00000-of-00002.parquet"))
    dd["train"].select(range(25, 40)).to_parquet(str(sub / "train-00001-of-00002.parquet"))
    dd["test"].to_parquet(str(sub / "test-00000-of-00001.parquet"))
    raw = S.load_raw("cifar10", str(tmp_path))
    assert_same(raw, arrays)


def test_cifar10_python_pickles(tmp_path):
    x_tr, y_tr, x_te, y_te = tiny(50, 10, shape=(32, 32, 3))
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    chw = lambda x: x.transpose(0, 3, 1, 2).reshape(len(x), -1)  # noqa: E731 - the CIFAR row layout
    for i in range(5):
        sl = slice(10 * i, 10 * (i + 1))
        with open(d / f"data_batch_{i + 1}", "wb") as f:
            pickle.dump({b"data": chw(x_tr[sl]), b"labels": y_tr[sl].tolist()}, f)
    with open(d / "test_batch", "wb") as f:
        pickle.dump({b"data": chw(x_te), b"labels": y_te.tolist()}, f)
    raw = S.load_raw("cifar10", str(tmp_path))
    assert_same(raw, (x_tr, y_tr, x_te, y_te))


def test_hf_columns_missing_is_reported(tmp_path):
    arrays = tiny(20, 10)
    hf_dataset_dict(*arrays, label_col="target").save_to_disk(str(tmp_path / "s"))
    with pytest.raises(DataSourceError, match="label column"):
        S.load_raw("mnist", str(tmp_path / "s"))


# --------------------------------------------------------------------------- installed copy, hub, embedded


@pytest.mark.skipif(not DEBIAN.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_debian_fashion_mnist(monkeypatch):
    monkeypatch.setitem(S.SYSTEM_DIRS, "fashion-mnist", (str(DEBIAN),))
    cfg = D.DataConfig()
    assert "installed copy /usr/share/datasets/fashion-mnist" in D.describe_source(cfg)
    raw = D._raw("fashion-mnist", "")
    assert raw.x_train.shape == (60_000, 28, 28) and raw.x_test.shape == (10_000, 28, 28)
    assert np.bincount(raw.y_train).tolist() == [6000] * 10
    assert np.bincount(raw.y_test).tolist() == [1000] * 10


def test_embedded_subset():
    raw = S._load_embedded()
    assert raw.x_train.shape == (12_000, 28, 28) and raw.x_test.shape == (2_000, 28, 28)
    assert raw.x_train.dtype == np.uint8
    assert np.bincount(raw.y_train, minlength=10).tolist() == [1200] * 10
    assert np.bincount(raw.y_test, minlength=10).tolist() == [200] * 10
    # Real images: Fashion-MNIST's mean pixel is about 0.286 * 255 = 73 with many black pixels.
    assert 65 < raw.x_train.mean() < 80 and (raw.x_train == 0).mean() > 0.4


def test_embedded_subset_declaring_more_than_it_holds_is_refused(tmp_path, monkeypatch):
    # A copy of pollen on sys.path can supply the subset: its sizes are checked like any other file's.
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (10**9, 28, 28)})
    path = tmp_path / S.EMBEDDED_FASHION_MNIST
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("x_train.npy", header.getvalue() + bytes(784))
    monkeypatch.setattr(S, "_embedded_path", lambda: path)
    with pytest.raises(
        DataSourceError, match=r"unusable: it has member x_train.npy declaring shape \(1000000000, 28, 28\)"
    ):
        S._load_embedded()


@pytest.mark.skipif(not DEBIAN.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_embedded_subset_is_taken_from_the_original_files():
    full = S.load_raw("fashion-mnist", str(DEBIAN))
    ref = Path(S.__file__).parent / "embedded" / S.EMBEDDED_FASHION_MNIST
    with np.load(ref) as z:
        idx_tr, idx_te = z["idx_train"].astype(np.int64), z["idx_test"].astype(np.int64)
        np.testing.assert_array_equal(z["x_train"], full.x_train[idx_tr])
        np.testing.assert_array_equal(z["y_test"], full.y_test[idx_te])
    assert (Path(S.__file__).parent / "embedded" / "LICENSE-fashion-mnist.txt").is_file()


def test_fashion_mnist_falls_back_to_embedded_with_one_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="pollen.task.sources"):
        line = D.describe_source(D.DataConfig())
        D.load_partition(D.DataConfig(), 0, 32)  # cached: no second message
    assert "embedded Fashion-MNIST subset" in line
    msgs = [r.getMessage() for r in caplog.records if r.name == "pollen.task.sources"]
    assert len(msgs) == 1 and "\n" not in msgs[0]
    assert "apt-get install dataset-fashion-mnist" in msgs[0] and "data-dir=" in msgs[0]
    assert "HF_HUB_OFFLINE" in msgs[0]  # says why the hub was not used


def test_the_embedded_subset_is_announced_once_per_process_in_a_short_line(caplog):
    """A ClientApp loads its data for every message; the subset is said once, not per load."""
    with caplog.at_level(logging.WARNING, logger="pollen.task.sources"):
        for _ in range(2):
            D.clear_caches()  # a load from scratch, as a message after the caches were dropped
            D.describe_source(D.DataConfig())
            D.load_partition(D.DataConfig(), 1, 32)
    msgs = [r.getMessage() for r in caplog.records if r.name == "pollen.task.sources"]
    assert len(msgs) == 1
    assert len(msgs[0]) < 250 and msgs[0].startswith("fashion-mnist: pollen's 12,000/2,000-image subset"), msgs[0]


def test_cifar10_without_any_source_is_one_clear_line():
    with pytest.raises(DataSourceError) as info:
        D.describe_source(D.DataConfig(dataset="cifar10"))
    msg = str(info.value)
    assert "\n" not in msg
    assert "'cifar10'" in msg and "uoft-cs/cifar10" in msg and "data-dir=" in msg
    assert isinstance(info.value, ValueError)


def test_mnist_without_any_source_names_the_installed_path(monkeypatch):
    monkeypatch.setitem(S.SYSTEM_DIRS, "mnist", ("/nonexistent/mnist",))
    with pytest.raises(DataSourceError, match=r"/nonexistent/mnist \(absent\)"):
        D.load_test_set(D.DataConfig(dataset="mnist"), 64)


def test_system_dir_is_used(tmp_path, monkeypatch):
    arrays = write_mnist_dir(tmp_path / "mnist")
    monkeypatch.setitem(S.SYSTEM_DIRS, "mnist", (str(tmp_path / "mnist"),))
    assert "installed copy" in D.describe_source(D.DataConfig(dataset="mnist"))
    assert_same(D._raw("mnist", ""), arrays)


def test_hub_path_through_federated_dataset(tmp_path, monkeypatch):
    """The real FederatedDataset code path, pointed at a local parquet repo instead of the hub id."""
    arrays = tiny(60, 20)
    repo = tmp_path / "repo" / "mnist"
    repo.mkdir(parents=True)
    dd = hf_dataset_dict(*arrays)
    dd["train"].to_parquet(str(repo / "train-00000-of-00001.parquet"))
    dd["test"].to_parquet(str(repo / "test-00000-of-00001.parquet"))
    monkeypatch.setitem(S.SPECS, "mnist", dataclasses.replace(S.SPECS["mnist"], hub_id=str(tmp_path / "repo")))
    raw = S.load_raw("mnist")
    assert_same(raw, arrays)
    assert "via flwr-datasets" in raw.source


def test_hub_probe_failure_falls_back_to_cache_only(monkeypatch):
    """Without HF_HUB_OFFLINE, an unreachable hub is detected by the probe and only the cache is read."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def unreachable(self, repo_id, **kw):
        calls.append((repo_id, kw.get("timeout")))
        raise ConnectionError("no route to host")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    raw, why = S._load_hub(S.SPECS["cifar100"])
    assert raw is None
    assert calls == [("uoft-cs/cifar100", S.HUB_TIMEOUT_S)]
    assert "hub unreachable" in why and "no route to host" in why and "not in the local cache" in why


# --------------------------------------------------------------------------- data-dir errors


def test_data_dir_without_the_dataset_is_an_error(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing here")
    cfg = D.DataConfig(dataset="fashion-mnist", data_dir=str(tmp_path))
    for call in (
        lambda: D.validate_data_config(cfg),
        lambda: D.describe_source(cfg),
        lambda: D.load_partition(cfg, 0, 8),
    ):
        with pytest.raises(DataSourceError) as info:
            call()
        msg = str(info.value)
        assert "data-dir=" in msg and str(tmp_path) in msg
        assert "train-images-idx3-ubyte" in msg and "parquet" in msg and "\n" not in msg


def test_data_dir_that_does_not_exist(tmp_path):
    with pytest.raises(DataSourceError, match="data-dir=.*is not a directory"):
        D.validate_data_config(D.DataConfig(data_dir=str(tmp_path / "missing")))


def test_data_dir_with_partial_idx_does_not_fall_back(tmp_path):
    x_tr, y_tr, _, _ = tiny()
    write_idx(tmp_path / "train-images-idx3-ubyte", x_tr)
    write_idx(tmp_path / "train-labels-idx1-ubyte", y_tr)
    with pytest.raises(DataSourceError, match="does not hold fashion-mnist"):
        S.load_raw("fashion-mnist", str(tmp_path))


def test_data_dir_for_cifar_names_cifar_layouts(tmp_path):
    with pytest.raises(DataSourceError, match="data_batch_1..5"):
        S.load_raw("cifar10", str(tmp_path))


def test_cifar10_from_data_dir_end_to_end(tmp_path):
    """data-dir -> partitions -> augmented batches -> one training step of the CIFAR models."""
    import torch

    from pollen.task import build_model, train

    arrays = tiny(60, 20, shape=(32, 32, 3))
    dd = hf_dataset_dict(*arrays, image_col="img")
    dd["train"].to_parquet(str(tmp_path / "train.parquet"))
    dd["test"].to_parquet(str(tmp_path / "test.parquet"))
    cfg = D.DataConfig(dataset="cifar10", partitioner="pathological", num_partitions=3, data_dir=str(tmp_path))
    assert D.describe_source(cfg).startswith("cifar10: data-dir")
    train_loader, val_loader = D.load_partition(cfg, 1, 8, augment=True)
    x, y = next(iter(train_loader))
    assert x.shape == (8, 3, 32, 32) and len(set(torch.cat([b[1] for b in train_loader]).tolist())) <= 2
    assert len(D.load_test_set(cfg, 16).dataset) == 20
    torch.manual_seed(0)
    res = train(
        build_model("lenet5", D.dataset_info("cifar10")), train_loader, lr=0.01, local_steps=2, device="cpu", seed=0
    )
    assert res.num_steps == 2 and res.num_examples == len(train_loader.dataset)
