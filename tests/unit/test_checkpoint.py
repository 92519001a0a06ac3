"""Tests for :mod:`pollen.core.checkpoint`: round trips, refusals, atomic writes, malformed files, run-config diffs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pollen.core import checkpoint
from pollen.core.checkpoint import (
    CheckpointError,
    describe_difference,
    load_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.flower_compat

REPO_ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ helpers


def _same_array(got: Any, want: np.ndarray) -> None:
    """Same type, dtype, shape and bytes (NaN positions included, since bytes compare bit for bit)."""
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    assert np.array_equal(got, want, equal_nan=want.dtype.kind in "fc")


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def _rich_tree() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    base = rng.standard_normal((6, 8)).astype(np.float64)
    with_nan = np.array([1.0, np.nan, -np.inf, np.inf, -0.0], dtype=np.float32)
    return {
        "none": None,
        "flags": [True, False],
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**63, -(2**127) - 5, 3**200],
        "floats": [0.1, -0.0, 1e-310, 1.7976931348623157e308, float("nan"), float("inf"), float("-inf")],
        "text": ["", "plain", "ünïcødé ✓", "lone \udcff surrogate", 'quote " and \\ backslash\n'],
        "tuple": (1, "two", (3.0, None)),
        "empty": {"dict": {}, "list": [], "tuple": ()},
        "numpy_scalars": {
            "f32": np.float32(1.5),
            "f64": np.float64(0.1),
            "f16": np.float16(-2.0),
            "i8": np.int8(-7),
            "u64": np.uint64(2**64 - 1),
            "bool": np.bool_(True),
            "c64": np.complex64(1 - 2j),
        },
        "arrays": {
            "f32": rng.standard_normal(17).astype(np.float32),
            "f64": base,
            "f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
            "i8": np.arange(-128, 128, dtype=np.int8),
            "u8": np.arange(256, dtype=np.uint8).reshape(16, 16),
            "i64": np.array([-(2**63), 0, 2**63 - 1], dtype=np.int64),
            "bool": rng.random(11) > 0.5,
            "c128": np.array([1 + 2j, np.nan - 1j], dtype=np.complex128),
            "big_endian": np.arange(5, dtype=">f4"),
            "with_nan": with_nan,
            "zero_d": np.array(3.25, dtype=np.float64),
            "zero_d_int": np.array(-4, dtype=np.int32),
            "empty_1d": np.zeros((0,), dtype=np.float32),
            "empty_2d": np.zeros((3, 0), dtype=np.int64),
            "fortran": np.asfortranarray(base),
            "strided": base[::2, 1::3],
            "transposed": base.T,
            "str": np.array(["client-1", "c2"]),
            "bytes": np.array([b"ab", b""]),
        },
        # Keys spelled like the file format's own tags must survive as ordinary data.
        "lookalike": {"__array__": "a0", "__dict__": [["x", 1]]},
        "lookalike_single": {"__float__": "nan"},
        "nested": [{"a": [np.arange(3)]}, [[np.ones((2, 2), dtype=np.float32)]]],
    }


# ------------------------------------------------------------------------------------------ round trip


def test_rich_tree_round_trips(tmp_path: Path) -> None:
    tree = _rich_tree()
    path = tmp_path / "ckpt.npz"
    size = save_checkpoint(path, tree)
    assert size == path.stat().st_size > 0
    got = load_checkpoint(path)

    assert list(got) == list(tree)
    assert got["none"] is None
    assert got["flags"] == [True, False] and all(type(b) is bool for b in got["flags"])
    assert got["ints"] == tree["ints"] and all(type(i) is int for i in got["ints"])
    want_floats = tree["floats"]
    assert got["floats"][:4] == want_floats[:4]
    assert str(got["floats"][1]) == "-0.0"
    assert np.isnan(got["floats"][4]) and got["floats"][5:] == [float("inf"), float("-inf")]
    assert got["text"] == tree["text"]
    assert got["tuple"] == [1, "two", [3.0, None]]  # tuples come back as lists
    assert got["empty"] == {"dict": {}, "list": [], "tuple": []}
    for name, want in tree["numpy_scalars"].items():
        value = got["numpy_scalars"][name]
        assert type(value) is type(want), name
        assert value == want and value.dtype == want.dtype, name
    for name, want in tree["arrays"].items():
        _same_array(got["arrays"][name], want)
    assert got["arrays"]["fortran"].flags.f_contiguous
    assert got["arrays"]["f64"].flags.c_contiguous and got["arrays"]["f64"].flags.writeable
    assert got["lookalike"] == tree["lookalike"]
    assert got["lookalike_single"] == tree["lookalike_single"]
    _same_array(got["nested"][0]["a"][0], np.arange(3))
    _same_array(got["nested"][1][0][0], np.ones((2, 2), dtype=np.float32))


def test_file_is_an_npz_with_json_meta(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.npz"
    save_checkpoint(path, {"x": np.arange(3), "y": {"z": 1}})
    with np.load(path, allow_pickle=False) as npz:
        assert sorted(npz.files) == ["__meta__", "a0"]
        meta = json.loads(npz["__meta__"].tobytes().decode("utf-8"))
        assert npz["__meta__"].dtype == np.uint8
    assert meta == {"format": "pollen-checkpoint/1", "tree": {"x": {"__array__": "a0"}, "y": {"z": 1}}}


def test_mappings_and_subclasses_come_back_as_plain_types(tmp_path: Path) -> None:
    class Name(str):
        pass

    tree = {"od": OrderedDict([("b", 1), ("a", 2)]), "name": Name("n"), "mm": None}
    path = tmp_path / "c.npz"
    mm = np.lib.format.open_memmap(tmp_path / "rows.npy", mode="w+", dtype=np.float32, shape=(4, 3))
    mm[:] = 2.5
    tree["mm"] = mm
    save_checkpoint(path, tree)
    got = load_checkpoint(path)
    assert type(got["od"]) is dict and list(got["od"].items()) == [("b", 1), ("a", 2)]
    assert type(got["name"]) is str and got["name"] == "n"
    assert type(got["mm"]) is np.ndarray
    _same_array(got["mm"], np.full((4, 3), 2.5, dtype=np.float32))


def test_pcg64_state_round_trips_exactly(tmp_path: Path) -> None:
    original = np.random.default_rng(1)
    original.random(5)  # move off the seed state
    path = tmp_path / "rng.npz"
    save_checkpoint(path, {"rng": original.bit_generator.state})
    restored = np.random.default_rng()
    restored.bit_generator.state = load_checkpoint(path)["rng"]
    assert restored.bit_generator.state == original.bit_generator.state
    np.testing.assert_array_equal(restored.random(100), original.random(100))
    np.testing.assert_array_equal(restored.integers(0, 2**62, 50), original.integers(0, 2**62, 50))


def test_creates_parent_directories_and_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "ckpt.npz"
    save_checkpoint(path, {"round": 1})
    save_checkpoint(str(path), {"round": 2})
    assert load_checkpoint(str(path)) == {"round": 2}
    assert _leftovers(path.parent) == []


def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "absent.npz")


# ------------------------------------------------------------------------------------------ refusals


class _Custom:
    pass


@pytest.mark.parametrize(
    ("tree", "where", "what"),
    [
        ({"strategy": {"optimizer": {"m": np.array([1, None], dtype=object)}}}, "'strategy/optimizer/m'", "object"),
        ({"s": [1, {"rec": np.zeros(2, dtype=[("x", "f4"), ("y", "i4")])}]}, "'s/1/rec'", "structured"),
        ({"t": np.array(["2024-01-01"], dtype="datetime64[D]")}, "'t'", "datetime64"),
        ({"v": np.void(b"ab")}, "'v'", "V2"),
        ({"a": {"b": {1: "one"}}}, "'a/b'", "key 1"),
        ({"a": [0, {"x": {1, 2}}]}, "'a/1/x'", "set"),
        ({"c": _Custom()}, "'c'", "_Custom"),
        ({"b": b"raw bytes"}, "'b'", "bytes"),
        ({"m": np.ma.masked_array([1.0, 2.0], mask=[0, 1])}, "'m'", "masked"),
    ],
)
def test_unstorable_values_are_refused_and_nothing_is_written(
    tmp_path: Path, tree: dict[str, Any], where: str, what: str
) -> None:
    path = tmp_path / "sub" / "ckpt.npz"
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(path, tree)
    message = str(info.value)
    assert where in message and what in message and "\n" not in message
    assert not path.parent.exists()  # refused before even the directory was made
    assert list(tmp_path.iterdir()) == []


def test_refusal_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.npz"
    save_checkpoint(path, {"round": 3})
    with pytest.raises(CheckpointError, match="dtype object"):
        save_checkpoint(path, {"round": 4, "bad": np.array([None])})
    assert load_checkpoint(path) == {"round": 3}
    assert _leftovers(tmp_path) == []


def test_tree_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="mapping"):
        save_checkpoint(tmp_path / "c.npz", [1, 2])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ crashes


class _FailingFile:
    """Wraps the temp file so that writing fails once ``limit`` bytes went through (a full disk)."""

    def __init__(self, inner: Any, limit: int) -> None:
        self._inner = inner
        self._left = limit

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self._left:
            self._inner.write(bytes(memoryview(data).cast("B")[: self._left]))
            self._left = 0
            raise OSError(28, "No space left on device (simulated)")
        self._left -= n
        return self._inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


def _fail_in_write(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.fdopen
    monkeypatch.setattr(checkpoint.os, "fdopen", lambda fd, *a, **k: _FailingFile(real(fd, *a, **k), 50_000))


def _fail_in_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    def fsync(fd: int) -> None:
        raise OSError(5, "Input/output error (simulated)")

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)


def _fail_in_replace(monkeypatch: pytest.MonkeyPatch) -> None:
    def replace(src: Any, dst: Any) -> None:
        raise OSError(18, "Invalid cross-device link (simulated)")

    monkeypatch.setattr(checkpoint.os, "replace", replace)


def _interrupt_in_write(monkeypatch: pytest.MonkeyPatch) -> None:
    def savez(file: Any, *args: Any, **kwargs: Any) -> None:
        file.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.np, "savez", savez)


@pytest.mark.parametrize(
    ("inject", "error"),
    [
        (_fail_in_write, OSError),
        (_fail_in_fsync, OSError),
        (_fail_in_replace, OSError),
        (_interrupt_in_write, KeyboardInterrupt),
    ],
)
def test_failure_while_writing_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inject: Any, error: type[BaseException]
) -> None:
    path = tmp_path / "ckpt.npz"
    tree_a = {"round": 1, "params": np.arange(10, dtype=np.float32)}
    save_checkpoint(path, tree_a)
    tree_b = {"round": 2, "params": np.ones(200_000, dtype=np.float32)}  # 800 kB: the write fails midway
    with monkeypatch.context() as patch:
        inject(patch)
        with pytest.raises(error):
            save_checkpoint(path, tree_b)
    got = load_checkpoint(path)
    assert got["round"] == 1
    _same_array(got["params"], tree_a["params"])
    assert _leftovers(tmp_path) == []


def test_failure_on_the_first_save_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.npz"
    _fail_in_fsync(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(path, {"round": 1})
    assert list(tmp_path.iterdir()) == []


_CHILD = """
import sys
import numpy as np
from pollen.core.checkpoint import save_checkpoint

