"""Keeping a memory-mapped stored-update table consistent with the run's last checkpoint.

A table on disk (``table-path``) is too big to copy into every checkpoint, so the checkpoint keeps
only its bookkeeping (keys, weights, running sum) and re-attaches the file. The file is written in
place during a round, so a crash between writing rows and writing the checkpoint would leave it one
round ahead. :class:`TableJournal` prevents that with two small files beside the table:

- ``<table>.journal.json``: the table's id (a random hex string made with the table) and its
  generation, the last round whose rows it holds, marked ``dirty`` while that round is being written,
  and the CRC-32 of those fields; the file is exactly their canonical JSON, so a changed byte anywhere in
  it is refused;
- ``<table>.undo.npz``: before a round's rows are replaced, the encoded rows they overwrite.

On resume, :meth:`TableJournal.verify` compares the file's id and generation with the checkpoint's:
equal, the file is used; one round ahead with its undo log, the old rows are written back
(:meth:`TableJournal.recover`); anything else (another run's table, a stale file, a journal that is
not exactly what was written, an undo log that does not fit the table) is refused with one line. The
rows themselves, the undo log's included, are checked against the checkpoint's per-row CRC-32s before
anything is attached (:func:`pollen.vr.table_state.check_rows_file`, with the undo log's rows in place
of the file's). Writes are atomic (temporary file, fsync, rename); the undo log is read by
:func:`pollen.core.files.read_npz` (no pickle, sizes checked against its bytes before allocating).
"""

from __future__ import annotations

import json
import os
import secrets
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pollen.core.files import (
    NpzError,
    read_npz,
    write_bytes_atomically,
    write_npz_atomic,
)
from pollen.vr.table import UpdateTable


@dataclass(frozen=True)
class _TableShape:
    """What :meth:`TableJournal._read_undo` needs to know of a table before the table exists."""

    row_width: int
    storage_dtype: np.dtype
    known_clients: int


#: The fields of a journal, in the order they are written (``crc32``: of the others' canonical JSON).
JOURNAL_FIELDS = ("table_id", "generation", "dirty", "crc32")
#: A journal is a few dozen bytes; a larger file is not one (and is not read).
_MAX_JOURNAL_BYTES = 1024


class TableFileError(ValueError):
    """A table file that does not belong to the state being restored (one line saying why)."""


