"""FedAdaVR's stored-update table as one part of a strategy: the table, its crash journal, its generation.

:class:`StoredUpdates` builds the :class:`~pollen.vr.table.UpdateTable` when the model's layout is
known, writes a round's staged rows after the server step (through the journal when the table lives
in a file, so a crash between the table write and the checkpoint can be undone), and saves and
restores itself as one part of the strategy's state.
"""

from __future__ import annotations

from typing import Any

from pollen.core.layout import ModelLayout
from pollen.vr.aggregate import VRRound
from pollen.vr.journal import TableJournal
from pollen.vr.table import UpdateTable


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
        """The table (its data only when it lives in RAM), its generation and the file's journal id."""
        if self.table is None:
            return {}
        state: dict[str, Any] = {
            "table": self.table.state_dict(include_data=self.path is None),
            "generation": self.generation,
        }
        if self.journal is not None:
            state["table_id"] = self.journal.table_id
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the table; a file-backed one must be this state's file, at this state's round."""
        if "table" not in state:
            return
        self.generation = int(state.get("generation", 0))
        on_disk = "data" not in state["table"]
        if on_disk and self.path is None:
            raise ValueError("the state's table lives in a file; pass table_path= (run-config table-path) to resume it")
        if on_disk:  # the file must be this state's, at this state's round (or one ahead with its undo log)
            self.journal = TableJournal(self.path, table_id=str(state.get("table_id", "")))
            self.journal.check()  # refuse a file without a journal before attaching it
        self.table = UpdateTable.from_state_dict(state["table"], path=self.path)
        if on_disk:
            self.journal.recover(self.table, self.generation)
        elif self.path is not None:
            self.journal = TableJournal(self.path)
            self.journal.commit(self.table, self.generation)