path = sys.argv[1]
big = np.empty(1_500_000, dtype=np.float64)
print("ready", flush=True)
i = 0
while True:
    i += 1
    big.fill(i)
    save_checkpoint(path, {"i": i, "big": big, "tail": {"i": np.int64(i)}})
"""


def _start_writer(path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, env=env)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == b"ready"
    return child


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.005)


def _check_complete(path: Path) -> int:
    got = load_checkpoint(path)
    i = got["i"]
    assert got["tail"]["i"] == i
    assert got["big"].shape == (1_500_000,) and got["big"].dtype == np.float64
    assert np.all(got["big"] == float(i))
    return i


def test_killed_writer_leaves_absent_or_complete_file(tmp_path: Path) -> None:
    """SIGKILL a process that saves 12 MB checkpoints in a loop: the file is absent or a whole checkpoint.

    The early kills land before or during the first save (no file yet); the later ones during later saves,
    after the first save for sure (the last round waits until the file exists).
    """
    path = tmp_path / "ckpt.npz"
    delays = (0.0, 0.01, 0.03, 0.06, 0.1, 0.15, 0.05)
    for n, delay in enumerate(delays):
        child = _start_writer(path)
        try:
            if n == len(delays) - 1:
                _wait_for(path, timeout=10.0)
            time.sleep(delay)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
            if child.stdout is not None:
                child.stdout.close()
        if path.exists():
            _check_complete(path)
    assert path.exists(), "the writer never finished a single save in 10 s"


# ------------------------------------------------------------------------------------------ malformed files


def _write_zip(path: Path, members: dict[str, Any], *, compression: int = zipfile.ZIP_STORED) -> None:
    """Members: name -> ndarray (written as .npy) or bytes (written raw)."""
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        for name, value in members.items():
            with zf.open(name, "w") as fp:
                if isinstance(value, np.ndarray):
                    np.lib.format.write_array(fp, value, allow_pickle=value.dtype.hasobject)
                else:
                    fp.write(value)


def _meta(doc: Any) -> np.ndarray:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


_UNPICKLED: list[str] = []


def _record_unpickle() -> str:
    _UNPICKLED.append("unpickled")
    return "payload"


class _Payload:
    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_record_unpickle, ())


def _random_bytes(path: Path) -> None:
    path.write_bytes(np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes())


def _empty_file(path: Path) -> None:
    path.write_bytes(b"")


def _plain_npy(path: Path) -> None:
    with open(path, "wb") as f:
        np.save(f, np.arange(4))


def _zip_random_bytes(path: Path) -> None:
    path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)


def _no_meta(path: Path) -> None:
    with open(path, "wb") as f:
        np.savez(f, a0=np.arange(3))


def _bad_json(path: Path) -> None:
    _write_zip(path, {"__meta__.npy": _meta('{"format": "pollen-checkpoint/1", "tree": {')})


def _meta_not_utf8(path: Path) -> None:
    _write_zip(path, {"__meta__.npy": np.array([0xFF, 0xFE, 0x7B], dtype=np.uint8)})


def _meta_wrong_dtype(path: Path) -> None:
    _write_zip(path, {"__meta__.npy": np.zeros(3, dtype=np.float32)})


def _meta_nan_constant(path: Path) -> None:
    _write_zip(path, {"__meta__.npy": _meta('{"format": "pollen-checkpoint/1", "tree": {"x": NaN}}')})


def _missing_array(path: Path) -> None:
    doc = {"format": "pollen-checkpoint/1", "tree": {"w": {"__array__": "a7"}}}
    _write_zip(path, {"__meta__.npy": _meta(doc), "a0.npy": np.arange(3)})


def _bad_reference_name(path: Path) -> None:
    doc = {"format": "pollen-checkpoint/1", "tree": {"w": {"__array__": "../etc/passwd"}}}
    _write_zip(path, {"__meta__.npy": _meta(doc)})


def _unknown_format(path: Path) -> None:
    _write_zip(path, {"__meta__.npy": _meta({"format": "pollen-checkpoint/99", "tree": {}})})


def _no_format(path: Path) -> None:
    _write_zip(path, {"__meta__.npy": _meta({"tree": {}})})


def _malformed_tag(path: Path) -> None:
    doc = {"format": "pollen-checkpoint/1", "tree": {"x": {"__int__": "12; rm"}}}
    _write_zip(path, {"__meta__.npy": _meta(doc)})


def _tag_with_extra_key(path: Path) -> None:
    doc = {"format": "pollen-checkpoint/1", "tree": {"x": {"__array__": "a0", "other": 1}}}
    _write_zip(path, {"__meta__.npy": _meta(doc), "a0.npy": np.arange(3)})


def _scalar_not_0d(path: Path) -> None:
    doc = {"format": "pollen-checkpoint/1", "tree": {"x": {"__scalar__": "a0"}}}
    _write_zip(path, {"__meta__.npy": _meta(doc), "a0.npy": np.arange(3)})


def _truncated(path: Path) -> None:
    save_checkpoint(path, {"w": np.arange(1000, dtype=np.float64), "round": 5})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flipped_data_byte(path: Path) -> None:
    save_checkpoint(path, {"w": np.zeros(1000, dtype=np.float64)})
    data = bytearray(path.read_bytes())
    at = data.index(b"\x00" * 64) + 10  # inside the array's zeros
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _object_array(path: Path) -> None:
    doc = {"format": "pollen-checkpoint/1", "tree": {"x": {"__array__": "a0"}}}
    payload = np.array([_Payload()], dtype=object)
    _write_zip(path, {"__meta__.npy": _meta(doc), "a0.npy": payload})


def _huge_declared_shape(path: Path) -> None:
    doc = {"format": "pollen-checkpoint/1", "tree": {"x": {"__array__": "a0"}}}
    header = {"descr": "<f8", "fortran_order": False, "shape": (10**12,)}
    buf = _npy_header(header) + b"\x00" * 64
    _write_zip(path, {"__meta__.npy": _meta(doc), "a0.npy": buf})


def _npy_header(header: dict[str, Any]) -> bytes:
    import io

    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, header)
    return out.getvalue()


def _compressed(path: Path) -> None:
    with open(path, "wb") as f:
        np.savez_compressed(f, __meta__=_meta({"format": "pollen-checkpoint/1", "tree": {}}))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (_random_bytes, "not a zip"),
        (_empty_file, "not a zip"),
        (_plain_npy, "not a zip"),
        (_zip_random_bytes, "damaged or truncated"),
        (_no_meta, "no __meta__"),
        (_bad_json, "not valid JSON"),
        (_meta_not_utf8, "not valid JSON"),
        (_meta_wrong_dtype, "expected 1-D uint8"),
        (_meta_nan_constant, "not valid JSON"),
        (_missing_array, "'a7'"),
        (_bad_reference_name, "expected a name like 'a0'"),
        (_unknown_format, "pollen-checkpoint/99"),
        (_no_format, "without a format"),
        (_malformed_tag, "malformed __int__"),
        (_tag_with_extra_key, "malformed tagged value"),
        (_scalar_not_0d, "scalar at 'x'"),
        (_truncated, "damaged or truncated"),
        (_flipped_data_byte, "damaged or truncated"),
        (_object_array, "dtype object"),
        (_huge_declared_shape, "8000000000000 bytes"),
        (_compressed, "compressed"),
    ],
)
def test_malformed_file_raises_one_line_naming_the_file(tmp_path: Path, make: Any, why: str) -> None:
    path = tmp_path / "resume-me.npz"
    make(path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "resume-me.npz" in message
    assert why in message
    assert "\n" not in message
    assert _UNPICKLED == []


def test_checkpoint_error_is_a_value_error() -> None:
    assert issubclass(CheckpointError, ValueError)


# ------------------------------------------------------------------------------------------ run-config


def test_describe_difference_equal_is_none() -> None:
    config = {"server-lr": 0.1, "strategy": "fedams", "seed": 42, "flag": True}
    assert describe_difference(config, dict(config)) is None
    assert describe_difference({}, {}) is None
    assert describe_difference({"x": float("nan")}, {"x": float("nan")}) is None


def test_describe_difference_ignores_keys() -> None:
    saved = {"num-server-rounds": 10, "server-lr": 0.1, "old": 1}
    current = {"num-server-rounds": 20, "server-lr": 0.1, "new": 2}
    assert describe_difference(saved, current, ignore=["num-server-rounds", "old", "new"]) is None
    assert describe_difference(saved, current, ignore=("old", "new")) == (
        "run-config 'num-server-rounds' was 10 in the checkpoint and is 20 now"
    )


def test_describe_difference_lines() -> None:
    assert describe_difference({"server-lr": 0.1}, {"server-lr": 0.2}) == (
        "run-config 'server-lr' was 0.1 in the checkpoint and is 0.2 now"
    )
    assert describe_difference({"a": 1}, {"a": 1, "x": 3}) == "run-config 'x' is missing from the checkpoint"
    assert describe_difference({"a": 1, "x": 3}, {"a": 1}) == "run-config 'x' is not set now"
    assert describe_difference({"s": "fedams"}, {"s": "fedadam"}) == (
        "run-config 's' was 'fedams' in the checkpoint and is 'fedadam' now"
    )


def test_describe_difference_first_key_in_sorted_order_and_exact_compare() -> None:
    saved = {"b": 1, "a": 0.1, "c": "x"}
    current = {"c": "y", "b": 2, "a": 0.1}
    assert describe_difference(saved, current) == "run-config 'b' was 1 in the checkpoint and is 2 now"
    assert describe_difference({"a": 0.1}, {"a": 0.1000000000000001}) == (
        "run-config 'a' was 0.1 in the checkpoint and is 0.1000000000000001 now"
    )
    assert describe_difference({"n": 1}, {"n": 1.0}) is None
    assert describe_difference({"n": 1}, {"n": True}) == "run-config 'n' was 1 in the checkpoint and is True now"


def test_describe_difference_after_a_round_trip(tmp_path: Path) -> None:
    config = {"server-lr": 0.1, "seed": 42, "strategy": "fedams", "eps": 1e-8, "flag": False}
    path = tmp_path / "c.npz"
    save_checkpoint(path, {"run_config": config})
    assert describe_difference(load_checkpoint(path)["run_config"], config) is None
