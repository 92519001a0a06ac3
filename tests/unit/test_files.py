"""``pollen.core.files``: ``.npz`` files written atomically and read back without pickle or trusted sizes.

Flower-free on purpose (core is numpy and the standard library): the callers' own refusals are tested beside
them (checkpoint, client state, VR table and journal, partition cache, embedded subset).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import time
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pollen.core import files
from pollen.core.files import NpzError, read_npz, write_npz_atomic


def _header(descr: str, shape: tuple[int, ...], *, fortran: bool = False) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": fortran, "shape": shape})
    return out.getvalue()


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, array, allow_pickle=array.dtype.hasobject)
    return out.getvalue()


def _zip(path: Path, members: dict[str, bytes], *, compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


# ------------------------------------------------------------------------------------------- round trip


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    nan_payloads = np.array([0x7FF8_0000_0000_0001, 0xFFF0_0000_0000_0002], dtype=np.uint64).view(np.float64)
    return {
        "f64": rng.standard_normal((3, 5)),
        "f32_fortran": np.asfortranarray(rng.standard_normal((4, 3)).astype(np.float32)),
        "f16": rng.standard_normal(7).astype(np.float16),
        "big_endian_i4": np.arange(-5, 5, dtype=">i4"),
        "u8": rng.integers(0, 256, (2, 3, 4), dtype=np.uint8),
        "i64_scalar": np.array(-(2**62), dtype=np.int64),
        "bool": np.array([True, False, True]),
        "c128": np.array([1 + 2j, -0.5j]),
        "nan_payloads": nan_payloads,
        "empty": np.zeros((0, 3), dtype=np.float32),
        "text": np.array(["héllo", "w"]),
        "bytes": np.array([b"ab", b"\x00\xff"]),
        "nested/name.with.dots": np.arange(3, dtype=np.uint16),
    }


def test_round_trip_is_bit_exact_for_several_dtypes(tmp_path: Path) -> None:
    path = tmp_path / "a.npz"
    want = _arrays()
    size = write_npz_atomic(path, want)
    assert size == path.stat().st_size
    got = read_npz(path)
    assert list(got) == list(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert got[name].tobytes(order="A") == array.tobytes(order="A"), name
        assert got[name].flags.writeable, name
    assert got["f32_fortran"].flags.f_contiguous and not got["f32_fortran"].flags.c_contiguous
    # the file is np.savez's format: numpy reads it, and a file numpy wrote reads back the same
    with np.load(path, allow_pickle=False) as z:
        assert sorted(z.files) == sorted(want)
    with open(tmp_path / "numpy.npz", "wb") as f:
        np.savez(f, **want)
    again = read_npz(tmp_path / "numpy.npz")
    assert all(again[k].tobytes(order="A") == want[k].tobytes(order="A") for k in want)


def test_an_open_file_and_expected_shapes(tmp_path: Path) -> None:
    path = tmp_path / "a.npz"
    write_npz_atomic(path, {"x": np.zeros((5, 2), np.uint8), "y": np.arange(5)})
    expected = {"x": ((None, 2), np.uint8), "y": ((None,), np.int64)}
    with open(path, "rb") as f:
        got = read_npz(f, expected=expected)
        assert not f.closed
    assert got["x"].shape == (5, 2)
    with pytest.raises(NpzError, match=r"x.npy of shape \(5, 2\), expected \(N, 3\)"):
        read_npz(path, expected={**expected, "x": ((None, 3), np.uint8)})
    with pytest.raises(NpzError, match="x.npy of dtype uint8, expected float32"):
        read_npz(path, expected={**expected, "x": (None, np.float32)})
    with pytest.raises(NpzError, match=r"holds \['x', 'y'\], expected \['x'\]"):
        read_npz(path, expected={"x": (None, None)})


def test_deflated_members_only_when_allowed(tmp_path: Path) -> None:
    path = tmp_path / "c.npz"
    with open(path, "wb") as f:
        np.savez_compressed(f, x=np.arange(1000.0))
    with pytest.raises(NpzError, match="compressed member x.npy"):
        read_npz(path)
    np.testing.assert_array_equal(read_npz(path, allow_compressed=True)["x"], np.arange(1000.0))


# ------------------------------------------------------------------------------------------- hostile files


def test_huge_declared_shape_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    # 10**12 float64 = 8 TB declared, 64 bytes held: np.load would try to allocate the 8 TB first.
    path = _zip(tmp_path / "huge.npz", {"x.npy": _header("<f8", (10**12,)) + bytes(64)})
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(NpzError) as info:
            read_npz(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 1.0
    assert peak < 1 << 20
    message = str(info.value)
    assert "huge.npz" in message and "\n" not in message
    assert "declaring shape (1000000000000,) of float64 (8000000000000 bytes) but holding 64 bytes" in message


def test_huge_declared_shape_in_a_deflated_member_is_refused(tmp_path: Path) -> None:
    path = _zip(
        tmp_path / "huge.npz", {"x.npy": _header("<f8", (10**12,)) + bytes(640)}, compression=zipfile.ZIP_DEFLATED
    )
    with pytest.raises(NpzError, match="8000000000000 bytes"):
        read_npz(path, allow_compressed=True)


def test_deflated_member_claiming_more_than_deflate_can_hold_is_refused(tmp_path: Path) -> None:
    path = _zip(tmp_path / "bomb.npz", {"x.npy": _npy(np.zeros(10_000))}, compression=zipfile.ZIP_DEFLATED)
    data = bytearray(path.read_bytes())
    # claim 2 GB uncompressed in the central directory (and the local header) of the ~100-byte member
    for signature, offset in ((b"PK\x01\x02", 24), (b"PK\x03\x04", 22)):
        at = data.index(signature) + offset
        data[at : at + 4] = struct.pack("<I", 2**31)
    path.write_bytes(bytes(data))
    with pytest.raises(NpzError, match="more than deflate can hold"):
        read_npz(path, allow_compressed=True)


def test_max_bytes_caps_what_is_allocated(tmp_path: Path) -> None:
    path = tmp_path / "a.npz"
    write_npz_atomic(path, {"x": np.zeros(100), "y": np.zeros(100)})
    assert len(read_npz(path, max_bytes=1600)) == 2
    with pytest.raises(NpzError, match="y.npy of 800 bytes, over the 799 bytes allowed"):
        read_npz(path, max_bytes=1599)


_UNPICKLED: list[str] = []


def _record_unpickle() -> str:
    _UNPICKLED.append("unpickled")
    return "payload"


class _Payload:
    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_record_unpickle, ())


def test_object_dtype_is_refused_and_never_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _zip(tmp_path / "obj.npz", {"x.npy": _npy(np.array([_Payload()], dtype=object))})
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    with pytest.raises(NpzError, match="x.npy with dtype object .*allow_pickle=False"):
        read_npz(path)
    assert _UNPICKLED == []


def test_object_dtype_is_refused_when_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'x' with dtype object"):
        write_npz_atomic(tmp_path / "a.npz", {"x": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(ValueError, match="structured"):
        write_npz_atomic(tmp_path / "a.npz", {"x": np.zeros(2, dtype=[("a", "<i4")])})
    with pytest.raises(ValueError, match="named 'file'"):
        write_npz_atomic(tmp_path / "a.npz", {"file": np.zeros(2)})
    assert list(tmp_path.iterdir()) == []


def _truncated(path: Path) -> None:
    write_npz_atomic(path, {"x": np.arange(1000.0)})
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _truncated_member(path: Path) -> None:
    _zip(path, {"x.npy": _npy(np.arange(10.0))[:-8]})  # the zip is whole, the member's array is short


def _flipped_data_byte(path: Path) -> None:
    write_npz_atomic(path, {"x": np.zeros(1000)})
    data = bytearray(path.read_bytes())
    data[data.index(bytes(64)) + 10] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (_truncated, "damaged or truncated"),
        (_truncated_member, "declaring shape (10,) of float64 (80 bytes) but holding 72 bytes"),
        (_flipped_data_byte, "damaged or truncated (Bad CRC-32"),
        (lambda p: p.write_bytes(b""), "is not a zip: an empty file"),
        (lambda p: p.write_bytes(_npy(np.arange(3))), "is not a zip: a single .npy array"),
        (lambda p: p.write_bytes(os.urandom(512).replace(b"PK", b"pk")), "is not a zip"),
        (lambda p: p.write_bytes(pickle.dumps({"x": [1, 2]})), "is not a zip"),
        (lambda p: _zip(p, {"x.txt": b"hello"}), "'x.txt', which is not an .npy array"),
        (lambda p: _zip(p, {"x.npy": _header("<f8", (-2, -4)) + bytes(64)}), "negative length"),
        (lambda p: _zip(p, {"x.npy": _header("<M8[s]", (1,)) + bytes(8)}), "dtype datetime64[s]"),
        (lambda p: _zip(p, {"x.npy": _header("|V8", (1,)) + bytes(8)}), "dtype |V8"),
        (lambda p: _zip(p, {"x.npy": b"\x93NUMPY\x03\x00" + bytes(20)}), "format (3, 0)"),
        (lambda p: _zip(p, {"x.npy": b"not an npy header at all"}), "cannot be read"),
    ],
)
def test_bad_files_are_refused_with_one_line_naming_the_file(tmp_path: Path, make: Any, why: str) -> None:
    path = tmp_path / "bad.npz"
    make(path)
    with pytest.raises(NpzError) as info:
        read_npz(path)
    message = str(info.value)
    assert str(path) in message and why in message and "\n" not in message


def test_duplicate_members_are_refused(tmp_path: Path) -> None:
    path = _zip(tmp_path / "dup.npz", {"x.npy": _npy(np.zeros(2))})
    with zipfile.ZipFile(path, "a") as zf, pytest.warns(UserWarning, match="Duplicate name"):
        zf.writestr("x.npy", _npy(np.ones(2)))
    with pytest.raises(NpzError, match="'x.npy' twice"):
        read_npz(path)


def test_a_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_npz(tmp_path / "absent.npz")


# ------------------------------------------------------------------------------------------- atomic write


def test_a_write_failing_midway_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.npz"
    write_npz_atomic(path, {"old": np.arange(5)})
    before = path.read_bytes()
    real = np.lib.format.write_array
    written: list[int] = []

    def failing_write_array(fp: Any, array: np.ndarray, *args: Any, **kwargs: Any) -> None:
        if written:  # the second array fails after the first is already in the file
            fp.write(b"\x93NUMPY partial")
            raise OSError(28, "No space left on device (simulated)")
        real(fp, array, *args, **kwargs)
        written.append(array.size)

    monkeypatch.setattr(np.lib.format, "write_array", failing_write_array)
    with pytest.raises(OSError, match="simulated"):
        write_npz_atomic(path, {"big": np.ones(200_000), "fails": np.zeros(3)})
    monkeypatch.undo()
    assert written == [200_000]
    assert path.read_bytes() == before
    assert list(read_npz(path)) == ["old"]
    assert _leftovers(tmp_path) == []


def test_an_interrupted_first_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(files.np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_npz_atomic(tmp_path / "sub" / "a.npz", {"x": np.zeros(3)})
    assert list((tmp_path / "sub").iterdir()) == []
