"""Files pollen writes and reads back: written atomically, read without pickle and without trusting sizes.

Writing (:func:`atomic_file`, :func:`write_bytes_atomically`, :func:`write_npz_atomic`): temporary file in
the same folder, fsync, rename, fsync the folder. A reader (or a process resumed after a crash) sees the
old file or the new one, never a mix; when the writer fails, the temporary file is removed and the old
file is untouched. Several processes writing the same path at once each write a whole file and the last
rename wins.

Reading (:func:`read_npz`): an ``.npz`` file a run-config can point at (a checkpoint, a client's state
file, the stored-update table and its undo log, the partition cache) is untrusted input. ``np.load`` on
such a file is not enough even with ``allow_pickle=False``: reading a zip member allocates an array of
the shape its ``.npy`` header *declares* before a single data byte is read, so a 200-byte file declaring
``(10**12,)`` float64 asks for 8 TB. :func:`read_npz` opens the zip itself and, for every member, reads
the header, refuses ``object`` (pickled), structured, void, datetime and zero-width dtypes, checks the
declared shape x itemsize against the member's real size in the file (and an optional cap) and only then
allocates and reads; the zip's CRC is checked on the way.

The checkpoint, client-state, table, journal and partition-cache writers all produce plain uncompressed
``np.savez`` archives, and :func:`read_npz` refuses compressed members unless asked
(``allow_compressed=True``, for the deflated Fashion-MNIST subset pollen ships): a deflated member's
real size is only known by inflating it, so it is bounded by deflate's maximum ratio instead.

Flower-free: numpy and the standard library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import secrets
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, BinaryIO

import numpy as np

__all__ = [
    "NpzError",
    "atomic_file",
    "fsync_directory",
    "npz_dtype_problem",
    "read_npz",
    "sha256_of",
    "write_bytes_atomically",
    "write_npz_atomic",
]


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], mode: int = 0o644) -> Iterator[BinaryIO]:
    """Yield a binary file to write (and read back); on a clean exit it replaces ``path`` atomically and durably.

    The temporary file lives in the same folder (``.<name>.tmp-<pid>-<random>``), so the rename
    is atomic; missing parent folders are created. ``mode`` is the new file's permission bits.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode)
    replaced = False
    try:
        with os.fdopen(fd, "w+b") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        replaced = True
    finally:
        if not replaced:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    fsync_directory(final.parent)


def write_bytes_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """``path`` holds exactly ``data`` afterwards, or its old content if this fails."""
    with atomic_file(path) as handle:
        handle.write(data)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename in ``directory`` durable where the platform allows it (best effort)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------- npz

#: dtype kinds an ``.npz`` of pollen's may hold: bool, integers, floats, complex, fixed-width str / bytes.
NPZ_KINDS = frozenset("biufcUS")
NPZ_KINDS_TEXT = "numeric, bool or fixed-width str/bytes arrays"
#: Deflate never expands more than about 1032:1, so a deflated member of ``n`` bytes holds at most this much.
_DEFLATE_MAX_RATIO = 1033
_ZIP_MAGIC = b"PK\x03\x04"
_NPY_MAGIC = b"\x93NUMPY"
_CHUNK = 1 << 24  # bytes read per call while filling an array
#: Names ``np.savez`` takes as its own arguments, so no member can have them.
_SAVEZ_RESERVED = frozenset({"file", "allow_pickle"})
# What the standard library and numpy raise on a damaged file; anything else is a bug and propagates.
_READ_ERRORS = (ValueError, EOFError, OSError, RuntimeError, OverflowError, struct.error, zlib.error)

#: ``expected`` entry: (shape with ``None`` for "any length", dtype or ``None`` for any allowed dtype).
ArraySpec = tuple[Sequence[int | None] | None, Any]


class NpzError(ValueError):
    """An ``.npz`` file that cannot be used: ``str()`` is one line naming the file, :attr:`why` the rest."""

    def __init__(self, source: str, why: str) -> None:
        self.source = source
        self.why = " ".join(why.split())
        super().__init__(f"{source} {self.why}")


def npz_dtype_problem(dtype: np.dtype) -> str | None:
    """Why arrays of ``dtype`` are not stored in pollen's ``.npz`` files, or None if they can be."""
    if dtype.hasobject and dtype.names is None:
        return f"dtype {dtype} (pickled Python objects are never loaded: allow_pickle=False)"
    if dtype.names is not None or dtype.subdtype is not None:
        return f"structured dtype {dtype}"
    if dtype.kind not in NPZ_KINDS:
        return f"dtype {dtype}"
    if dtype.itemsize == 0:
        return f"zero-width dtype {dtype}"
    return None


