"""CIFAR from a data-dir without running code: the binary version, and the python version through a
restricted unpickler whose result is checked key by key."""

from __future__ import annotations

import itertools
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from pollen.task import sources as S
from pollen.task.sources import DataSourceError

# --------------------------------------------------------------------------- fake CIFAR files


def fake_cifar(n_train: int = 20, n_test: int = 6, classes: int = 10, seed: int = 0):
    """Images (N, 32, 32, 3) and labels; CIFAR-100 also gets coarse labels (fine // 5)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (n_train, n_test):
        out.append(rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8))
        out.append(rng.integers(0, classes, size=n).astype(np.int64))
    return tuple(out)


def rows(x: np.ndarray) -> np.ndarray:
    """CIFAR's row layout: 1024 red, 1024 green, 1024 blue bytes per image."""
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2).reshape(len(x), -1))


def chunks(n: int, k: int) -> list[slice]:
    edges = np.linspace(0, n, k + 1).astype(int)
    return [slice(a, b) for a, b in itertools.pairwise(edges)]


def cifar10_batches(x_tr, y_tr, x_te, y_te) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    names = {f"data_batch_{i + 1}": (x_tr[s], y_tr[s]) for i, s in enumerate(chunks(len(x_tr), 5))}
    names["test_batch"] = (x_te, y_te)
    return names


def py_batch(x, y, dataset="cifar10", name=b"batch"):
    batch = {b"batch_label": name, b"data": rows(x), b"filenames": [b"img_%d.png" % i for i in range(len(x))]}
    if dataset == "cifar100":
        batch[b"fine_labels"] = y.tolist()
        batch[b"coarse_labels"] = (y // 5).tolist()
    else:
        batch[b"labels"] = y.tolist()
    return batch


def dump(path: Path, obj, protocol: int = 2) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)
    return path


def py2_pickle(batch: dict) -> bytes:
    """What Python 2's ``cPickle.dump(batch, f, 2)`` writes for a CIFAR batch (the real files' form):
    ``str`` keys and strings, arrays through ``numpy.core.multiarray._reconstruct``."""

    def s(b: bytes) -> bytes:  # SHORT_BINSTRING / BINSTRING
        return (b"U" + bytes([len(b)]) if len(b) < 256 else b"T" + struct.pack("<i", len(b))) + b

    def i(v: int) -> bytes:  # BININT
        return b"J" + struct.pack("<i", v)

    def value(v) -> bytes:
        if isinstance(v, bytes):
            return s(v)
        if isinstance(v, list):
            return b"](" + b"".join(value(e) for e in v) + b"e"  # EMPTY_LIST MARK ... APPENDS
        if isinstance(v, int):
            return i(v)
        assert isinstance(v, np.ndarray) and v.dtype == np.uint8
        dtype = (
            b"cnumpy\ndtype\n"
            + s(b"u1")
            + b"K\x00K\x01\x87R"
            + b"(K\x03"
            + s(b"|")
            + b"NNN"
            + i(-1)
            + i(-1)
            + b"K\x00tb"
        )
        shape = b"(" + b"".join(i(d) for d in v.shape) + b"t"
        head = b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + s(b"b") + b"\x87R"
        return head + b"(K\x01" + shape + dtype + b"\x89" + s(v.tobytes()) + b"tb"

    body = b"".join(s(k) + value(v) for k, v in batch.items())
    return b"\x80\x02}(" + body + b"u."


def write_python_version(root: Path, arrays, dataset="cifar10", py2=False) -> Path:
    x_tr, y_tr, x_te, y_te = arrays
    d = root / ("cifar-10-batches-py" if dataset == "cifar10" else "cifar-100-python")
    d.mkdir(parents=True, exist_ok=True)
    batches = cifar10_batches(*arrays) if dataset == "cifar10" else {"train": (x_tr, y_tr), "test": (x_te, y_te)}
    for name, (x, y) in batches.items():
        batch = py_batch(x, y, dataset, name.encode())
        if py2:
            (d / name).write_bytes(py2_pickle(batch))
        else:
            dump(d / name, batch)
    return d


