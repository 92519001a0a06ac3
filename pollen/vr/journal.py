"""Keeping a memory-mapped stored-update table consistent with the run's last checkpoint.

A table on disk (``table-path``) is too big to copy into every checkpoint, so the checkpoint keeps
only its bookkeeping (keys, weights, running sum) and re-attaches the file. The file is written in
place during a round, so a crash between writing rows and writing the checkpoint would leave it one
round ahead. :class:`TableJournal` prevents that with two small files beside the table:

- ``<table>.journal.json``: the table's id (a random hex string made with the table) and its
  generation, the last round whose rows it holds, marked ``dirty`` while that round is being written;
- ``<table>.undo.npz``: before a round's rows are replaced, the encoded rows they overwrite.

On resume, :meth:`TableJournal.recover` compares the file's id and generation with the checkpoint's:
equal, the file is used; one round ahead with its undo log, the old rows are written back; anything
else (another run's table, a stale file, an undo log that does not fit the table) is refused with
one line. Writes are atomic (temporary file, fsync, rename); the undo log is read by
:func:`pollen.core.files.read_npz` (no pickle, sizes checked against its bytes before allocating).
"""

from __future__ import annotations

import json
import os
import secrets
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
        """Bring the attached file back to ``generation`` (the checkpoint's) or refuse it."""
        marker = self._read()
        if marker["table_id"] != self.table_id:
            raise TableFileError(
                f"table file {self.table_path} belongs to table {marker['table_id']}, the checkpoint to {self.table_id}"
            )
        found = int(marker["generation"])
        if found == generation and not marker["dirty"]:
            return
        if found == generation + 1 and self.undo_path.is_file():
            undo = self._read_undo(table)
            if int(undo["generation"]) == found:
                table.write_rows([int(r) for r in undo["rows"]], undo["data"])
                self.commit(table, generation)
                return
        raise TableFileError(
            f"table file {self.table_path} holds round {found}{' (half written)' if marker['dirty'] else ''}, "
            f"the checkpoint round {generation}; "
            "allowed: the file of this checkpoint or one round ahead with its undo log"
        )

    def verify(self, generation: int, row_width: int, storage_dtype: np.dtype, known_clients: int) -> None:
        """``TableFileError`` unless :meth:`recover` would accept the file for ``generation`` (reads only).

        ``row_width``, ``storage_dtype`` and ``known_clients`` describe the table the state declares; an undo
        log is read (its shapes checked against them before anything is allocated) when it would be used.
        """
        marker = self._read()
        if marker["table_id"] != self.table_id:
            raise TableFileError(
                f"table file {self.table_path} belongs to table {marker['table_id']}, the checkpoint to {self.table_id}"
            )
        found = int(marker["generation"])
        if found == generation and not marker["dirty"]:
            return
        if found == generation + 1 and self.undo_path.is_file():
            shape = _TableShape(row_width, np.dtype(storage_dtype), known_clients)
            if int(self._read_undo(shape)["generation"]) == found:
                return
        raise TableFileError(
            f"table file {self.table_path} holds round {found}{' (half written)' if marker['dirty'] else ''}, "
            f"the checkpoint round {generation}; "
            "allowed: the file of this checkpoint or one round ahead with its undo log"
        )

    # ------------------------------------------------------------------ files
    def _write(self, generation: int, *, dirty: bool) -> None:
        text = json.dumps({"table_id": self.table_id, "generation": int(generation), "dirty": bool(dirty)})
        write_bytes_atomically(self.journal_path, text.encode())

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
        return undo

    def check(self) -> None:
        """``TableFileError`` unless the table file has a usable journal (before a file is attached)."""
        self._read()

    def _read(self) -> dict:
        try:
            marker = json.loads(self.journal_path.read_text())
            if not isinstance(marker, dict) or not isinstance(marker.get("table_id"), str):
                raise ValueError("not a journal")
            int(marker["generation"])
            marker["dirty"] = bool(marker.get("dirty", False))
            return marker
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise TableFileError(
                f"table file {self.table_path} has no usable journal ({err}); it cannot be trusted"
            ) from None