def write_npz_atomic(
    path: str | os.PathLike[str],
    arrays: Mapping[str, Any],
    *,
    mode: int = 0o644,
    before_replace: Callable[[str], None] | None = None,
) -> int:
    """Write ``arrays`` as an uncompressed ``.npz`` (``np.savez``'s format) at exactly ``path``, atomically.

    Every array is checked first (a dtype :func:`read_npz` would refuse raises ``ValueError`` before any
    file or folder is touched); a failure while writing leaves the old file as it was (see
    :func:`atomic_file`). Arrays are streamed, not copied (a memory-mapped table is written row block by
    row block). ``mode`` is the new file's permission bits. ``before_replace`` is called with the sha256
    (hex) of the complete new file before it replaces ``path`` (to record the digest of what is about to
    be there); if it raises, ``path`` is left as it was. Returns the size of the file written.
    """
    checked: dict[str, Any] = {}
    for name, value in arrays.items():
        if not isinstance(name, str) or name in _SAVEZ_RESERVED or "\x00" in name:
            raise ValueError(f"cannot store an array named {name!r} in an .npz file")
        array = np.asanyarray(value)
        reason = npz_dtype_problem(array.dtype)
        if reason is not None or isinstance(array, np.ma.MaskedArray):
            why = reason or "a masked array"
            raise ValueError(f"cannot store array {name!r} with {why}; allowed: {NPZ_KINDS_TEXT}")
        checked[name] = value
    with atomic_file(path, mode) as handle:
        np.savez(handle, **checked)
        handle.flush()
        if before_replace is not None:
            handle.seek(0)
            before_replace(sha256_of(handle))
        return os.fstat(handle.fileno()).st_size


def sha256_of(source: str | os.PathLike[str] | IO[bytes]) -> str:
    """The sha256 (hex) of a file's bytes: a path, or a binary file read from where it stands to its end."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as handle:
            return sha256_of(handle)
    digest = hashlib.sha256()
    while chunk := source.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def read_npz(
    source: str | os.PathLike[str] | IO[bytes],
    *,
    expected: Mapping[str, ArraySpec] | None = None,
    max_bytes: int | None = None,
    allow_compressed: bool = False,
) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file, each member checked against its real bytes before it is allocated.

    Parameters
    ----------
    source
        A path, or a binary file opened for reading that can seek (it is not closed).
    expected
        If given, the file must hold exactly these members (names without ``.npy``), each with the given
        shape (``None`` for any shape; a ``None`` dimension for any length) and dtype (``None`` for any
        allowed dtype, else compared exactly, byte order included). Checked from the headers, before
        anything is allocated.
    max_bytes
        If given, the most array bytes (all members together) this call may allocate.
    allow_compressed
        Accept deflated members (``np.savez_compressed``); off by default: pollen writes uncompressed files.

    Returns
    -------
    dict
        Member name (without ``.npy``) -> array, in the file's order: writable, dtype (byte order included)
        and shape as saved, C- or Fortran-ordered as saved.

    Raises
    ------
    NpzError
        The file is not a usable ``.npz`` (not a zip, truncated, damaged, duplicate or non-``.npy``
        members, compressed or encrypted members, a refused dtype, a header whose shape its bytes do not
        cover, over ``max_bytes``, not what ``expected`` says). One line naming the file.
    OSError
        ``source`` is a path that cannot be opened (missing, a folder, no permission).
    """
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        with open(name, "rb") as handle:
            return _read_npz(handle, name, expected, max_bytes, allow_compressed)
    return _read_npz(source, str(getattr(source, "name", "<file>")), expected, max_bytes, allow_compressed)


def _read_npz(
    handle: IO[bytes], name: str, expected: Mapping[str, ArraySpec] | None, max_bytes: int | None, compressed: bool
) -> dict[str, np.ndarray]:
    try:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(0)
        head = handle.read(len(_NPY_MAGIC))
        if not head.startswith(_ZIP_MAGIC):
            what = "a single .npy array, not an .npz archive" if head == _NPY_MAGIC else "not an .npz archive"
            raise NpzError(name, f"is not a zip: {'an empty file' if not head else what}")
        handle.seek(0)
        with zipfile.ZipFile(handle) as zf:
            return _NpzReader(zf, size, name, max_bytes, compressed).read_all(expected)
    except NpzError:
        raise
    except zipfile.BadZipFile as exc:
        raise NpzError(name, f"is damaged or truncated ({exc})") from exc
    except _READ_ERRORS as exc:
        raise NpzError(name, f"cannot be read ({type(exc).__name__}: {exc})") from exc


