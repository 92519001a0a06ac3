"""``ClientState``: named client vectors across rounds in ``context.state`` and a node-local file.

A new ``Context`` (``make_context``) stands for a restarted SuperNode or a resumed run
(a new Flower run): its ``state`` is empty, only the file remains.
"""

from __future__ import annotations

import logging
import os
import pickle

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from pollen.clientside import state as state_mod
from pollen.clientside.state import (
    META_KEY,
    STATE_KEY,
    ClientState,
    ClientStateError,
    read_state_file,
    state_file_path,
)
from pollen.testing.fakes import capture_flwr_logs, make_context, messages_text

pytestmark = pytest.mark.flower_compat


def vec(value: float, n: int = 4, dtype=np.float32) -> np.ndarray:
    return np.full(n, value, dtype=dtype)


def commit(context, server_round: int, value: float, state_dir, *, client_id: str = "c1", run_key: str = "") -> None:
    """A first message of ``server_round`` that stores ``vec(value)`` as "m"."""
    st = ClientState(context, server_round=server_round, state_dir=state_dir, client_id=client_id, run_key=run_key)
    st.set("m", vec(value))
    st.commit()


def load(server_round: int, state_dir, *, first_message: bool = True, client_id: str = "c1", run_key: str = ""):
    """A fresh node (empty context.state) at ``server_round``."""
    return ClientState(
        make_context(1),
        server_round=server_round,
        first_message=first_message,
        state_dir=state_dir,
        client_id=client_id,
        run_key=run_key,
    )


def dir_listing(path) -> list[str]:
    """The directory's files, less the lock files commits take (``<file>.lock``, empty, kept)."""
    return sorted(name for name in os.listdir(path) if not name.endswith(".lock"))


# ----------------------------------------------------------------------------------------- context.state only
def test_round_trip_through_context_state_keeps_dtype_shape_and_other_keys():
    context = make_context(7)
    context.state["other.metrics"] = MetricRecord({"x": 1.5})
    context.state["other.arrays"] = ArrayRecord()
    vectors = {
        "ef.residual": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
        "counter": np.array([3, -1, 2**40], dtype=np.int64),
        "scale": np.array(2.5, dtype=np.float64),  # 0-d stays 0-d
        "mask": np.array([True, False]),
    }
    st = ClientState(context, server_round=1)
    assert st.base_round == 0
    assert st.get("ef.residual") is None
    assert st.names() == []
    for name, value in vectors.items():
        st.set(name, value)
    st.commit()

    assert set(context.state.keys()) == {"other.metrics", "other.arrays", STATE_KEY, META_KEY}
    assert context.state.config_records[META_KEY][state_mod.ROUND_FIELD] == 1
    assert context.state.metric_records["other.metrics"]["x"] == 1.5

    again = ClientState(context, server_round=2)
    assert again.base_round == 1
    assert again.names() == list(vectors)
    for name, value in vectors.items():
        got = again.get(name)
        assert got.dtype == value.dtype and got.shape == value.shape
        np.testing.assert_array_equal(got, value)


def test_set_stores_a_copy_and_pop_removes():
    context = make_context(1)
    st = ClientState(context, server_round=1)
    value = vec(1.0)
    st.set("m", value)
    value[:] = 9.0
    np.testing.assert_array_equal(st.get("m"), vec(1.0))
    st.set("v", vec(2.0))
    np.testing.assert_array_equal(st.pop("v"), vec(2.0))
    assert st.pop("v") is None
    st.commit()
    assert ClientState(context, server_round=2).names() == ["m"]


def test_bad_values_and_rounds_are_refused():
    st = ClientState(make_context(1), server_round=1)
    with pytest.raises(TypeError, match="numeric"):
        st.set("m", np.array(["a", "b"]))
    with pytest.raises(TypeError, match="numeric"):
        st.set("m", np.array([object()], dtype=object))
    with pytest.raises(TypeError, match="numeric"):
        st.set("m", np.ones(2, dtype=np.complex64))
    with pytest.raises(ValueError, match="non-empty"):
        st.set("", vec(1.0))
    with pytest.raises(ValueError, match="server_round"):
        ClientState(make_context(1), server_round=-1)


