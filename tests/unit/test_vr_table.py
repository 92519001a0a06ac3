"""The stored-update table: storage, running sum, capacity, memmap backend, persistence."""

import os
import re

import numpy as np
import pytest

from pollen.compression.quant import PRECISIONS, dequantize, quantize
from pollen.vr import UpdateTable

SEGMENTS = [6, 1, 7, 150, 3]  # odd sizes on purpose (int4 padding per tensor)
DIM = sum(SEGMENTS)


def _y(rng, scale=1.0):
    return (rng.standard_normal(DIM) * scale).astype(np.float32)


def _expected_row(y, precision):
    parts, start = [], 0
    for n in SEGMENTS:
        parts.append(dequantize(quantize(y[start : start + n], precision)))
        start += n
    return np.concatenate(parts)


def _random_rounds(table, rounds, n_clients, m, seed, weighted=True):
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        sampled = rng.choice(n_clients, size=m, replace=False)
        ys = {int(k): _y(rng, float(10.0 ** rng.uniform(-3, 2))) for k in sampled}
        ws = {int(k): float(rng.integers(1, 500)) for k in sampled} if weighted else None
        table.replace_many(ys, ws)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_unseen_is_zero_and_owns_no_row(precision):
    t = UpdateTable(DIM, SEGMENTS, precision)
    y = t.get("never")
    assert y.dtype == np.float32 and y.shape == (DIM,) and not y.any()
    assert t.known_clients == 0 and "never" not in t and t.weight("never") == 0.0
    assert not t.running_sum.any()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_replace_then_get_is_per_tensor_dequantised(precision):
    rng = np.random.default_rng(0)
    t = UpdateTable(DIM, SEGMENTS, precision)
    y = _y(rng)
    t.replace("a", y, weight=3.0)
    np.testing.assert_array_equal(t.get("a"), _expected_row(y, precision))
    y2 = _y(rng)
    t.replace("a", y2, weight=5.0)  # replaced, not appended
    assert t.known_clients == 1 and t.weight("a") == 5.0 and t.total_weight == 5.0
    np.testing.assert_array_equal(t.get("a"), _expected_row(y2, precision))
    np.testing.assert_allclose(
        t.running_sum, 5.0 * _expected_row(y2, precision).astype(np.float64), rtol=1e-12, atol=1e-12
    )


def test_int_and_str_keys_are_the_same_client():
    t = UpdateTable(DIM, SEGMENTS)
    t.replace(7, np.ones(DIM, np.float32))
    assert "7" in t and 7 in t and t.keys() == ["7"]
    np.testing.assert_array_equal(t.get("7"), np.ones(DIM))
    with pytest.raises(TypeError):
        t.get(1.5)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_incremental_running_sum_matches_recomputation(precision):
    t = UpdateTable(DIM, SEGMENTS, precision, initial_capacity=2)
    _random_rounds(t, rounds=600, n_clients=40, m=5, seed=1)
    full = t.recompute_running_sum()
    scale = np.max(np.abs(full))
    assert np.max(np.abs(t.running_sum - full)) <= 1e-10 * scale
    assert t.total_weight == pytest.approx(sum(t.weight(k) for k in t.keys()), rel=1e-15)
    # and the explicit recomputation really is sum_j w_j D(y_j)
    direct = sum(t.weight(k) * t.get(k).astype(np.float64) for k in t.keys())
    np.testing.assert_allclose(full, direct, rtol=1e-12, atol=1e-12 * scale)


def test_resync_replaces_the_accumulator():
    t = UpdateTable(DIM, SEGMENTS, "int8")
    _random_rounds(t, rounds=50, n_clients=10, m=3, seed=2)
    t.resync()
    np.testing.assert_array_equal(t.running_sum, t.recompute_running_sum())