class TableJournal:
    """Generation marker and undo log of one memory-mapped table file."""

    def __init__(self, table_path: str | os.PathLike[str], table_id: str | None = None) -> None:
        self.table_path = Path(table_path)
        self.journal_path = Path(f"{self.table_path}.journal.json")
        self.undo_path = Path(f"{self.table_path}.undo.npz")
        self.table_id = table_id or secrets.token_hex(8)

    # ------------------------------------------------------------------ while running
    def begin(self, table: UpdateTable, generation: int, keys: Sequence[str]) -> None:
        """Before round ``generation`` replaces the rows of ``keys``: save them, mark the file dirty."""
        rows = table.row_indices(keys)
        undo = {
            "generation": np.array(generation, np.int64),
            "rows": np.array(rows, np.int64),
            "data": table.read_rows(rows),
        }
        write_npz_atomic(self.undo_path, undo)
        self._write(generation, dirty=True)

    def commit(self, table: UpdateTable, generation: int) -> None:
        """Round ``generation``'s rows are in the file: flush it and mark it clean."""
        table.flush()
        self._write(generation, dirty=False)

    # ------------------------------------------------------------------ on resume
    def recover(self, table: UpdateTable, generation: int) -> None:
        """Bring the attached file back to ``generation`` (the checkpoint's) or refuse it (:meth:`verify`)."""
        undo = self.verify(generation, table.row_width, table.storage_dtype, table.known_clients)
        if undo is not None:
            if undo:
                table.write_rows(list(undo), np.stack(list(undo.values())))
            self.commit(table, generation)

    def verify(
        self, generation: int, row_width: int, storage_dtype: np.dtype, known_clients: int
    ) -> dict[int, np.ndarray] | None:
        """``TableFileError`` unless :meth:`recover` would accept the file for ``generation`` (reads only).

        ``row_width``, ``storage_dtype`` and ``known_clients`` describe the table the state declares; an undo
        log is read (its shapes checked against them before anything is allocated) when it would be used.
        Returns the rows :meth:`recover` writes back (row -> encoded row; None when the file is at
        ``generation``), for the caller to check against the state's row checksums before it attaches.
        """
        marker = self._read()
        if marker["table_id"] != self.table_id:
            raise TableFileError(
                f"table file {self.table_path} belongs to table {marker['table_id']}, the checkpoint to {self.table_id}"
            )
        found = marker["generation"]
        if found == generation and not marker["dirty"]:
            return None
        if found == generation + 1 and self.undo_path.is_file():
            undo = self._read_undo(_TableShape(row_width, np.dtype(storage_dtype), known_clients))
            if int(undo["generation"]) == found:
                return {int(r): row for r, row in zip(undo["rows"], undo["data"])}
        raise TableFileError(
            f"table file {self.table_path} holds round {found}{' (half written)' if marker['dirty'] else ''}, "
            f"the checkpoint round {generation}; "
            "allowed: the file of this checkpoint or one round ahead with its undo log"
        )

    # ------------------------------------------------------------------ files
    def _write(self, generation: int, *, dirty: bool) -> None:
        write_bytes_atomically(self.journal_path, _journal_bytes(self.table_id, int(generation), bool(dirty)))

    def _read_undo(self, table: UpdateTable | _TableShape) -> dict[str, np.ndarray]:
        """The undo log, its shapes checked against ``table`` before anything is allocated (no pickle)."""
        spec = {
            "generation": ((), np.int64),
            "rows": ((None,), np.int64),
            "data": ((None, table.row_width), table.storage_dtype),
        }
        try:
            undo = read_npz(self.undo_path, expected=spec)
        except (NpzError, OSError) as err:
            raise TableFileError(f"table file {self.table_path} has an unusable undo log ({err})") from None
        rows = undo["rows"]
        if len(rows) != len(undo["data"]) or (len(rows) and (rows.min() < 0 or rows.max() >= table.known_clients)):
            raise TableFileError(f"table file {self.table_path} has an undo log whose rows do not fit the table")
        if len(np.unique(rows)) != len(rows):
            raise TableFileError(f"table file {self.table_path} has an undo log that lists a row twice")
        return undo

    def check(self) -> None:
        """``TableFileError`` unless the table file has a usable journal (before a file is attached)."""
        self._read()

    def _read(self) -> dict:
        """The journal's fields, each checked, the file exactly what :meth:`_write` writes for them."""
        try:
            if self.journal_path.stat().st_size > _MAX_JOURNAL_BYTES:
                raise ValueError(f"more than {_MAX_JOURNAL_BYTES} bytes")
            raw = self.journal_path.read_bytes()
            marker = json.loads(raw)
            if not isinstance(marker, dict) or sorted(marker) != sorted(JOURNAL_FIELDS):
                raise ValueError(f"its fields are not {', '.join(JOURNAL_FIELDS)}")
            table_id, generation, dirty = marker["table_id"], marker["generation"], marker["dirty"]
            if not isinstance(table_id, str) or not 0 < len(table_id) <= 64:
                raise ValueError("its table_id is not a str of 1 to 64 characters")
            if type(generation) is not int or generation < 0 or type(dirty) is not bool:
                raise ValueError("its generation is not a whole number >= 0 or dirty not true / false")
            if raw != _journal_bytes(table_id, generation, dirty):
                raise ValueError("it is not the journal written for its fields (a byte changed)")
            return marker
        except (OSError, ValueError, UnicodeDecodeError) as err:
            raise TableFileError(
                f"table file {self.table_path} has no usable journal {self.journal_path.name} ({err}); "
                "it cannot be trusted"
            ) from None


def _journal_bytes(table_id: str, generation: int, dirty: bool) -> bytes:
    """The journal of these fields: their JSON in a fixed form plus the CRC-32 of it, as JSON."""
    body = {"table_id": table_id, "generation": generation, "dirty": dirty}
    crc = zlib.crc32(json.dumps(body, separators=(",", ":")).encode())
    return json.dumps({**body, "crc32": crc}, separators=(",", ":")).encode()