def test_not_committed_changes_nothing(tmp_path):
    context = make_context(1)
    commit(context, 1, 1.0, tmp_path)
    path = state_file_path(tmp_path, "c1")
    before_file = path.read_bytes()
    before_state = {k: v for k, v in context.state.items()}

    for first in (True, False):
        st = ClientState(context, server_round=2, first_message=first, state_dir=tmp_path, client_id="c1")
        st.set("m", vec(5.0))
        st.set("new", vec(6.0))
        st.pop("m")
    st = ClientState(context, server_round=2)  # context.state only
    st.set("m", vec(7.0))

    assert path.read_bytes() == before_file
    assert dir_listing(path.parent) == [path.name]
    assert dict(context.state.items()) == before_state
    np.testing.assert_array_equal(context.state.array_records[STATE_KEY]["m"].numpy(), vec(1.0))


def test_constructing_without_state_dir_creates_no_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    st = ClientState(make_context(1), server_round=1, state_dir="", client_id="c1")  # "" = no file
    st.set("m", vec(1.0))
    st.commit()
    assert st.path is None
    assert dir_listing(tmp_path) == []


def test_loaded_vectors_can_be_updated_in_place(tmp_path):
    context = make_context(1)
    commit(context, 1, 1.0, tmp_path)
    for st in (ClientState(context, server_round=2), load(2, tmp_path)):  # from context.state, from the file
        st.get("m")[:] += 1.0
        np.testing.assert_array_equal(st.get("m"), vec(2.0))


# ----------------------------------------------------------------------------------------- the file
def test_restarted_node_loads_state_from_file(tmp_path):
    commit(make_context(1), 1, 1.0, tmp_path)
    assert state_file_path(tmp_path, "c1") == tmp_path / "default" / "c1.npz"

    st = load(2, tmp_path)  # new Context: restarted SuperNode / resumed run
    assert st.base_round == 1
    np.testing.assert_array_equal(st.get("m"), vec(1.0))
    assert st.get("m").dtype == np.float32


def test_first_message_ignores_context_state_when_file_is_set(tmp_path):
    context = make_context(1)
    commit(context, 1, 1.0, tmp_path)
    for meta_round in (1, 2):  # whatever context.state says, even "written in this round", the file wins
        context.state[STATE_KEY] = ArrayRecord()
        context.state[META_KEY] = ConfigRecord({"round": meta_round})
        st = ClientState(context, server_round=2, state_dir=tmp_path, client_id="c1")
        assert st.base_round == 1
        np.testing.assert_array_equal(st.get("m"), vec(1.0))


def test_rerun_of_a_round_starts_from_the_state_before_it(tmp_path):
    a, b, c = 1.0, 2.0, 3.0
    context = make_context(1)
    commit(context, 1, a, tmp_path)
    commit(context, 2, b, tmp_path)
    path = state_file_path(tmp_path, "c1")
    snaps = read_state_file(path)
    assert (snaps["current"].round, snaps["previous"].round) == (2, 1)

    # the server crashed after the clients finished round 2 and re-runs round 2
    rerun = load(2, tmp_path)
    assert rerun.base_round == 1
    np.testing.assert_array_equal(rerun.get("m"), vec(a))
    rerun.set("m", vec(c))
    rerun.commit()

    snaps = read_state_file(path)
    assert snaps["current"].round == 2 and snaps["previous"].round == 1
    np.testing.assert_array_equal(snaps["current"].arrays["m"], vec(c))
    np.testing.assert_array_equal(snaps["previous"].arrays["m"], vec(a))

    nxt = load(3, tmp_path)
    assert nxt.base_round == 2
    np.testing.assert_array_equal(nxt.get("m"), vec(c))


