"""The contract of :class:`~pollen.strategies.fedadavr_store.StoredUpdates`: FedAdaVR's table as a part.

``ensure(layout)`` builds the empty table once the model is known (a table already there is kept).
``write(round, vr_round)`` writes the round's staged rows after the server step and makes the round the
store's generation; until then the table is not touched. In RAM the checkpoint carries the rows; in a file
(``path``) it carries the table's id, and the file is kept with a crash journal beside it. ``load_state_dict``
checks every field against the model's layout, the run's last round and (for a file) the journal, and
refuses a state that does not fit with a ``StateError`` naming the field; the store is then unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pollen.core.files import read_npz, write_npz_atomic
from pollen.core.layout import ModelLayout
from pollen.core.state_fields import StateError
from pollen.strategies.fedadavr_store import StoredUpdates, TableFileRefused
from pollen.vr.aggregate import VRRound

pytestmark = pytest.mark.flower_compat

LAYOUT = ModelLayout.from_arrays({"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)})
A = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=np.float32)
B = np.array([3.0, 2.0, 1.0, 0.0, -1.0, -2.0], dtype=np.float32)


def stage(store: StoredUpdates, rows: dict[str, tuple[np.ndarray, float]]) -> VRRound:
    """One round of the VR aggregate over the store's table, its delta taken (as a strategy does before it steps)."""
    vr_round = VRRound(store.table, LAYOUT.dim)
    for client, (y, weight) in rows.items():
        vr_round.add(client, y, weight)
    vr_round.delta(num_clients=len(rows))
    return vr_round


def written(path: str | None = None) -> StoredUpdates:
    store = StoredUpdates("fp32", path)
    store.ensure(LAYOUT)
    store.write(3, stage(store, {"a": (A, 2.0), "b": (B, 1.0)}))
    return store


def test_there_is_no_table_until_the_model_is_known() -> None:
    store = StoredUpdates("fp32", None)
    assert store.table is None and store.known_clients == 0 and store.state_dict() == {}


def test_ensure_builds_the_empty_table_once() -> None:
    store = StoredUpdates("fp32", None)
    store.ensure(LAYOUT)
    table = store.table
    assert store.known_clients == 0 and table.dim == 6
    store.ensure(LAYOUT)
    assert store.table is table


def test_staged_rows_reach_the_table_only_when_written() -> None:
    store = StoredUpdates("fp32", None)
    store.ensure(LAYOUT)
    vr_round = stage(store, {"a": (A, 2.0), "b": (B, 1.0)})
    assert store.known_clients == 0 and store.generation == 0  # the step has not committed yet
    store.write(3, vr_round)
    assert store.known_clients == 2 and store.generation == 3
    np.testing.assert_array_equal(store.table.get("a"), A)
    np.testing.assert_array_equal(store.table.get("b"), B)
    assert (store.table.weight("a"), store.table.weight("b")) == (2.0, 1.0)
    np.testing.assert_array_equal(store.table.running_sum, 2.0 * A + B)  # the weighted sum of the rows


def test_a_later_round_replaces_only_its_clients_rows() -> None:
    store = written()
    store.write(4, stage(store, {"b": (A, 1.0)}))
    np.testing.assert_array_equal(store.table.get("a"), A)
    np.testing.assert_array_equal(store.table.get("b"), A)
    np.testing.assert_array_equal(store.table.running_sum, 3.0 * A)
    assert store.generation == 4


# ---------------------------------------------------------------------------- state
def test_a_table_in_ram_is_saved_with_its_rows_and_restored() -> None:
    state = written().state_dict()
    assert set(state) == {"table", "generation"} and state["generation"] == 3
    again = StoredUpdates("fp32", None)
    again.load_state_dict(state, LAYOUT, last_round=3)
    assert again.generation == 3 and again.known_clients == 2
    np.testing.assert_array_equal(again.table.get("b"), B)
    np.testing.assert_array_equal(again.table.running_sum, 2.0 * A + B)


