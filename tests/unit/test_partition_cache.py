"""The on-disk partition cache: warm processes skip the dataset, keys follow every setting, two
builders at once leave one valid file, a bad file is rebuilt with one warning, and it can be turned off."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import multiprocessing
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from pollen.task import data as D
from pollen.task import sources as S


def write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    path.write_bytes(header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes())


def write_mnist(d: Path, n_train: int = 400, n_test: int = 50) -> Path:
    rng = np.random.default_rng(0)
    d.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", n_test)):
        write_idx(d / f"{split}-images-idx3-ubyte", rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8))
        write_idx(d / f"{split}-labels-idx1-ubyte", (np.arange(n) % 10).astype(np.uint8))
    return d


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("POLLEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(S.SYSTEM_DIRS, "fashion-mnist", ())
    monkeypatch.setitem(S.SYSTEM_DIRS, "mnist", ())
    D.clear_caches()
    yield
    D.clear_caches()


@pytest.fixture
def cfg(tmp_path) -> D.DataConfig:
    data = write_mnist(tmp_path / "mnist")
    return D.DataConfig(
        dataset="mnist", partitioner="dirichlet", num_partitions=4, alpha=0.5, seed=1, data_dir=str(data)
    )


def cache_files(tmp_path) -> list[Path]:
    d = tmp_path / "cache"
    return sorted(d.glob("*.npz")) if d.is_dir() else []


def tensors(cfg, pid=2):
    train, val = D.load_partition(cfg, pid, 16)
    return [*train.dataset.tensors, *val.dataset.tensors]


def assert_equal(a, b) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def no_raw_data(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the raw dataset was read or partitioned")

    monkeypatch.setattr(D, "load_raw", refuse)
    monkeypatch.setattr(D, "make_partitions", refuse)


# --------------------------------------------------------------------------- warm cache


def test_warm_cache_skips_the_dataset_and_gives_identical_tensors(cfg, tmp_path, monkeypatch):
    cold = tensors(cfg)
    (path,) = cache_files(tmp_path)
    assert path.name.startswith("mnist-dirichlet-2-of-4-")
    D.clear_caches()  # a fresh ClientApp process
    no_raw_data(monkeypatch)
    warm = tensors(cfg)
    assert_equal(cold, warm)
    assert D._raw.cache_info().misses == 0 and D._partition_table.cache_info().misses == 0
    with np.load(path, allow_pickle=False) as z:
        assert sorted(z.files) == ["key", "x_train", "x_val", "y_train", "y_val"]
        assert str(z["key"][()]) == D.partition_cache_key(cfg, 2)


def test_cold_build_matches_an_uncached_build(cfg, tmp_path, monkeypatch):
    cached = tensors(cfg)
    D.clear_caches()
    monkeypatch.setenv("POLLEN_CACHE_DIR", "off")
    assert_equal(cached, tensors(cfg))


# --------------------------------------------------------------------------- keys


def test_changed_settings_give_new_files(cfg, tmp_path):
    tensors(cfg)
    seen = {p.name for p in cache_files(tmp_path)}
    for change in (
        {"seed": 2},
        {"alpha": 0.3},
        {"num_partitions": 5},
        {"val_fraction": 0.2},
        {"partitioner": "iid"},
        {"partitioner": "shards", "shards_per_partition": 3},
    ):
        tensors(dataclasses.replace(cfg, **change))
        names = {p.name for p in cache_files(tmp_path)}
        assert len(names - seen) == 1, change
        seen = names
    tensors(cfg, pid=1)  # another partition of the same config
    assert len(cache_files(tmp_path)) == len(seen) + 1
    # A setting the partitioner does not read keys nothing new.
    key = D.partition_cache_key(dataclasses.replace(cfg, partitioner="iid"), 0)
    assert key == D.partition_cache_key(dataclasses.replace(cfg, partitioner="iid", alpha=9.0), 0)


def test_changed_data_files_give_a_new_key(cfg):
    before = D.partition_cache_key(cfg, 0)
    labels = Path(cfg.data_dir) / "train-labels-idx1-ubyte"
    write_idx(labels, (np.arange(400) % 9).astype(np.uint8))
    os.utime(labels, ns=(1, 1))  # same size, different mtime
    assert D.partition_cache_key(cfg, 0) != before


def test_sources_that_need_loading_are_not_cached_on_disk(tmp_path):
    # The embedded subset / hub: which one wins is only known by trying the hub.
    assert D.partition_cache_key(D.DataConfig(), 0) is None
    assert S.source_fingerprint("cifar10", "") is None


# --------------------------------------------------------------------------- bad files


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _random(path: Path) -> None:
    path.write_bytes(np.random.default_rng(0).bytes(4096))


def _wrong_keys(path: Path) -> None:
    with open(path, "wb") as f:
        np.savez(f, x=np.zeros(3))


def _wrong_dtype(path: Path) -> None:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["x_train"] = arrays["x_train"].astype(np.float32)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _wrong_labels(path: Path) -> None:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["y_train"] = arrays["y_train"] + 10
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _other_key(path: Path) -> None:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["key"] = np.array(str(arrays["key"][()]).replace('"partition_id":2', '"partition_id":3'))
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _huge_declared_shape(path: Path) -> None:
    # x_train's header declares 10**9 images with the bytes of a few: refused before allocating 784 GB
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (10**9, 28, 28)})
    with zipfile.ZipFile(path) as zf:
        members = {info.filename: zf.read(info) for info in zf.infolist()}
    members["x_train.npy"] = header.getvalue() + b"\0" * 4096
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _pickled(path: Path) -> None:
    import pickle

    path.write_bytes(pickle.dumps(_Payload(path.parent / "pwned"), protocol=2))


@pytest.mark.parametrize(
    "damage",
    [_truncated, _random, _wrong_keys, _wrong_dtype, _wrong_labels, _other_key, _pickled, _huge_declared_shape],
)
def test_bad_cache_file_is_rebuilt_with_one_warning(cfg, tmp_path, caplog, damage):
    reference = tensors(cfg)
    (path,) = cache_files(tmp_path)
    damage(path)
    D.clear_caches()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        rebuilt = tensors(cfg)
    assert_equal(reference, rebuilt)
    warnings = [r for r in caplog.records if r.name == "flwr" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert str(path) in msg and "rebuilding" in msg and "\n" not in msg
    assert not (path.parent / "pwned").exists()
    # The rebuilt file is good: a fresh process uses it without a warning or the dataset.
    caplog.clear()
    D.clear_caches()
    with caplog.at_level(logging.WARNING, logger="flwr"), pytest.MonkeyPatch.context() as mp:
        no_raw_data(mp)
        assert_equal(reference, tensors(cfg))
    assert not [r for r in caplog.records if r.name == "flwr"]


def test_a_huge_declared_shape_is_refused_from_its_header(cfg, tmp_path, caplog):
    tensors(cfg)
    (path,) = cache_files(tmp_path)
    _huge_declared_shape(path)
    D.clear_caches()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        tensors(cfg)
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "flwr" and r.levelno == logging.WARNING]
    assert "x_train.npy declaring shape (1000000000, 28, 28)" in msg and "rebuilding" in msg


# --------------------------------------------------------------------------- concurrency, switch, failures


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _build_in_child(cfg, barrier, out) -> None:
    """A second SuperNode process: builds partition 2 itself (never reads the other's file) and writes it."""
    try:
        D.clear_caches()
        D._read_cached = lambda *args: None
        barrier.wait(timeout=30)
        arrays = D._partition_arrays(cfg, 2)
        out.send(_digest(arrays[k] for k in ("x_train", "y_train", "x_val", "y_val")))
    except BaseException as err:  # noqa: BLE001 - report to the parent
        out.send(f"error: {type(err).__name__}: {err}")
    finally:
        out.close()


def test_two_processes_building_at_once_leave_one_valid_file(cfg, tmp_path, monkeypatch):
    # fork: the children share the imports (no torch ops run in them), so this costs no start-up.
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    pipes, procs = [], []
    for _ in range(2):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_build_in_child, args=(cfg, barrier, send))
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    try:
        results = [r.recv() if r.poll(60) else "error: timed out" for r in pipes]
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    assert not [r for r in results if r.startswith("error")], results
    assert len(set(results)) == 1
    assert len(cache_files(tmp_path)) == 1
    assert not [p for p in (tmp_path / "cache").iterdir() if p.suffix != ".npz"]  # no temp files left
    no_raw_data(monkeypatch)
    arrays = D._partition_arrays(cfg, 2)  # read back from the file both wrote
    assert _digest(arrays[k] for k in ("x_train", "y_train", "x_val", "y_val")) == results[0]


@pytest.mark.parametrize("value", ["off", "OFF", "none", "0"])
def test_disable_switch(cfg, tmp_path, monkeypatch, value):
    monkeypatch.setenv("POLLEN_CACHE_DIR", value)
    assert D.partition_cache_dir() is None
    tensors(cfg)
    assert not (tmp_path / "cache").exists() and not Path(value).exists()


def test_default_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("POLLEN_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert D.partition_cache_dir() == tmp_path / "home" / ".cache" / "pollen" / "partitions"


def test_unwritable_cache_warns_and_carries_on(cfg, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("POLLEN_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        data = tensors(cfg)
    assert len(data[0]) > 0
    msgs = [r.getMessage() for r in caplog.records if r.name == "flwr"]
    assert len(msgs) == 1 and "cannot write partition cache" in msgs[0]