def test_only_two_snapshots_are_kept(tmp_path):
    context = make_context(1)
    for r in range(1, 5):
        commit(context, r, float(r), tmp_path)
    snaps = read_state_file(state_file_path(tmp_path, "c1"))
    assert {k: s.round for k, s in snaps.items()} == {"current": 4, "previous": 3}
    assert load(1, tmp_path).base_round == 0  # nothing written before round 1 is left: fresh
    assert load(1, tmp_path).names() == []


def test_resume_from_an_older_checkpoint_drops_newer_snapshots(tmp_path):
    context = make_context(1)
    for r in (1, 2, 3):
        commit(context, r, float(r), tmp_path)
    with capture_flwr_logs() as logs:
        commit(make_context(1), 2, 9.0, tmp_path)  # file held rounds 3 and 2; round 3 is from an abandoned run
    assert "dropping" in messages_text(logs)
    snaps = read_state_file(state_file_path(tmp_path, "c1"))
    assert {k: s.round for k, s in snaps.items()} == {"current": 2}


def test_mid_round_message_sees_in_progress_state(tmp_path):
    context = make_context(1)
    commit(context, 1, 1.0, tmp_path)
    commit(context, 2, 2.0, tmp_path)  # phase 1 of round 2

    # phase 2 of round 2, same node: from context.state
    st = ClientState(context, server_round=2, first_message=False, state_dir=tmp_path, client_id="c1")
    assert st.base_round == 2
    np.testing.assert_array_equal(st.get("m"), vec(2.0))
    st.set("gossip", vec(5.0))
    st.commit()

    # the node restarted between the phases: context.state is empty, the file has round 2
    st = load(2, tmp_path, first_message=False)
    assert st.base_round == 2
    np.testing.assert_array_equal(st.get("m"), vec(2.0))
    np.testing.assert_array_equal(st.get("gossip"), vec(5.0))
    # the round-2 re-commit replaced current and kept previous
    snaps = read_state_file(state_file_path(tmp_path, "c1"))
    assert {k: s.round for k, s in snaps.items()} == {"current": 2, "previous": 1}


def test_mid_round_with_context_state_from_an_earlier_round_uses_the_file(tmp_path):
    context = make_context(1)
    commit(context, 1, 1.0, tmp_path)
    commit(make_context(2), 2, 2.0, tmp_path)  # round 2 committed by another process for this client
    st = ClientState(context, server_round=2, first_message=False, state_dir=tmp_path, client_id="c1")
    assert st.base_round == 2
    np.testing.assert_array_equal(st.get("m"), vec(2.0))


def test_mid_round_without_state_dir_reads_context_state():
    context = make_context(1)
    st = ClientState(context, server_round=3)
    st.set("m", vec(3.0))
    st.commit()
    later = ClientState(context, server_round=3, first_message=False)
    assert later.base_round == 3
    np.testing.assert_array_equal(later.get("m"), vec(3.0))


def test_clients_and_run_keys_are_separate(tmp_path):
    commit(make_context(1), 1, 1.0, tmp_path, client_id="c1")
    commit(make_context(2), 1, 2.0, tmp_path, client_id="c2")
    commit(make_context(1), 1, 3.0, tmp_path, client_id="c1", run_key="exp-b")

    np.testing.assert_array_equal(load(2, tmp_path, client_id="c1").get("m"), vec(1.0))
    np.testing.assert_array_equal(load(2, tmp_path, client_id="c2").get("m"), vec(2.0))
    np.testing.assert_array_equal(load(2, tmp_path, client_id="c1", run_key="exp-b").get("m"), vec(3.0))
    assert load(2, tmp_path, client_id="c3").names() == []
    assert load(2, tmp_path, client_id="c2", run_key="exp-b").names() == []