def test_a_table_in_a_file_is_saved_by_its_id_and_restored_from_the_file(tmp_path: Path) -> None:
    path = str(tmp_path / "table.bin")
    state = written(path).state_dict()
    assert set(state) == {"table", "generation", "table_id"} and "data" not in state["table"]
    again = StoredUpdates("fp32", path)
    again.load_state_dict(state, LAYOUT, last_round=3)
    assert again.generation == 3
    np.testing.assert_array_equal(again.table.get("a"), A)


def test_a_checkpoint_in_ram_can_resume_into_a_file(tmp_path: Path) -> None:
    path = tmp_path / "table.bin"
    again = StoredUpdates("fp32", str(path))
    again.load_state_dict(written().state_dict(), LAYOUT)
    np.testing.assert_array_equal(again.table.get("b"), B)
    assert path.is_file() and set(again.state_dict()) == {"table", "generation", "table_id"}


def test_an_empty_state_without_a_model_restores_an_empty_store() -> None:
    store = StoredUpdates("fp32", None)
    store.load_state_dict({}, None)
    assert store.table is None


def bad_running_sum() -> dict:
    state = written().state_dict()
    state["table"] = {**state["table"], "running_sum": np.asarray(state["table"]["running_sum"]) + 1}
    return state


OTHER_MODEL = ModelLayout.from_arrays({"w": np.zeros((3, 2), np.float32)})


@pytest.mark.parametrize(
    ("build", "layout", "last_round", "field", "expected"),
    [
        (written, None, None, "store", "holds a table but the state has no model; expected both or neither"),
        (written, LAYOUT, 2, "store/generation", r"is 3; expected an integer in \[0, 2\]"),
        (written, OTHER_MODEL, None, "store/table/segments", "differs from the model's tensor sizes"),
        (bad_running_sum, LAYOUT, None, "store/table/running_sum", "expected the weighted sum of the rows"),
        (lambda: {**written().state_dict(), "extra": 1}, LAYOUT, None, "store/extra", "is not a field of store"),
        (lambda: [], LAYOUT, None, "store", "expected a mapping"),
    ],
    ids=["no-model", "after-the-checkpoint", "other-model", "running-sum", "unknown-field", "not-a-mapping"],
)
def test_a_bad_saved_store_is_refused_by_field_and_changes_nothing(build, layout, last_round, field, expected) -> None:  # noqa: ANN001
    store = written()
    table = store.table
    saved = build()
    saved = saved.state_dict() if isinstance(saved, StoredUpdates) else saved
    with pytest.raises(StateError, match=expected) as refused:
        store.load_state_dict(saved, layout, last_round=last_round)
    assert refused.value.field == field
    assert store.table is table and store.generation == 3
    np.testing.assert_array_equal(store.table.get("a"), A)


def test_a_table_of_another_precision_is_refused() -> None:
    with pytest.raises(StateError, match="expected 'fp16'") as refused:
        StoredUpdates("fp16", None).load_state_dict(written().state_dict(), LAYOUT)
    assert refused.value.field == "store/table/precision"


def test_a_table_that_lives_in_a_file_needs_the_file_path(tmp_path: Path) -> None:
    state = written(str(tmp_path / "table.bin")).state_dict()
    with pytest.raises(StateError, match="lives in a file; pass table_path=") as refused:
        StoredUpdates("fp32", None).load_state_dict(state, LAYOUT)
    assert refused.value.field == "store/table"


def test_a_file_that_belongs_to_another_table_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "table.bin")
    state = {**written(path).state_dict(), "table_id": "another-table"}
    store = StoredUpdates("fp32", path)
    with pytest.raises(TableFileRefused, match="belongs to table .*, the checkpoint to another-table") as refused:
        store.load_state_dict(state, LAYOUT)
    assert isinstance(refused.value, StateError) and refused.value.field == "store/table_id"
    assert store.table is None


def test_a_file_shorter_than_its_rows_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "table.bin"
    state = written(str(path)).state_dict()
    path.write_bytes(b"")
    with pytest.raises(StateError, match=r"needs \d+ bytes of rows in .*, which holds 0") as refused:
        StoredUpdates("fp32", str(path)).load_state_dict(state, LAYOUT)
    assert refused.value.field == "store/table"


