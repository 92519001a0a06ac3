"""Writing a file so that a crash never leaves half of it: temporary file, fsync, rename, fsync the folder.

Checkpoints, client-state files, the table journal and the partition cache all use
:func:`atomic_file`: a reader (or a process resumed after a crash) sees the old file or the new one,
never a mix; when the writer fails, the temporary file is removed and the old file is untouched.
Several processes writing the same path at once each write a whole file and the last rename wins.
Flower-free, numpy-free.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], mode: int = 0o644) -> Iterator[BinaryIO]:
    """Yield a binary file to write; on a clean exit it replaces ``path`` atomically and durably.

    The temporary file lives in the same folder (``.<name>.tmp-<pid>-<random>``), so the rename
    is atomic; missing parent folders are created. ``mode`` is the new file's permission bits.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode)
    replaced = False
    try:
        with os.fdopen(fd, "wb") as handle:
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