def test_client_ids_and_run_keys_become_safe_distinct_file_names(tmp_path):
    plain = state_file_path(tmp_path, "node-1.a_B")
    assert plain == tmp_path / "default" / "node-1.a_B.npz"
    odd = state_file_path(tmp_path, "a/b c", run_key="../x")
    assert odd.parent.parent == tmp_path and odd.parent.name.startswith(".._x-")
    assert odd.name.startswith("a_b_c-") and odd.suffix == ".npz"
    assert state_file_path(tmp_path, "a_b_c").name == "a_b_c.npz"  # a plain id never gets the hash
    assert state_file_path(tmp_path, "a b") != state_file_path(tmp_path, "a_b")
    assert state_file_path(tmp_path, "x", run_key="..").parent.name not in (".", "..")
    assert len(state_file_path(tmp_path, "z" * 1000).name) < 200


@pytest.mark.parametrize("client_id", ["", None])
def test_empty_client_id_with_state_dir_is_refused(tmp_path, client_id):
    with pytest.raises(ValueError, match="non-empty client id"):
        ClientState(make_context(1), server_round=1, state_dir=tmp_path, client_id=client_id)
    assert dir_listing(tmp_path) == []


# ----------------------------------------------------------------------------------------- bad files
def _assert_quarantined(path, logs) -> None:
    text = messages_text(logs)
    assert str(path) in text and "fresh" in text
    assert any(r.levelno == logging.WARNING for r in logs)
    assert not path.exists()
    assert path.with_name(path.name + ".corrupt").exists()


def test_corrupt_file_is_moved_aside_and_state_starts_fresh(tmp_path):
    path = state_file_path(tmp_path, "c1")
    path.parent.mkdir(parents=True)
    garbage = np.random.default_rng(0).bytes(512)
    path.write_bytes(garbage)
    with capture_flwr_logs() as logs:
        st = load(3, tmp_path)
    assert st.base_round == 0 and st.names() == []
    _assert_quarantined(path, logs)
    assert path.with_name(path.name + ".corrupt").read_bytes() == garbage

    st.set("m", vec(1.0))
    st.commit()  # a good file again, next to the kept corrupt one
    assert load(4, tmp_path).base_round == 3


def test_pickled_object_array_is_never_unpickled(tmp_path, monkeypatch):
    path = state_file_path(tmp_path, "c1")
    path.parent.mkdir(parents=True)
    with open(path, "wb") as fh:
        entries = {"current.__round__": np.array(1, dtype=np.int64), "current/m": np.array([{"a": 1}], dtype=object)}
        np.savez(fh, **entries)  # allow_pickle: the object array is pickled into the file

    def no_unpickling(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("the state file was unpickled")

    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    with capture_flwr_logs() as logs:
        st = load(2, tmp_path)
    assert st.names() == [] and st.base_round == 0
    _assert_quarantined(path, logs)
    assert "allow_pickle" in messages_text(logs)


def test_a_member_declaring_a_huge_shape_is_refused_before_allocating(tmp_path):
    # 8 TB declared in a 200-byte file: np.load would try to allocate it; the state file is moved aside.
    import io
    import zipfile

    path = state_file_path(tmp_path, "c1")
    path.parent.mkdir(parents=True)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)})
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("current.__round__.npy", _npy_bytes(np.array(1, dtype=np.int64)))
        zf.writestr("current/m.npy", header.getvalue() + b"\0" * 64)
    with capture_flwr_logs() as logs:
        st = load(2, tmp_path)
    assert st.names() == [] and st.base_round == 0
    _assert_quarantined(path, logs)
    assert "8000000000000 bytes" in messages_text(logs)


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    np.lib.format.write_array(out, array, allow_pickle=False)
    return out.getvalue()


def test_a_pickle_file_is_not_unpickled(tmp_path, monkeypatch):
    path = state_file_path(tmp_path, "c1")
    path.parent.mkdir(parents=True)
    path.write_bytes(pickle.dumps({"current/m": [1, 2]}))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
    with capture_flwr_logs() as logs:
        assert load(2, tmp_path).names() == []
    _assert_quarantined(path, logs)


