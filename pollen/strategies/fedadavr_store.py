"""FedAdaVR's stored-update table as one part of a strategy: the table, its crash journal, its generation.

:class:`StoredUpdates` builds the :class:`~pollen.vr.table.UpdateTable` when the model's layout is
known, writes a round's staged rows after the server step (through the journal when the table lives
in a file, so a crash between the table write and the checkpoint can be undone), and saves and
restores itself as one part of the strategy's state. A table in a file is not copied into the
checkpoint: the checkpoint records its id and each row's CRC-32, and resume reads every row of the
file against them before it attaches the file, so a changed byte is refused, not loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pollen.core import state_fields as fields
from pollen.core.layout import ModelLayout
from pollen.vr import table_state as saved_tables
from pollen.vr.aggregate import VRRound
from pollen.vr.journal import TableFileError, TableJournal
from pollen.vr.row_codec import RowCodec
from pollen.vr.table import UpdateTable


class TableFileRefused(fields.StateError, TableFileError):
    """A table file that does not belong to the state being restored, named as a state field."""


class StoredUpdates:
    """Every client's latest update, in RAM or in a memory-mapped file.

    Parameters
    ----------
    precision : str
        Storage precision of the rows (``fp32``, ``fp16``, ``int8``, ``int4``).
    path : str | None
        File of a memory-mapped table; ``None`` keeps it in RAM (and in checkpoints).
    """

    def __init__(self, precision: str, path: str | None) -> None:
        self.precision = precision
        self.path = path
        self.table: UpdateTable | None = None
        self.journal: TableJournal | None = None
        self.generation = 0

    def ensure(self, layout: ModelLayout) -> None:
        """Build the empty table for ``layout`` (once; a loaded table is kept)."""
        if self.table is not None:
            return
        sizes = [stop - start for start, stop in layout.segments]
        self.table = UpdateTable(layout.dim, sizes, self.precision, path=self.path)
        if self.path is not None:
            self.journal = TableJournal(self.path)
            self.journal.commit(self.table, 0)

    @property
    def known_clients(self) -> int:
        return self.table.known_clients if self.table is not None else 0

    def write(self, server_round: int, vr_round: VRRound) -> None:
        """Write ``vr_round``'s staged rows (after a committed server step) and advance the generation."""
        if self.journal is not None:  # a table on disk: keep the rows it overwrites until the checkpoint
            self.journal.begin(self.table, server_round, list(vr_round.staged))
        vr_round.commit()
        if self.journal is not None:
            self.journal.commit(self.table, server_round)
        self.generation = server_round

    def state_dict(self) -> dict[str, Any]:
        """The table (its rows when it lives in RAM, else their CRC-32s), its generation and the file's id."""
        if self.table is None:
            return {}
        state: dict[str, Any] = {
            "table": self.table.state_dict(include_data=self.path is None),
            "generation": self.generation,
        }
        if self.journal is not None:
            state["table_id"] = self.journal.table_id
        return state

    def load_state_dict(
        self,
        state: dict[str, Any],
        layout: ModelLayout | None = None,
        *,
        where: str = "store",
        last_round: int | None = None,
    ) -> None:
        """Restore the table (see :meth:`prepare_load`); nothing changes when it is refused."""
        self.prepare_load(state, layout, where=where, last_round=last_round)()

    def prepare_load(
        self, state: Any, layout: ModelLayout | None, *, where: str = "store", last_round: int | None = None
    ) -> Callable[[], None]:
        """Check a saved store against the model's ``layout`` and return what makes it this store's.

        Every table field is checked (:meth:`UpdateTable.check_state`; the running sum against the rows
        of a table kept in the checkpoint), the generation within the run (``last_round``), and a table
        that lives in a file against its journal (same table id, this round or one ahead with its undo
        log: :meth:`TableJournal.verify`) and every row of the file, the undo log's rows in place of
        those it restores, against the checkpoint's CRC-32 of that row
        (:func:`pollen.vr.table_state.check_rows_file`). The file is only attached, and an undo log
        applied, by the returned commit.
        """
        fields.mapping(state, where)
        if not state and layout is None:
            return lambda: None
        if layout is None:
            raise fields.StateError(where, "holds a table but the state has no model; expected both or neither")
        on_disk = "table" in state and isinstance(state["table"], dict) and "data" not in state["table"]
        fields.mapping(state, where, keys=("table", "generation", "table_id") if on_disk else ("table", "generation"))
        high = fields.MAX_COUNT if last_round is None else last_round
        generation = fields.whole(state["generation"], fields.join(where, "generation"), high=high)
        sizes = [stop - start for start, stop in layout.segments]
        table_where = fields.join(where, "table")
        table_state = saved_tables.check_state(
            state["table"], table_where, dim=layout.dim, segments=sizes, precision=self.precision
        )
        count = len(table_state["keys"])
        if not on_disk:
            table = UpdateTable.from_state_dict(table_state, _checked=True)  # in RAM, sized by the rows held
            journal = None
            if self.path is not None:  # the checkpoint's rows go into this run's file, with a new journal

                def commit() -> None:
                    self.table = UpdateTable.from_state_dict(table_state, path=self.path, _checked=True)
                    self.journal = TableJournal(self.path)
                    self.journal.commit(self.table, generation)
                    self.generation = generation

                return commit

            def commit_ram() -> None:
                self.table, self.journal, self.generation = table, journal, generation

            return commit_ram
        if self.path is None:
            raise fields.StateError(
                table_where, "lives in a file; pass table_path= (run-config table-path) to resume it"
            )
        table_id = fields.text(state["table_id"], fields.join(where, "table_id"), most=64)
        journal = TableJournal(self.path, table_id=table_id)
        codec = RowCodec(layout.dim, sizes, self.precision)
        need = count * codec.width * codec.dtype.itemsize
        held = os.path.getsize(self.path) if os.path.isfile(self.path) else -1
        if held < need:
            raise fields.StateError(
                table_where, f"needs {need} bytes of rows in {self.path}, which holds {max(held, 0)}"
            )
        try:
            undo = journal.verify(generation, codec.width, codec.dtype, count)
        except TableFileError as err:
            raise TableFileRefused(fields.join(where, "table_id"), str(err)) from None
        try:
            saved_tables.check_rows_file(
                self.path, codec, table_state, table_where, overlay=undo, overlay_name=str(journal.undo_path)
            )
        except fields.StateError as err:
            raise TableFileRefused(err.field, err.why) from None

        def commit_file() -> None:
            self.journal = journal
            self.table = UpdateTable.from_state_dict(table_state, path=self.path, _checked=True)
            journal.recover(self.table, generation)
            self.generation = generation

        return commit_file