class _NpzReader:
    """The members of one open ``.npz`` zip, each read after its sizes are checked against the file."""

    def __init__(self, zf: zipfile.ZipFile, file_size: int, name: str, max_bytes: int | None, compressed: bool) -> None:
        self.zf = zf
        self.file_size = file_size
        self.name = name
        self.budget = max_bytes
        self.compressed = compressed

    def bad(self, why: str) -> NpzError:
        return NpzError(self.name, why)

    def read_all(self, expected: Mapping[str, ArraySpec] | None) -> dict[str, np.ndarray]:
        infos: dict[str, zipfile.ZipInfo] = {}
        for info in self.zf.infolist():
            if not info.filename.endswith(".npy"):
                raise self.bad(f"has member {info.filename!r}, which is not an .npy array")
            key = info.filename[: -len(".npy")]
            if key in infos:
                raise self.bad(f"has member {info.filename!r} twice")
            infos[key] = info
        if expected is not None and set(infos) != set(expected):
            raise self.bad(f"holds {sorted(infos)}, expected {sorted(expected)}")
        return {key: self.member(info, None if expected is None else expected[key]) for key, info in infos.items()}

    def member(self, info: zipfile.ZipInfo, spec: ArraySpec | None) -> np.ndarray:
        self.check_zip_entry(info)
        with self.zf.open(info) as fp:
            shape, fortran, dtype = self.check_npy_header(fp, info, spec)
            count = math.prod(shape)
            flat = np.empty(count, dtype=dtype)
            self.fill(fp, flat.view(np.uint8), info)
            if fp.read(1):  # also makes zipfile check the member's CRC
                raise self.bad(f"has member {info.filename} with bytes after its array")
        if fortran:
            return flat.reshape(shape[::-1]).transpose()
        return flat.reshape(shape)

    def check_zip_entry(self, info: zipfile.ZipInfo) -> None:
        if info.flag_bits & 0x1:
            raise self.bad(f"has an encrypted member {info.filename}")
        if info.compress_type == zipfile.ZIP_STORED:
            if info.compress_size != info.file_size:
                raise self.bad(f"has member {info.filename} whose stored and real sizes differ")
        elif info.compress_type == zipfile.ZIP_DEFLATED and self.compressed:
            if info.file_size > info.compress_size * _DEFLATE_MAX_RATIO + 1024:
                raise self.bad(
                    f"has member {info.filename} declaring {info.file_size} bytes inflated from "
                    f"{info.compress_size}, more than deflate can hold"
                )
        else:
            raise self.bad(f"has a compressed member {info.filename}; this file must be an uncompressed .npz")
        if info.header_offset + info.compress_size > self.file_size:
            raise self.bad(f"has member {info.filename} of {info.compress_size} bytes, more than the file holds")

    def check_npy_header(
        self, fp: IO[bytes], info: zipfile.ZipInfo, spec: ArraySpec | None
    ) -> tuple[tuple[int, ...], bool, np.dtype]:
        """Read the ``.npy`` header; refuse a bad dtype, or a shape the member's bytes do not cover."""
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise self.bad(f"has member {info.filename} in .npy format {version}; allowed: 1.0 or 2.0")
        reason = npz_dtype_problem(dtype)
        if reason is not None:
            raise self.bad(f"has member {info.filename} with {reason}; allowed: {NPZ_KINDS_TEXT}")
        shape = tuple(shape)
        if any(n < 0 for n in shape):
            raise self.bad(f"has member {info.filename} declaring shape {shape} with a negative length")
        declared, held = math.prod(shape) * dtype.itemsize, info.file_size - fp.tell()
        if declared != held:
            raise self.bad(
                f"has member {info.filename} declaring shape {shape} of {dtype} ({declared} bytes) "
                f"but holding {held} bytes"
            )
        if spec is not None:
            self.check_spec(info, shape, dtype, spec)
        if self.budget is not None:
            if declared > self.budget:
                raise self.bad(f"has member {info.filename} of {declared} bytes, over the {self.budget} bytes allowed")
            self.budget -= declared
        return shape, bool(fortran), dtype

    def check_spec(self, info: zipfile.ZipInfo, shape: tuple[int, ...], dtype: np.dtype, spec: ArraySpec) -> None:
        want_shape, want_dtype = spec
        if want_shape is not None and (
            len(want_shape) != len(shape) or any(w is not None and w != n for w, n in zip(want_shape, shape))
        ):
            want = (
                "("
                + ", ".join("N" if w is None else str(w) for w in want_shape)
                + ("," if len(want_shape) == 1 else "")
                + ")"
            )
            raise self.bad(f"has member {info.filename} of shape {shape}, expected {want}")
        if want_dtype is not None and dtype != np.dtype(want_dtype):
            raise self.bad(f"has member {info.filename} of dtype {dtype}, expected {np.dtype(want_dtype)}")

    def fill(self, fp: IO[bytes], out: np.ndarray, info: zipfile.ZipInfo) -> None:
        view = memoryview(out)
        done, total = 0, len(view)
        while done < total:
            n = fp.readinto(view[done : done + _CHUNK])  # type: ignore[attr-defined]
            if not n:
                raise self.bad(f"has member {info.filename} that ends after {done} of its {total} bytes")
            done += n