def _npz(path, **entries) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        np.savez(fh, **entries)


R = np.int64


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        ({"current.__round__": np.array(-1, dtype=R)}, "non-negative"),
        ({"current.__round__": np.array(1.0)}, "non-negative"),
        ({"current.__round__": np.array([1, 2], dtype=R)}, "non-negative"),
        ({"current.__round__": np.array(True)}, "non-negative"),
        ({"current/m": np.ones(2)}, "no 'current.__round__'"),
        ({"current.__round__": np.array(1, dtype=R), "weird": np.ones(2)}, "unknown entry 'weird'"),
        ({"current.__round__": np.array(1, dtype=R), "current/": np.ones(2)}, "unknown entry"),
        ({"previous.__round__": np.array(1, dtype=R)}, "no 'current'"),
        ({"current.__round__": np.array(1, dtype=R), "previous.__round__": np.array(1, dtype=R)}, "not before"),
        ({"current.__round__": np.array(1, dtype=R), "current/m": np.array(["x"])}, "non-numeric"),
        ({"current.__round__": np.array(1, dtype=R), "current/m": np.ones(1, dtype=np.complex128)}, "non-numeric"),
    ],
)
def test_malformed_files_are_refused_with_a_reason(tmp_path, entries, reason):
    path = tmp_path / "s.npz"
    _npz(path, **entries)
    with pytest.raises(ClientStateError, match=reason) as info:
        read_state_file(path)
    assert str(path) in str(info.value)


def test_single_npy_file_is_refused(tmp_path):
    path = tmp_path / "s.npz"
    with open(path, "wb") as fh:
        np.save(fh, np.ones(3))
    with pytest.raises(ClientStateError, match="not an .npz archive"):
        read_state_file(path)


def test_second_corrupt_file_does_not_overwrite_the_first(tmp_path):
    path = state_file_path(tmp_path, "c1")
    path.parent.mkdir(parents=True)
    for content in (b"first", b"second"):
        path.write_bytes(content)
        with capture_flwr_logs():
            load(1, tmp_path)
    assert path.with_name("c1.npz.corrupt").read_bytes() == b"first"
    assert path.with_name("c1.npz.corrupt.1").read_bytes() == b"second"


# ----------------------------------------------------------------------------------------- crash while writing
@pytest.mark.parametrize("target", ["replace", "fsync"])
def test_crash_while_writing_keeps_the_old_file_and_no_temp_file(tmp_path, monkeypatch, target):
    context = make_context(1)
    commit(context, 1, 1.0, tmp_path)
    path = state_file_path(tmp_path, "c1")
    before = path.read_bytes()
    state_before = dict(context.state.items())

    def crash(*args, **kwargs):  # noqa: ANN002, ANN003
        raise OSError("disk gone")

    st = ClientState(context, server_round=2, state_dir=tmp_path, client_id="c1")
    st.set("m", vec(2.0))
    monkeypatch.setattr(os, target, crash)
    with pytest.raises(OSError, match="disk gone"):
        st.commit()
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert dir_listing(path.parent) == [path.name]
    assert dict(context.state.items()) == state_before  # file failed first: context.state untouched
    restarted = load(2, tmp_path)
    assert restarted.base_round == 1
    np.testing.assert_array_equal(restarted.get("m"), vec(1.0))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_state_file_holding_nan_or_inf_is_refused_and_the_client_starts_fresh(tmp_path, bad):
    commit(make_context(1), 1, 1.0, tmp_path)
    path = state_file_path(tmp_path, "c1")
    entries = dict(np.load(path))
    entries["current/m"] = entries["current/m"].copy()
    entries["current/m"][2] = bad
    np.savez(path, **entries)
    with capture_flwr_logs() as records:
        fresh = load(2, tmp_path)
    assert fresh.base_round == 0 and fresh.get("m") is None
    assert "entry 'current/m' holds NaN or Inf; expected finite values" in messages_text(records)
    assert path.with_name(path.name + ".corrupt").is_file()