def write_binary_version(root: Path, arrays, dataset="cifar10") -> Path:
    x_tr, y_tr, x_te, y_te = arrays
    d = root / ("cifar-10-batches-bin" if dataset == "cifar10" else "cifar-100-binary")
    d.mkdir(parents=True, exist_ok=True)
    if dataset == "cifar10":
        batches = {f"{k}.bin": v for k, v in cifar10_batches(*arrays).items()}
    else:
        batches = {"train.bin": (x_tr, y_tr), "test.bin": (x_te, y_te)}
    for name, (x, y) in batches.items():
        labels = [y // 5, y] if dataset == "cifar100" else [y]
        table = np.column_stack([np.asarray(v, np.uint8) for v in labels] + [rows(x)])
        (d / name).write_bytes(table.astype(np.uint8).tobytes())
    return d


def assert_same(raw: S.RawData, arrays) -> None:
    for got, want in zip((raw.x_train, raw.y_train, raw.x_test, raw.y_test), arrays):
        np.testing.assert_array_equal(got, want)
    assert raw.x_train.dtype == np.uint8 and raw.y_train.dtype == np.int64


class Payload:
    """Pickles to ``callable(*args)``: what a hostile data-dir would hold."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def refused(path: Path, dataset: str = "cifar10") -> str:
    with pytest.raises(DataSourceError) as info:
        S.read_cifar_pickle(path, dataset)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    return msg


# --------------------------------------------------------------------------- the formats agree


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_python_py2_and_binary_versions_load_the_same_arrays(tmp_path, dataset):
    arrays = fake_cifar(classes=100 if dataset == "cifar100" else 10)
    write_python_version(tmp_path / "py", arrays, dataset)
    write_python_version(tmp_path / "py2", arrays, dataset, py2=True)
    write_binary_version(tmp_path / "bin", arrays, dataset)
    py = S.load_raw(dataset, str(tmp_path / "py"))
    py2 = S.load_raw(dataset, str(tmp_path / "py2"))
    binary = S.load_raw(dataset, str(tmp_path / "bin"))
    for raw in (py, py2, binary):
        assert_same(raw, arrays)
        assert raw.x_train.shape == (20, 32, 32, 3)
    assert "CIFAR python batches" in py.source and "CIFAR binary batches" in binary.source


def test_binary_version_is_preferred_and_the_pickles_are_never_opened(tmp_path):
    arrays = fake_cifar()
    d = write_python_version(tmp_path, arrays)
    marker = tmp_path / "pwned"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        dump(d / name, Payload(os.system, f"touch {marker}"))
    write_binary_version(tmp_path / "cifar10", arrays)  # in a subdirectory, found after the pickles' dir
    raw = S.load_raw("cifar10", str(tmp_path))
    assert_same(raw, arrays)
    assert "cifar-10-batches-bin" in raw.source and not marker.exists()


def test_expected_files_name_both_versions(tmp_path):
    with pytest.raises(DataSourceError) as info:
        S.load_raw("cifar100", str(tmp_path))
    msg = str(info.value)
    assert "train.bin and test.bin" in msg and "cifar-100-binary/" in msg and "cifar-100-python/" in msg


# --------------------------------------------------------------------------- hostile pickles


@pytest.mark.parametrize(
    "make",
    [
        lambda m: Payload(os.system, f"touch {m}"),
        lambda m: Payload(eval, f"open({str(m)!r}, 'w').close()"),
        lambda m: Payload(exec, f"open({str(m)!r}, 'w').close()"),
        lambda m: Payload(Path.touch, Path(m)),
        # Hidden inside an otherwise well-formed batch.
        lambda m: {b"data": np.zeros((1, 3072), np.uint8), b"labels": [Payload(os.system, f"touch {m}")]},
    ],
    ids=["os.system", "builtins.eval", "builtins.exec", "pathlib", "nested"],
)
@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_malicious_pickle_is_refused_without_running(tmp_path, make, protocol):
    marker = tmp_path / "pwned"
    path = dump(tmp_path / "cifar-10-batches-py" / "data_batch_1", make(marker), protocol)
    msg = refused(path)
    assert "refuses global" in msg
    assert not marker.exists()
    # Through load_raw too, with the rest of a valid directory around it.
    arrays = fake_cifar()
    write_python_version(tmp_path, arrays)
    dump(path, make(marker), protocol)
    with pytest.raises(DataSourceError, match="refuses global"):
        S.load_raw("cifar10", str(tmp_path))
    assert not marker.exists()


def test_numpy_globals_cannot_be_misused(tmp_path):
    # An object array would carry arbitrary objects; numpy.ndarray itself is not callable.
    obj = dump(tmp_path / "obj", {b"data": np.array([1, "x"], dtype=object), b"labels": [0]})
    assert "refuses array dtype" in refused(obj)
    # REDUCE numpy.ndarray((10**12,)): a huge allocation from a few bytes.
    bomb = dump(tmp_path / "bomb", Payload(np.ndarray, (10**12,)))
    assert "not callable" in refused(bomb)
    # _reconstruct with another class or shape than numpy writes.
    from numpy._core.multiarray import _reconstruct

    odd = dump(tmp_path / "odd", Payload(_reconstruct, np.ndarray, (5,), b"b"))
    assert "unexpected array constructor" in refused(odd)
    odd = dump(tmp_path / "odd", Payload(_reconstruct, np.dtype, (0,), b"b"))
    assert "unexpected array constructor" in refused(odd)
    # Only latin-1 bytes through _codecs.encode.
    import codecs

    codec = dump(tmp_path / "codec", Payload(codecs.encode, "a", "rot13"))
    assert "unexpected _codecs.encode" in refused(codec)


def test_not_a_pickle_at_all(tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(np.random.default_rng(0).bytes(500))
    refused(junk)


# --------------------------------------------------------------------------- well-formed pickles, wrong content


def _batch(**changes):
    x, y = fake_cifar(8, 1)[:2]
    batch = py_batch(x, y)
    for key, value in changes.items():
        k = key.encode()
        if value is None:
            del batch[k]
        else:
            batch[k] = value
    return batch


@pytest.mark.parametrize(
    "batch,needle",
    [
        (["not", "a", "dict"], "holds a list, not a dict"),
        (_batch(data=np.zeros((8, 3000), np.uint8)), "not a uint8 array of shape (N, 3072)"),
        (_batch(data=np.zeros((8, 3072), np.int64)), "dtype int64"),
        (_batch(data=np.zeros((8, 32, 32, 3), np.uint8)), "shape (8, 32, 32, 3)"),
        (_batch(data=b"\x00" * 3072), "b'data' is a bytes"),
        (_batch(labels=[0] * 7), "b'labels' has 7 entries for 8 images"),
        (_batch(labels=[10] * 8), "b'labels' holds 10, allowed 0..9"),
        (_batch(labels=[-1] * 8), "b'labels' holds -1, allowed 0..9"),
        (_batch(labels=[0.5] * 8), "holds a float"),
        (_batch(labels=[True] * 8), "holds a bool"),
        (_batch(labels=np.full(8, 12, np.uint8)), "span 12..12, allowed 0..9"),
        (_batch(labels=None), "lacks key(s) [b'labels']"),
        (_batch(data=None), "lacks key(s) [b'data']"),
        (_batch(evil=b"1"), "unexpected key(s) [b'evil']"),
        (_batch(filenames=[b"a"]), "b'filenames' has 1 entries"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_wrong_content_is_refused_with_a_clear_line(tmp_path, batch, needle):
    path = dump(tmp_path / "data_batch_1", batch)
    assert needle in refused(path)


def test_cifar100_coarse_labels_are_checked(tmp_path):
    x, y = fake_cifar(8, 1, classes=100)[:2]
    batch = py_batch(x, y, "cifar100")
    batch[b"coarse_labels"] = [20] * 8
    assert "b'coarse_labels' holds 20, allowed 0..19" in refused(dump(tmp_path / "train", batch), "cifar100")
    batch[b"coarse_labels"] = (y // 5).tolist()
    batch[b"labels"] = y.tolist()  # a CIFAR-10 key in a CIFAR-100 batch
    assert "unexpected key(s) [b'labels']" in refused(dump(tmp_path / "train", batch), "cifar100")


def test_empty_bytes_at_protocol_2(tmp_path):
    x, y = fake_cifar(4, 1)[:2]
    path = dump(tmp_path / "b", {b"batch_label": b"", b"data": rows(x), b"labels": y.tolist()})
    np.testing.assert_array_equal(S.read_cifar_pickle(path, "cifar10")[1], y)
    assert "unexpected bytes() arguments" in refused(dump(tmp_path / "big", Payload(bytes, 10**12)))


def test_str_keys_are_accepted(tmp_path):
    x, y = fake_cifar(4, 1)[:2]
    path = dump(tmp_path / "b", {"data": rows(x), "labels": y.tolist()}, protocol=4)
    got_x, got_y = S.read_cifar_pickle(path, "cifar10")
    np.testing.assert_array_equal(got_x, rows(x))
    np.testing.assert_array_equal(got_y, y)


# --------------------------------------------------------------------------- binary version errors


def test_binary_wrong_size_and_labels(tmp_path):
    bad_size = tmp_path / "a.bin"
    bad_size.write_bytes(b"\x00" * (3073 * 2 + 5))
    with pytest.raises(DataSourceError, match=r"a\.bin: 6151 bytes is not a whole number of 3073-byte cifar10 records"):
        S.read_cifar_binary(bad_size, "cifar10")
    empty = tmp_path / "e.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataSourceError, match="0 bytes"):
        S.read_cifar_binary(empty, "cifar10")
    label = tmp_path / "l.bin"
    label.write_bytes((bytes([3]) + b"\x00" * 3072) + (bytes([10]) + b"\x00" * 3072))
    with pytest.raises(DataSourceError, match=r"l\.bin: record 1 has label 10, allowed 0\.\.9"):
        S.read_cifar_binary(label, "cifar10")
    coarse = tmp_path / "c.bin"
    coarse.write_bytes(bytes([20, 99]) + b"\x00" * 3072)
    with pytest.raises(DataSourceError, match="record 0 has coarse label 20, allowed 0..19"):
        S.read_cifar_binary(coarse, "cifar100")
    fine = tmp_path / "f.bin"
    fine.write_bytes(bytes([19, 100]) + b"\x00" * 3072)
    with pytest.raises(DataSourceError, match="record 0 has label 100, allowed 0..99"):
        S.read_cifar_binary(fine, "cifar100")


def test_task_layer_never_calls_plain_pickle_load():
    import pollen.task

    for path in Path(pollen.task.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "pickle.load(" not in text and "pickle.loads(" not in text, path
        assert "allow_pickle=True" not in text, path