@pytest.mark.parametrize("backend", ["ram", "memmap"])
def test_capacity_doubles_and_keeps_rows(backend, tmp_path):
    path = tmp_path / "table.bin" if backend == "memmap" else None
    t = UpdateTable(DIM, SEGMENTS, "int4", path=path, initial_capacity=1)
    rng = np.random.default_rng(3)
    stored = {}
    caps = []
    for k in range(9):
        stored[k] = _y(rng)
        t.replace(k, stored[k])
        caps.append(t.capacity)
    assert caps == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert t.known_clients == 9 and t.keys() == [str(k) for k in range(9)]
    for k, y in stored.items():
        np.testing.assert_array_equal(t.get(k), _expected_row(y, "int4"))
    if backend == "memmap":
        row_bytes = sum((n + 1) // 2 for n in SEGMENTS)
        assert os.path.getsize(path) == 16 * row_bytes
    t.close()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_memmap_backend_is_identical_to_ram(precision, tmp_path):
    ram = UpdateTable(DIM, SEGMENTS, precision, initial_capacity=1)
    mm = UpdateTable(DIM, SEGMENTS, precision, path=tmp_path / "t.bin", initial_capacity=1)
    assert mm.backend == "memmap" and ram.backend == "ram"
    _random_rounds(ram, rounds=200, n_clients=30, m=4, seed=4)
    _random_rounds(mm, rounds=200, n_clients=30, m=4, seed=4)
    assert ram.keys() == mm.keys() and ram.capacity == mm.capacity
    np.testing.assert_array_equal(ram.running_sum, mm.running_sum)
    for k in ram.keys():
        np.testing.assert_array_equal(ram.get(k), mm.get(k))
    mm.close()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_memory_report_is_measured_from_arrays_and_file(precision, tmp_path):
    n_tensors = len(SEGMENTS)
    row = {
        "fp32": 4 * DIM,
        "fp16": 2 * DIM,
        "int8": DIM + 4 * n_tensors,
        "int4": sum((n + 1) // 2 for n in SEGMENTS) + 4 * n_tensors,
    }[precision]
    for path in (None, tmp_path / "m.bin"):
        t = UpdateTable(DIM, SEGMENTS, precision, path=path, initial_capacity=8)
        _random_rounds(t, rounds=3, n_clients=5, m=5, seed=5)
        r = t.memory_report()
        assert r["capacity"] == 8 and r["known_clients"] == 5
        assert r["row_bytes"] == row and r["used_bytes"] == 5 * row
        assert r["data_bytes"] + r["scale_bytes"] == 8 * row
        assert r["fp32_row_bytes"] == 4 * DIM
        assert r["total_bytes"] == 8 * row + 8 * 8 + 8 * DIM == t.memory_bytes()
        if path is not None:
            assert r["data_bytes"] == os.path.getsize(path)
        t.close()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_state_dict_round_trip(precision, tmp_path):
    t = UpdateTable(DIM, SEGMENTS, precision)
    _random_rounds(t, rounds=30, n_clients=12, m=3, seed=6)
    state = t.state_dict()
    assert all(isinstance(v, np.ndarray) for v in state.values())
    for path in (None, tmp_path / "restored.bin"):
        u = UpdateTable.from_state_dict(state, path=path)
        assert u.keys() == t.keys() and u.precision == precision
        np.testing.assert_array_equal(u.running_sum, t.running_sum)
        for k in t.keys():
            np.testing.assert_array_equal(u.get(k), t.get(k))
            assert u.weight(k) == t.weight(k)
        # the restored table keeps working: the same next rounds give the same sums
        _random_rounds(t, rounds=5, n_clients=15, m=3, seed=7)
        _random_rounds(u, rounds=5, n_clients=15, m=3, seed=7)
        np.testing.assert_array_equal(u.running_sum, t.running_sum)
        t = UpdateTable.from_state_dict(state)  # reset t for the second backend
    # snapshot is a copy: later writes do not change it
    before = state["data"].copy()
    t.replace(t.keys()[0], np.full(DIM, 3.0, np.float32))
    np.testing.assert_array_equal(state["data"], before)


def test_save_load_npz(tmp_path):
    t = UpdateTable(DIM, SEGMENTS, "int4", path=tmp_path / "live.bin")
    _random_rounds(t, rounds=20, n_clients=10, m=3, seed=8)
    t.save(tmp_path / "snap.npz")
    for path in (None, tmp_path / "copy.bin"):
        u = UpdateTable.load(tmp_path / "snap.npz", path=path)
        assert u.keys() == t.keys()
        for k in t.keys():
            np.testing.assert_array_equal(u.get(k), t.get(k))
        np.testing.assert_array_equal(u.running_sum, t.running_sum)


def test_memmap_resume_from_file_without_copying_rows(tmp_path):
    path = tmp_path / "live.bin"
    t = UpdateTable(DIM, SEGMENTS, "int8", path=path, initial_capacity=2)
    _random_rounds(t, rounds=20, n_clients=10, m=3, seed=9)
    light = t.state_dict(include_data=False)
    assert "data" not in light
    expected = {k: t.get(k) for k in t.keys()}
    t.close()  # "crash": only the file and the light state survive
    u = UpdateTable.from_state_dict(light, path=path)
    assert u.keys() == list(expected) and u.capacity >= len(expected)
    for k, v in expected.items():
        np.testing.assert_array_equal(u.get(k), v)
    np.testing.assert_array_equal(u.running_sum, light["running_sum"])
    np.testing.assert_allclose(u.recompute_running_sum(), u.running_sum, rtol=1e-12, atol=1e-9)
    with pytest.raises(ValueError, match="no 'data'"):
        UpdateTable.from_state_dict(light)
    with pytest.raises(ValueError, match="no 'data'"):
        UpdateTable.from_state_dict(light, path=tmp_path / "missing.bin")
    with open(tmp_path / "short.bin", "wb") as f:
        f.write(b"\0" * 10)
    with pytest.raises(ValueError, match="the state needs"):
        UpdateTable.from_state_dict(light, path=tmp_path / "short.bin")
    with pytest.raises(ValueError, match="no 'data'"):
        UpdateTable(DIM, SEGMENTS, "int8").load_state_dict(light)


def test_load_state_dict_rejects_mismatch():
    t = UpdateTable(DIM, SEGMENTS, "int8")
    t.replace("a", np.ones(DIM, np.float32))
    with pytest.raises(ValueError, match="precision"):
        UpdateTable(DIM, SEGMENTS, "int4").load_state_dict(t.state_dict())
    with pytest.raises(ValueError, match="segments"):
        UpdateTable(DIM, [DIM], "int8").load_state_dict(t.state_dict())


def test_bad_updates_leave_the_table_unchanged():
    t = UpdateTable(DIM, SEGMENTS, "fp16")
    t.replace("a", np.ones(DIM, np.float32))
    snap = t.state_dict()
    bad = np.ones(DIM, np.float32)
    bad[3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        t.replace("a", bad)
    with pytest.raises(ValueError, match="shape"):
        t.replace("b", np.ones(DIM + 1, np.float32))
    with pytest.raises(ValueError, match="weight"):
        t.replace("b", np.ones(DIM, np.float32), weight=-1.0)
    with pytest.raises(ValueError, match="NaN"):  # batch is validated before anything is written
        t.replace_many({"c": np.ones(DIM, np.float32), "a": bad})
    after = t.state_dict()
    assert t.keys() == ["a"]
    for k in snap:
        np.testing.assert_array_equal(after[k], snap[k])


def test_constructor_validation():
    with pytest.raises(ValueError, match="allowed: fp32, fp16, int8, int4"):
        UpdateTable(DIM, SEGMENTS, "bf16")
    with pytest.raises(ValueError, match="summing to dim"):
        UpdateTable(DIM, [1, 2])
    with pytest.raises(ValueError):
        UpdateTable(0)


# --------------------------------------------------------------------------------------- hostile files


def _npy(array_or_header) -> bytes:
    """The bytes of one ``.npy`` member: an array, or a bare header dict (a declared shape, no data)."""
    import io

    out = io.BytesIO()
    if isinstance(array_or_header, dict):
        np.lib.format.write_array_header_1_0(out, array_or_header)
    else:
        np.lib.format.write_array(out, array_or_header, allow_pickle=False)
    return out.getvalue()


def _rewrite(path, **members) -> None:
    """Rewrite the ``.npz`` at ``path`` with some members replaced by raw ``.npy`` bytes."""
    import zipfile

    with zipfile.ZipFile(path) as zf:
        old = {info.filename: zf.read(info) for info in zf.infolist()}
    old.update({f"{name}.npy": data for name, data in members.items()})
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in old.items():
            zf.writestr(name, data)


_HUGE = {"descr": "<f8", "fortran_order": False, "shape": (10**12,)}


def test_load_refuses_a_file_whose_sizes_its_bytes_do_not_cover(tmp_path):
    t = UpdateTable(DIM, SEGMENTS, "int8")
    _random_rounds(t, rounds=3, n_clients=5, m=2, seed=1)
    t.save(tmp_path / "snap.npz")
    _rewrite(tmp_path / "snap.npz", running_sum=_npy(_HUGE) + b"\0" * 64)
    with pytest.raises(ValueError, match="8000000000000 bytes"):
        UpdateTable.load(tmp_path / "snap.npz")
    # a dim the file's running sum does not back is refused before a table of that size is built
    t.save(tmp_path / "snap.npz")
    _rewrite(tmp_path / "snap.npz", dim=_npy(np.array(10**12, dtype=np.int64)))
    with pytest.raises(ValueError, match="do not match"):
        UpdateTable.load(tmp_path / "snap.npz")


def test_save_writes_exactly_the_path_given_and_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    t = UpdateTable(DIM, SEGMENTS, "fp32")
    _random_rounds(t, rounds=2, n_clients=4, m=2, seed=2)
    t.save(tmp_path / "snap.npz")
    before = (tmp_path / "snap.npz").read_bytes()
    _random_rounds(t, rounds=2, n_clients=4, m=2, seed=3)
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        t.save(tmp_path / "snap.npz")
    monkeypatch.undo()
    assert (tmp_path / "snap.npz").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["snap.npz"]


@pytest.mark.parametrize(
    ("undo", "why"),
    [
        ({"data": _npy(_HUGE) + b"\0" * 64}, "8000000000000 bytes"),
        ({"rows": _npy(np.array([0, 10**9], dtype=np.int64))}, "do not fit"),
        ({"data": _npy(np.zeros((2, 3), dtype=np.float64))}, "expected"),
    ],
)
def test_journal_refuses_a_hostile_undo_log(tmp_path, undo, why):
    from pollen.vr.journal import TableFileError, TableJournal

    path = tmp_path / "live.bin"
    t = UpdateTable(DIM, SEGMENTS, "int8", path=path)
    _random_rounds(t, rounds=3, n_clients=6, m=3, seed=4)
    journal = TableJournal(path)
    journal.commit(t, 3)
    journal.begin(t, 4, t.keys()[:2])  # "crash" in round 4: the file is one round ahead with its undo log
    _rewrite(journal.undo_path, **undo)
    with pytest.raises(TableFileError, match=why):
        journal.recover(t, 3)


# ------------------------------------------------------------------- the public loads check like a resume


def _altered(state, field, value):
    state = dict(state)
    array = np.array(state[field], copy=True)
    array.reshape(-1)[0] = value
    state[field] = array
    return state


_BAD_FIELDS = [
    ("running_sum", np.nan, "at index 0; expected finite values"),
    ("running_sum", 1e6, "expected the weighted sum of the rows"),
    ("weights", -1.0, "at index 0; expected values >= 0 (a weight)"),
    ("weights", np.inf, "expected finite values"),
    ("absmax", -1.0, "expected values >= 0 (a scale)"),
]


@pytest.mark.parametrize(("field", "value", "words"), _BAD_FIELDS, ids=lambda v: str(v)[:12])
def test_load_state_dict_checks_every_field_and_changes_nothing_when_it_refuses(field, value, words):
    from pollen.core.state_fields import StateError

    source = UpdateTable(DIM, SEGMENTS, "int8")
    _random_rounds(source, rounds=3, n_clients=5, m=3, seed=11)
    target = UpdateTable(DIM, SEGMENTS, "int8")
    _random_rounds(target, rounds=2, n_clients=4, m=2, seed=12)
    before = target.state_dict()
    with pytest.raises(StateError, match=re.escape(words)) as refused:
        target.load_state_dict(_altered(source.state_dict(), field, value))
    assert refused.value.field == f"table/{field}" and "\n" not in str(refused.value)
    after = target.state_dict()
    assert all(np.array_equal(after[k], before[k]) for k in before)
    with pytest.raises(StateError, match=re.escape(words)):
        UpdateTable.from_state_dict(_altered(source.state_dict(), field, value))


@pytest.mark.parametrize(("field", "value", "words"), _BAD_FIELDS, ids=lambda v: str(v)[:12])
def test_load_of_a_saved_file_checks_every_field(tmp_path, field, value, words):
    from pollen.core.files import write_npz_atomic
    from pollen.core.state_fields import StateError

    t = UpdateTable(DIM, SEGMENTS, "int8")
    _random_rounds(t, rounds=3, n_clients=5, m=3, seed=13)
    write_npz_atomic(tmp_path / "snap.npz", _altered(t.state_dict(), field, value))
    for path in (None, tmp_path / "rows.bin"):
        with pytest.raises(StateError, match=re.escape(words)) as refused:
            UpdateTable.load(tmp_path / "snap.npz", path=path)
        assert str(refused.value).startswith(f"{tmp_path / 'snap.npz'}: state field 'table/{field}'")
    assert not (tmp_path / "rows.bin").exists()  # refused before a rows file is made


def test_public_loads_refuse_a_state_that_does_not_hold_one_row_per_key():
    from pollen.core.state_fields import StateError

    t = UpdateTable(DIM, SEGMENTS, "fp16")
    _random_rounds(t, rounds=3, n_clients=5, m=3, seed=14)
    state = t.state_dict()
    short = {**state, "weights": state["weights"][:-1]}
    with pytest.raises(StateError, match=r"'table/weights' has shape \(\d+,\); expected"):
        UpdateTable.from_state_dict(short)
    wrong = {**state, "data": state["data"].astype(np.float32)}
    with pytest.raises(StateError, match="'table/data' has dtype float32; expected float16"):
        UpdateTable(DIM, SEGMENTS, "fp16").load_state_dict(wrong)
    huge = {**state, "dim": np.array(10**12, dtype=np.int64)}
    with pytest.raises(StateError, match="segments"):  # no table is sized from a declared dim
        UpdateTable.from_state_dict(huge)


# ---------------------------------------------------------------------------- a rows file checked by byte


def _file_table(tmp_path, precision="int4"):
    path = tmp_path / "live.bin"
    t = UpdateTable(DIM, SEGMENTS, precision, path=path, initial_capacity=2)
    _random_rounds(t, rounds=6, n_clients=5, m=3, seed=15)
    light = t.state_dict(include_data=False)
    t.close()
    return path, light


def test_a_state_without_rows_records_each_rows_crc32(tmp_path):
    import zlib

    path, light = _file_table(tmp_path)
    width = UpdateTable(DIM, SEGMENTS, "int4").row_width
    raw = path.read_bytes()
    assert light["row_crc32"].dtype == np.uint32 and len(light["row_crc32"]) == len(light["keys"])
    for row, crc in enumerate(light["row_crc32"]):
        assert zlib.crc32(raw[row * width : (row + 1) * width]) == crc


@pytest.mark.parametrize(("precision", "stride"), [("int4", 1), ("fp32", 7)])
def test_every_byte_of_the_rows_of_a_file_is_checked_when_it_is_attached(tmp_path, precision, stride):
    from pollen.core.state_fields import StateError

    path, light = _file_table(tmp_path, precision)
    table = UpdateTable(DIM, SEGMENTS, precision)
    width = table.row_width * table.storage_dtype.itemsize
    original = path.read_bytes()
    keys = [str(k) for k in light["keys"]]
    ends = {row * width + end for row in range(len(keys)) for end in (0, width - 1)}
    for at in sorted(set(range(0, len(keys) * width, stride)) | ends):  # int4: every byte
        flipped = bytearray(original)
        flipped[at] ^= 1 << (at % 8)
        path.write_bytes(bytes(flipped))
        row = at // width
        with pytest.raises(StateError) as refused:
            UpdateTable.from_state_dict(light, path=path)
        message = str(refused.value)
        assert refused.value.field == "table/row_crc32" and "\n" not in message
        assert f"table file {path}: its row {row} (client {keys[row]!r})" in message
        assert f"expected {int(light['row_crc32'][row]):#010x}" in message
        assert path.read_bytes() == bytes(flipped)  # refused before the file is attached
    path.write_bytes(original)
    UpdateTable.from_state_dict(light, path=path)


def test_load_state_dict_of_a_file_table_reads_its_rows_back_first(tmp_path):
    from pollen.core.state_fields import StateError

    path, light = _file_table(tmp_path)
    live = UpdateTable.from_state_dict(light, path=path)
    before = live.state_dict()
    data = np.memmap(path, dtype=np.uint8, mode="r+")
    data[3] ^= 0x40  # a byte of row 0 changes under the table
    data.flush()
    with pytest.raises(StateError, match=r"its row 0 \(client .*\) has CRC-32 0x[0-9a-f]{8}; expected"):
        live.load_state_dict(light)
    assert live.keys() == list(before["keys"]) and np.array_equal(live.running_sum, before["running_sum"])


def test_a_state_with_rows_in_a_file_needs_their_checksums(tmp_path):
    from pollen.core.state_fields import StateError

    path, light = _file_table(tmp_path)
    bare = {k: v for k, v in light.items() if k != "row_crc32"}
    with pytest.raises(StateError, match="'table/row_crc32' is missing"):
        UpdateTable.from_state_dict(bare, path=path)
    with pytest.raises(StateError, match="'table/row_crc32' has dtype int64; expected uint32"):
        UpdateTable.from_state_dict({**light, "row_crc32": light["row_crc32"].astype(np.int64)}, path=path)


# ------------------------------------------------------------------------------------ the journal by byte


def test_every_byte_of_the_journal_is_checked(tmp_path):
    from pollen.vr.journal import TableFileError, TableJournal

    path = tmp_path / "live.bin"
    t = UpdateTable(DIM, SEGMENTS, "int8", path=path)
    _random_rounds(t, rounds=3, n_clients=6, m=3, seed=4)
    journal = TableJournal(path)
    journal.commit(t, 3)
    original = journal.journal_path.read_bytes()
    assert journal.verify(3, t.row_width, t.storage_dtype, t.known_clients) is None
    for at in range(len(original)):
        for bit in (0, 5):
            flipped = bytearray(original)
            flipped[at] ^= 1 << bit
            journal.journal_path.write_bytes(bytes(flipped))
            with pytest.raises(TableFileError, match="no usable journal|belongs to table|holds round") as refused:
                journal.verify(3, t.row_width, t.storage_dtype, t.known_clients)
            assert "\n" not in str(refused.value)
    journal.journal_path.write_bytes(original.replace(b'"dirty":false', b'"dirty":false '))
    with pytest.raises(TableFileError, match="not the journal written for its fields"):
        journal.verify(3, t.row_width, t.storage_dtype, t.known_clients)


def test_an_undo_log_listing_a_row_twice_is_refused(tmp_path):
    from pollen.vr.journal import TableFileError, TableJournal

    path = tmp_path / "live.bin"
    t = UpdateTable(DIM, SEGMENTS, "int8", path=path)
    _random_rounds(t, rounds=3, n_clients=6, m=3, seed=4)
    journal = TableJournal(path)
    journal.commit(t, 3)
    journal.begin(t, 4, t.keys()[:2])
    _rewrite(journal.undo_path, rows=_npy(np.array([0, 0], dtype=np.int64)))
    with pytest.raises(TableFileError, match="lists a row twice"):
        journal.recover(t, 3)