def test_a_vector_of_the_wrong_shape_or_dtype_starts_fresh_with_one_line(tmp_path):
    commit(make_context(1), 1, 1.0, tmp_path)
    state = load(2, tmp_path)
    with capture_flwr_logs() as records:
        assert state.get("m", shape=(5,), dtype=np.float32) is None
    text = messages_text(records)
    assert "field 'm'" in text and "is float32 (4,); expected float32 (5,); starting it fresh" in text
    assert state.get("m") is None  # dropped: this piece of state starts fresh, the message goes on
    state = load(2, tmp_path)
    assert state.get("m", shape=(4,), dtype=np.float64) is None
    assert load(2, tmp_path).get("m", shape=(4,), dtype=np.float32) is not None


# ----------------------------------------------------------------------------- client-state-in-memory = false
def test_file_only_state_keeps_nothing_in_context_and_comes_back_from_the_file(tmp_path):
    """A simulation of many stateful clients keeps every node's context in one process: file-only state
    leaves those contexts empty, and the next round (same context) still finds the state."""
    context = make_context(1)
    context.state["user-key"] = ConfigRecord({"kept": 1})
    first = ClientState(context, server_round=1, state_dir=tmp_path, client_id="c1", in_memory=True)
    first.set("m", vec(1.0))
    first.commit()
    assert STATE_KEY in context.state  # the default keeps a copy in memory
    second = ClientState(context, server_round=2, state_dir=tmp_path, client_id="c1", in_memory=False)
    assert second.base_round == 1 and np.array_equal(second.get("m"), vec(1.0))
    second.set("m", vec(2.0))
    second.commit()
    assert STATE_KEY not in context.state and META_KEY not in context.state  # the earlier copy is gone too
    assert context.state.config_records["user-key"]["kept"] == 1  # nothing else touched
    third = ClientState(context, server_round=3, state_dir=tmp_path, client_id="c1", in_memory=False)
    assert third.base_round == 2 and np.array_equal(third.get("m"), vec(2.0))


def test_file_only_state_serves_a_mid_round_message_from_the_file(tmp_path):
    context = make_context(1)
    start = ClientState(context, server_round=4, state_dir=tmp_path, client_id="c1", in_memory=False)
    start.set("m", vec(4.0))
    start.commit()
    later = ClientState(
        context, server_round=4, first_message=False, state_dir=tmp_path, client_id="c1", in_memory=False
    )
    assert later.base_round == 4 and np.array_equal(later.get("m"), vec(4.0))


def test_file_only_state_without_a_state_dir_is_refused():
    with pytest.raises(ValueError, match="client-state-in-memory = false needs a state directory"):
        ClientState(make_context(1), server_round=1, in_memory=False)


def test_run_config_refuses_file_only_state_without_state_dir():
    from pollen.app.config import AppConfig, ConfigError, defaults_from_pyproject
    from pollen.testing.flwr_cli import REPO

    defaults = defaults_from_pyproject(str(REPO / "pyproject.toml"))
    with pytest.raises(ConfigError, match="'client-state-in-memory' = false needs 'state-dir'"):
        AppConfig.from_run_config({**defaults, "client-state-in-memory": False})
    cfg = AppConfig.from_run_config({**defaults, "client-state-in-memory": False, "state-dir": "/tmp/x"})
    assert cfg["client-state-in-memory"] is False