# ---------------------------------------------------------------------------- the file's bytes (issue 43)
def files_of(path: Path) -> dict[Path, bytes]:
    return {file: file.read_bytes() for file in path.parent.iterdir()}


def one_round_ahead(tmp_path: Path) -> tuple[Path, dict]:
    """A table file written for round 4 (a's row replaced) whose checkpoint is round 3's (a crash between)."""
    path = tmp_path / "table.bin"
    store = written(str(path))
    state = store.state_dict()
    store.write(4, stage(store, {"a": (B, 1.0), "c": (A, 1.0)}))
    store.table.close()
    return path, state


def test_a_table_in_a_file_is_refused_when_a_byte_of_a_row_changed(tmp_path: Path) -> None:
    path = tmp_path / "table.bin"
    state = written(str(path)).state_dict()
    row_bytes = LAYOUT.dim * 4
    for at in range(2 * row_bytes):
        original = path.read_bytes()
        flipped = bytearray(original)
        flipped[at] ^= 0x80
        path.write_bytes(bytes(flipped))
        store = StoredUpdates("fp32", str(path))
        with pytest.raises(TableFileRefused, match="table file .*table.bin: its row") as refused:
            store.load_state_dict(state, LAYOUT, last_round=3)
        row = at // row_bytes
        assert refused.value.field == "store/table/row_crc32" and f"row {row} (client {'ab'[row]!r})" in str(
            refused.value
        )
        assert store.table is None and store.generation == 0 and path.read_bytes() == bytes(flipped)
        path.write_bytes(original)
    StoredUpdates("fp32", str(path)).load_state_dict(state, LAYOUT, last_round=3)


def test_a_file_one_round_ahead_is_rolled_back_and_checked_against_the_checkpoint(tmp_path: Path) -> None:
    path, state = one_round_ahead(tmp_path)
    store = StoredUpdates("fp32", str(path))
    store.load_state_dict(state, LAYOUT, last_round=3)
    np.testing.assert_array_equal(store.table.get("a"), A)  # round 4's row of a was rolled back
    np.testing.assert_array_equal(store.table.get("b"), B)
    assert store.known_clients == 2 and store.generation == 3


def test_every_byte_of_the_undo_log_is_checked_or_harmless(tmp_path: Path) -> None:
    """A changed byte of the undo log is refused, or (zip timestamps, padding) rolls back to the same rows."""
    path, state = one_round_ahead(tmp_path)
    undo = Path(f"{path}.undo.npz")
    originals = files_of(path)
    refused = same = 0
    for at in range(0, len(originals[undo]), 3):
        for file, data in originals.items():
            file.write_bytes(data)
        flipped = bytearray(originals[undo])
        flipped[at] ^= 0x04
        undo.write_bytes(bytes(flipped))
        store = StoredUpdates("fp32", str(path))
        try:
            store.load_state_dict(state, LAYOUT, last_round=3)
        except StateError as err:
            assert "\n" not in str(err)
            assert store.table is None and files_of(path) == {**originals, undo: bytes(flipped)}
            refused += 1
            continue
        np.testing.assert_array_equal(store.table.get("a"), A)
        np.testing.assert_array_equal(store.table.get("b"), B)
        np.testing.assert_array_equal(store.table.running_sum, 2.0 * A + B)
        same += 1
    assert refused > same > 0  # the data, rows, generation and headers are refused; zip timestamps are not read


def test_a_changed_row_of_the_undo_log_is_refused_naming_the_undo_log(tmp_path: Path) -> None:
    path, state = one_round_ahead(tmp_path)
    undo = Path(f"{path}.undo.npz")
    saved = read_npz(undo)
    np.testing.assert_array_equal(saved["data"][0], A)  # the round-3 row of a, kept to roll round 4 back
    saved["data"][0, 0] += 1.0  # a well-formed undo log (its zip checksums too) holding another row
    write_npz_atomic(undo, saved)
    with pytest.raises(TableFileRefused, match=rf"the undo log {undo}: its row 0 \(client 'a'\) has CRC-32"):
        StoredUpdates("fp32", str(path)).load_state_dict(state, LAYOUT, last_round=3)
