"""The server's per-client bookkeeping for the lazy family: named vectors per client, in FedAdaVR's table storage.

Each kind of vector (the last upload ``ref_i``, the model mirror ``x_i``, the last downlink vector
``c_prev_i``, Variant C's model error ``E_i``) is one :class:`~pollen.vr.table.UpdateTable`: rows keyed
by the stable client id, in RAM or memory-mapped under ``directory`` (so N x d beyond RAM still runs and
memory is known: :meth:`ClientBook.memory_bytes`). Only clients that took part own rows; a round touches
the rows of its sampled clients only, so its cost does not grow with N.

The copies must equal the clients' own bit for bit (the client checks a checksum of them), so the tables
are float32: a lossy precision would break that agreement and is refused. A checkpoint (``state_dict``)
copies the rows of every client seen; for a memory-mapped book far beyond RAM that copy is the limit
(FedAdaVR's table journals its file instead; the book does not yet).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pollen.core import state_fields as fields
from pollen.vr.table import UpdateTable
from pollen.vr.table_state import check_state as check_table_state

#: The vectors the server may keep per client (one table each).
TABLES = ("up-ref", "x", "c-prev", "error")


class ClientBook:
    """Per-client float32 vectors of length ``dim``, one table per kind, with presence tracked per kind.

    A client "has" a vector of a kind once it was put and until it is forgotten (a forgotten client's
    row stays allocated and is overwritten when it returns).
    """

    def __init__(
        self, dim: int, *, directory: str | os.PathLike[str] | None = None, kinds: tuple[str, ...] = TABLES
    ) -> None:
        unknown = sorted(set(kinds) - set(TABLES))
        if unknown:
            raise ValueError(f"bookkeeping kinds {unknown} are unknown; allowed: {', '.join(TABLES)}")
        self.dim = int(dim)
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.tables = {kind: UpdateTable(self.dim, precision="fp32", path=self._path(kind)) for kind in kinds}
        self.present: dict[str, set[str]] = {kind: set() for kind in kinds}

    def _path(self, kind: str) -> str | None:
        return None if self.directory is None else str(self.directory / f"{kind}.f32")

    def has(self, kind: str, key: str) -> bool:
        return key in self.present[kind]

    def get(self, kind: str, key: str) -> np.ndarray | None:
        """A float32 copy of ``key``'s vector of ``kind``, or ``None`` when it has none."""
        return self.tables[kind].get(key) if key in self.present[kind] else None

    def put(self, kind: str, key: str, vector: np.ndarray | None) -> None:
        """Store ``vector`` (``None`` forgets it)."""
        if vector is None:
            self.present[kind].discard(key)
            return
        self.tables[kind].replace(key, np.asarray(vector, dtype=np.float32), 0.0)
        self.present[kind].add(key)

    def forget(self, key: str) -> None:
        """Drop every vector of ``key`` (the next contact starts from scratch: full model, no reference)."""
        for present in self.present.values():
            present.discard(key)

    def clients(self, kind: str) -> int:
        return len(self.present[kind])

    def memory_bytes(self) -> int:
        """Bytes the tables hold (data, in RAM or on disk, plus their small per-row arrays)."""
        return sum(table.memory_bytes() for table in self.tables.values())

    def state_dict(self) -> dict[str, Any]:
        return {
            "tables": {kind: table.state_dict() for kind, table in self.tables.items()},
            "present": {kind: sorted(keys) for kind, keys in self.present.items()},
        }

    def load_state_dict(self, state: dict[str, Any], where: str = "book") -> None:
        """Restore what :meth:`state_dict` wrote (see :meth:`prepare_load`); nothing changes when it is refused."""
        self.prepare_load(state, where)()

    def prepare_load(
        self, state: Any, where: str = "book", *, layout: Any = None, last_round: int | None = None
    ) -> Callable[[], None]:
        """Check a saved book and return what makes it this book's: one table per kind this book keeps,
        each a float32 table of ``dim`` (every field checked, rows finite), and the clients present per
        kind owning a row of that kind's table."""
        fields.mapping(state, where, keys=("tables", "present"))
        tables_where, present_where = fields.join(where, "tables"), fields.join(where, "present")
        saved = fields.mapping(state["tables"], tables_where, keys=tuple(self.tables))
        checked = {
            kind: check_table_state(
                saved[kind],
                fields.join(tables_where, kind),
                dim=self.dim,
                segments=[self.dim],
                precision="fp32",
                need_data=True,
            )
            for kind in self.tables
        }
        present_saved = fields.mapping(state["present"], present_where, keys=tuple(self.tables))
        present: dict[str, set[str]] = {}
        for kind in self.tables:
            kind_where = fields.join(present_where, kind)
            keys = {
                fields.text(key, fields.join(kind_where, i))
                for i, key in enumerate(fields.sequence(present_saved[kind], kind_where))
            }
            rows = set(checked[kind]["keys"].tolist())
            if not keys <= rows:
                raise fields.StateError(kind_where, f"names client {sorted(keys - rows)[0]!r}, which has no row")
            present[kind] = keys

        def commit() -> None:
            for kind, table_state in checked.items():
                self.tables[kind] = UpdateTable.from_state_dict(table_state, path=self._path(kind))
            self.present = present

        return commit