# ----------------------------------------------------------------------------------------- late commits (issue 43)
def test_a_late_commit_of_the_same_session_never_overwrites_a_later_round(tmp_path) -> None:  # noqa: ANN001
    """Population mode: round 3's message timed out on one node while the client trained round 4 on another;
    round 4 committed first. The late round-3 commit must not replace it (the same server session wrote both)."""
    from pollen.clientside.state import ClientState, read_state_file
    from pollen.testing.fakes import make_context

    def state(rnd: int, session: str) -> ClientState:
        return ClientState(
            make_context(1), server_round=rnd, state_dir=tmp_path, client_id="c1", in_memory=False, session=session
        )

    first = state(2, "s1")
    first.set("e", np.full(3, 2.0, np.float32))
    first.commit()
    late, on_time = state(3, "s1"), state(4, "s1")  # both loaded round 2's state
    on_time.set("e", np.full(3, 4.0, np.float32))
    on_time.commit()
    late.set("e", np.full(3, 3.0, np.float32))
    late.commit()  # arrives after round 4's commit
    snapshots = read_state_file(on_time.path)
    assert snapshots["current"].round == 4 and snapshots["current"].session == "s1"
    np.testing.assert_array_equal(snapshots["current"].arrays["e"], np.full(3, 4.0, np.float32))
    assert snapshots["previous"].round == 2


def test_a_resumed_session_replaces_what_the_crashed_one_wrote_after_its_checkpoint(tmp_path) -> None:  # noqa: ANN001
    """A resume is a new server session: its round-3 commit drops the round-5 state the crashed session wrote."""
    from pollen.clientside.state import ClientState, read_state_file
    from pollen.testing.fakes import make_context

    def state(rnd: int, session: str) -> ClientState:
        return ClientState(make_context(1), server_round=rnd, state_dir=tmp_path, client_id="c1", session=session)

    crashed = state(5, "crashed")
    crashed.set("e", np.full(3, 5.0, np.float32))
    crashed.commit()
    resumed = state(3, "resumed")
    resumed.set("e", np.full(3, 3.0, np.float32))
    resumed.commit()
    snapshots = read_state_file(resumed.path)
    assert snapshots["current"].round == 3 and snapshots["current"].session == "resumed"
    assert "previous" not in snapshots


def test_a_bad_session_entry_is_an_unusable_file(tmp_path) -> None:  # noqa: ANN001
    from pollen.clientside.state import ClientStateError, read_state_file
    from pollen.core.files import write_npz_atomic

    path = tmp_path / "c1.npz"
    write_npz_atomic(
        path, {"current.__round__": np.array(1, np.int64), "current.__session__": np.zeros((2, 2), np.uint8)}
    )
    with pytest.raises(ClientStateError, match=r"entry 'current.__session__' must be at most 64 ASCII bytes"):
        read_state_file(path)


def test_one_changed_byte_in_a_stored_vector_is_refused_and_the_state_starts_fresh(tmp_path) -> None:  # noqa: ANN001
    """Issue 43: every file a resume reads is covered. A client-state file is a zip archive whose members carry
    CRC-32s, which the reader checks: one flipped byte inside a residual's values (still a finite float) is
    refused, the file moved aside, and the client starts that state fresh rather than feeding a changed residual
    into its next upload."""
    from pollen.clientside.state import ClientState, ClientStateError, read_state_file
    from pollen.testing.fakes import make_context

    first = ClientState(make_context(1), server_round=1, state_dir=tmp_path, client_id="c1")
    first.set("e", np.arange(4096, dtype=np.float32))
    first.commit()
    raw = bytearray(first.path.read_bytes())
    values = np.arange(4096, dtype=np.float32).tobytes()
    offset = bytes(raw).index(values[4096:4160]) + 1  # a byte inside the stored vector, not the zip's headers
    raw[offset] ^= 0x01
    first.path.write_bytes(bytes(raw))
    with pytest.raises(ClientStateError, match="Bad CRC-32"):
        read_state_file(first.path)
    again = ClientState(make_context(1), server_round=2, state_dir=tmp_path, client_id="c1")
    assert again.get("e") is None and again.base_round == 0
    assert first.path.with_name(first.path.name + ".corrupt").is_file()
