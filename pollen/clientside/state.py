"""``ClientState``: a client's named numpy vectors kept across rounds, in memory and on disk.

Client-side methods carry vectors from one round to the next: error-feedback
residuals, local momentum and second moments, gossip buffers. :class:`ClientState`
is the one place they are kept:

- in Flower's ``context.state`` (a ``RecordDict`` Flower keeps per node across the
  messages of one run): an ``ArrayRecord`` under :data:`STATE_KEY` with the named
  arrays and a ``ConfigRecord`` under :data:`META_KEY` holding ``{"round": r}``, the
  server round after which they were written. Nothing else in ``context.state`` is
  touched.
- and, when a state directory is given, in a node-local file
  ``<state_dir>/<run_key or "default">/<client id>.npz``. ``context.state`` is lost
  when a SuperNode restarts and is empty in a resumed run (a new Flower run); the
  file is not.

Why the file keeps two snapshots
--------------------------------
The server checkpoints after each round, so after a crash it resumes at most one
round behind its clients: it may re-run round ``r`` although a client already
finished round ``r`` and wrote its state. For the resumed run to end bit-identical
to an uninterrupted one, the client must start round ``r`` again from its state as
it was *before* round ``r``. So the file keeps ``current`` (written after round
``r``) and ``previous`` (the snapshot that was current before it, written after an
earlier round), and the first message of round ``r`` loads the newest snapshot
written *before* round ``r``.

Usage (one ``ClientState`` per message; share it between the pieces of one message)::

    state = ClientState(context, server_round=r, state_dir=d, client_id=cid, run_key=key)
    residual = state.get("ef.residual")          # None on a fresh node
    ...
    state.set("ef.residual", new_residual)
    state.commit()                               # nothing is written before this

A ``ClientState`` that is never committed changes nothing (the only exception: an
unusable state file is moved aside to ``<file>.corrupt`` when it is found).

File format
-----------
An uncompressed numpy ``.npz`` archive, read by :func:`pollen.core.files.read_npz` (a
run-config can point at the directory, so nothing in it is ever unpickled and no size it
declares is trusted before it is checked against the file's bytes):

- ``current.__round__``, ``previous.__round__``: 0-d ``int64`` arrays, the round a
  snapshot was written after (non-negative; ``previous`` < ``current``);
- ``current/<name>``, ``previous/<name>``: the snapshot's vectors, any bool, integer
  or real floating dtype and any shape, kept exactly.

``previous`` is optional; a snapshot with vectors must have its round entry; floating
point vectors must be finite (a NaN residual or moment would be fed into every later
upload). A file that breaks any of this is logged (WARNING, naming the file and the reason), renamed
to ``<file>.corrupt`` for a person to inspect, and the client starts fresh. The file
is replaced atomically (temporary file in the same directory, ``fsync``,
``os.replace``), so a crash while writing leaves the old file as it was.

The file cannot know the model, so shapes and dtypes are checked where a vector is used:
``get(name, shape=..., dtype=...)`` drops a vector that does not fit with one WARNING line
and that piece of state starts fresh (the client still answers the message).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import log

from pollen.core.files import NpzError, read_npz, write_npz_atomic
from pollen.wire.records import numpy_to_array

__all__ = [
    "META_KEY",
    "STATE_KEY",
    "ClientState",
    "ClientStateError",
    "StateSnapshot",
    "read_state_file",
    "state_file_path",
]

STATE_KEY = "pollen.client-state"
"""``context.state`` key of the ``ArrayRecord`` that holds the named vectors."""
META_KEY = "pollen.client-state-meta"
"""``context.state`` key of the ``ConfigRecord`` ``{"round": r}``."""
ROUND_FIELD = "round"

CURRENT = "current"
PREVIOUS = "previous"
_SLOTS = (CURRENT, PREVIOUS)
_ROUND_SUFFIX = ".__round__"
_SESSION_SUFFIX = ".__session__"
_MAX_SESSION_CHARS = 64
_NUMERIC_KINDS = "biuf"  # bool, signed and unsigned integers, real floats (as pollen.wire.records accepts)

_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_MAX_NAME_CHARS = 100
_MAX_CORRUPT_COPIES = 1000
_MAX_FIELD_CHARS = 1000
_BLOCK = 1 << 16


def _all_finite(array: np.ndarray) -> bool:
    """No NaN or Inf in ``array``, checked in blocks (no array-sized temporary)."""
    flat = array.reshape(-1)
    return all(np.isfinite(flat[i : i + _BLOCK]).all() for i in range(0, flat.shape[0], _BLOCK))


class ClientStateError(ValueError):
    """A state file that cannot be used (one-line reason naming the file)."""


@dataclass(frozen=True)
class StateSnapshot:
    """Named vectors as they were after server round ``round`` (what :func:`read_state_file` returns per slot)."""

    round: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    #: The server session (one ServerApp process: a run, or one resume of it) that wrote it; "" unknown.
    session: str = ""


_FRESH = StateSnapshot(0)


# ----------------------------------------------------------------------------------------- the helper
class ClientState:
    """A client's named numpy vectors, kept across rounds in ``context.state`` (and a file).

    Parameters
    ----------
    context : flwr.app.Context
        The ClientApp's context; its ``state`` keeps the vectors between messages.
    server_round : int
        The server round of the message being handled (non-negative).
    first_message : bool, default True
        ``True`` for the first message of ``server_round`` that this node handles:
        with a state directory the state is loaded from the file, from the newest
        snapshot written *before* this round (a re-run round starts where it started
        the first time), and ``context.state`` is not read. ``False`` for a later
        message of the same round (e.g. a mid-round gossip phase): ``context.state``
        is used when it was written in this round, else the file's newest snapshot
        written in or before this round. Without a state directory the flag does not
        matter: ``context.state`` is used as it is.
    state_dir : str or os.PathLike, optional
        Node-local directory for the state file. ``None`` or ``""``: no file, the
        state lives in ``context.state`` only (lost on a SuperNode restart).
    client_id : str, default ""
        Names the file; required (non-empty) with ``state_dir``. Characters other
        than ``[A-Za-z0-9._-]`` become ``_`` (then a short hash of the original id is
        appended, so that two ids never share a file).
    run_key : str, default ""
        Names the sub-directory (``"default"`` when empty), so that different
        experiments sharing ``state_dir`` do not share state. A resumed run must use
        the same key as the run it resumes.
    in_memory : bool, default True
        ``False`` (needs ``state_dir``): the state lives in the file only; ``context.state``
        holds none (what an earlier message left there is removed at commit), so a
        simulation of many stateful clients, whose contexts all live in one process,
        keeps flat memory. Every message then reads and writes the file.

    Raises
    ------
    ValueError
        ``server_round`` is not a non-negative integer, ``client_id`` is empty
        while ``state_dir`` is set, or ``in_memory`` is ``False`` without ``state_dir``.

    Notes
    -----
    Use one ``ClientState`` per message and share it between the pieces that handle
    that message (mod, trainer): a second instance built with ``first_message=True``
    in the same round would load the pre-round snapshot again and its commit would
    replace the first one's. One node (one process) per client id and run key.
    """

    def __init__(
        self,
        context: Context,
        *,
        server_round: int,
        first_message: bool = True,
        state_dir: str | os.PathLike[str] | None = None,
        client_id: str = "",
        run_key: str = "",
        in_memory: bool = True,
        session: str = "",
    ) -> None:
        if not isinstance(session, str) or len(session) > _MAX_SESSION_CHARS or not session.isascii():
            raise ValueError(f"session must be an ASCII string of at most {_MAX_SESSION_CHARS} characters")
        self._session = session
        if isinstance(server_round, bool) or not isinstance(server_round, (int, np.integer)) or server_round < 0:
            raise ValueError(f"server_round must be a non-negative integer, got {server_round!r}")
        self._context = context
        self._round = int(server_round)
        self._path = state_file_path(state_dir, client_id, run_key) if state_dir not in (None, "") else None
        if not in_memory and self._path is None:
            raise ValueError(
                "client-state-in-memory = false needs a state directory (node-config or run-config state-dir)"
            )
        self._in_memory = bool(in_memory)
        loaded = self._load(first_message)
        self._base_round = loaded.round
        self._arrays: dict[str, np.ndarray] = dict(loaded.arrays)

    # -- reading and changing the vectors (in memory until commit)
    @property
    def context(self) -> Context:
        """The Flower context of the message this state is for (its ``node_config``: the node's own settings)."""
        return self._context

    @property
    def base_round(self) -> int:
        """The round after which the loaded state was written (0: fresh, nothing loaded)."""
        return self._base_round

    @property
    def server_round(self) -> int:
        """The round this state is for; :meth:`commit` records it."""
        return self._round

    @property
    def path(self) -> Path | None:
        """The state file, or ``None`` without a state directory."""
        return self._path

    def get(self, name: str, *, shape: tuple[int, ...] | None = None, dtype: Any = None) -> np.ndarray | None:
        """The vector stored as ``name`` (not a copy), or ``None`` when there is none.

        With ``shape`` and / or ``dtype`` the stored vector must have them; one that does not (a file
        from another model, or edited by hand) is dropped with one WARNING line naming the field and
        what was expected, and ``None`` is returned: this state starts fresh, the message goes on.
        """
        value = self._arrays.get(name)
        if value is None:
            return None
        wrong_shape = shape is not None and value.shape != tuple(shape)
        wrong_dtype = dtype is not None and value.dtype != np.dtype(dtype)
        if wrong_shape or wrong_dtype:
            parts = (str(np.dtype(dtype)) if dtype is not None else "", str(shape) if shape is not None else "")
            want = " ".join(part for part in parts if part)
            log(
                WARNING,
                "pollen client state: field '%s' of %s is %s %s; expected %s; starting it fresh",
                name,
                self._path or "context.state",
                value.dtype,
                value.shape,
                want,
            )
            del self._arrays[name]
            return None
        return value

    def set(self, name: str, value: np.ndarray) -> None:
        """Store a copy of ``value`` as ``name`` (any numeric dtype and shape, kept exactly).

        Raises
        ------
        ValueError
            ``name`` is not a non-empty string.
        TypeError
            ``value`` is not bool, integer or real floating point (e.g. an object,
            string or complex array).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a client-state name must be a non-empty string, got {name!r}")
        array = np.array(value)
        if array.dtype.kind not in _NUMERIC_KINDS:
            raise TypeError(f"client-state '{name}' must be a numeric array, got dtype {array.dtype}")
        self._arrays[name] = array

    def pop(self, name: str) -> np.ndarray | None:
        """Remove ``name`` and return its vector (``None`` when there was none)."""
        return self._arrays.pop(name, None)

    def names(self) -> list[str]:
        """Names of the stored vectors, in the order they were first stored."""
        return list(self._arrays)

    # -- writing
    def commit(self) -> None:
        """Write the vectors, as the state after :attr:`server_round`, to the file and ``context.state``.

        The file is written first (atomically); if that fails the error propagates
        and ``context.state`` is left as it was. In the file, the new state becomes
        ``current``; ``previous`` becomes the newest old snapshot written before
        this round (the old ``current``, or the old ``previous`` when the old
        ``current`` is from this round, i.e. a re-commit or a re-run of the round).
        """
        snapshot = StateSnapshot(self._round, dict(self._arrays), self._session)
        if self._path is not None:
            with _locked(self._path):  # read, roll and write as one step: another process may commit this client
                rolled = _roll(_load_file(self._path), snapshot, self._path)
                if rolled is None:
                    return  # a late commit: this server session already wrote a later round
                _write_file(self._path, rolled)
        if self._in_memory:
            _write_context(self._context, snapshot)
        else:
            _clear_context(self._context)

    # -- inner
    def _load(self, first_message: bool) -> StateSnapshot:
        in_context = _read_context(self._context) if self._in_memory else None
        if self._path is None:
            return in_context or _FRESH
        if not first_message and in_context is not None and in_context.round == self._round:
            return in_context
        snapshots = _load_file(self._path)
        return _newest(snapshots, self._round, inclusive=not first_message) or _FRESH


# ----------------------------------------------------------------------------------------- file names
def state_file_path(state_dir: str | os.PathLike[str], client_id: str, run_key: str = "") -> Path:
    """``<state_dir>/<run_key or "default">/<safe client_id>.npz``.

    Raises
    ------
    ValueError
        ``client_id`` is empty.
    """
    if not isinstance(client_id, str) or not client_id:
        raise ValueError(
            f"a client state file needs a non-empty client id (state dir {os.fspath(state_dir)!r}, "
            f"client id {client_id!r}); give each node its own id or unset the state directory"
        )
    return Path(state_dir) / _safe_file_name(run_key or "default") / f"{_safe_file_name(client_id)}.npz"


def _safe_file_name(text: str) -> str:
    """``text`` with characters outside ``[A-Za-z0-9._-]`` as ``_``; never ``.``/``..``.

    When anything had to change (or the name is long), a short hash of the original
    is appended so that different texts never map to the same name.
    """
    safe = _UNSAFE_CHARS.sub("_", text)
    if not safe.strip("."):
        safe = safe.replace(".", "_")
    if safe != text or len(safe) > _MAX_NAME_CHARS:
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        safe = f"{safe[:_MAX_NAME_CHARS]}-{digest}"
    return safe


# ----------------------------------------------------------------------------------------- context.state
def _read_context(context: Context) -> StateSnapshot | None:
    """The state in ``context.state``, or ``None`` when there is none (round 0 without meta)."""
    record = context.state.array_records.get(STATE_KEY)
    if record is None:
        return None
    meta = context.state.config_records.get(META_KEY)
    value = meta.get(ROUND_FIELD) if meta is not None else None
    round_ = value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
    # Flower's own reader (np.load, allow_pickle=False): writable copies. context.state is this
    # node's own memory, written by _write_context, not bytes from the wire.
    return StateSnapshot(round_, {name: array.numpy() for name, array in record.items()})


def _clear_context(context: Context) -> None:
    for key in (STATE_KEY, META_KEY):
        if key in context.state:
            del context.state[key]


def _write_context(context: Context, snapshot: StateSnapshot) -> None:
    # np.require keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d).
    record = ArrayRecord({name: numpy_to_array(a) for name, a in snapshot.arrays.items()})
    context.state[STATE_KEY] = record
    context.state[META_KEY] = ConfigRecord({ROUND_FIELD: snapshot.round})


# ----------------------------------------------------------------------------------------- snapshots
def _newest(snapshots: Mapping[str, StateSnapshot], server_round: int, *, inclusive: bool) -> StateSnapshot | None:
    """The newest snapshot written before ``server_round`` (or in it, when ``inclusive``)."""
    usable = [s for s in snapshots.values() if s.round < server_round or (inclusive and s.round == server_round)]
    return max(usable, key=lambda s: s.round, default=None)


def _roll(old: Mapping[str, StateSnapshot], new: StateSnapshot, path: Path) -> dict[str, StateSnapshot] | None:
    """The file's snapshots after committing ``new``: ``new`` and the newest older one; ``None`` when ``new``
    is a late commit (the same server session already wrote a later round: a message that timed out on one
    node while the next round bound the client to another, population mode) and must not overwrite it."""
    later = sorted(s.round for s in old.values() if s.round > new.round)
    if later and new.session and any(s.session == new.session for s in old.values() if s.round > new.round):
        log(
            WARNING,
            "pollen client state: %s already holds round %d of this server session; the late commit of round %d "
            "is not written (it timed out and the client went on elsewhere)",
            path,
            later[-1],
            new.round,
        )
        return None
    if later:
        log(
            WARNING,
            "pollen client state: %s holds state written after round %s, newer than round %d being "
            "committed (the run resumed from an earlier checkpoint); dropping it",
            path,
            "/".join(map(str, later)),
            new.round,
        )
    kept = _newest(old, new.round, inclusive=False)
    return {CURRENT: new} if kept is None else {CURRENT: new, PREVIOUS: kept}


# ----------------------------------------------------------------------------------------- the file
def read_state_file(path: str | os.PathLike[str]) -> dict[str, StateSnapshot]:
    """Read and validate a state file: ``{"current": snapshot, "previous": snapshot}`` (either may be absent).

    Raises
    ------
    ClientStateError
        The file is not a valid state file (the message names the file and why).
    FileNotFoundError
        There is no file.
    """
    path = Path(path)
    entries = _read_npz(path)
    rounds: dict[str, int] = {}
    sessions: dict[str, str] = {}
    arrays: dict[str, dict[str, np.ndarray]] = {slot: {} for slot in _SLOTS}
    for key, value in entries.items():
        slot, sep, name = key.partition("/")
        if sep and slot in _SLOTS and name:
            if value.dtype.kind not in _NUMERIC_KINDS:
                raise ClientStateError(f"{path}: entry '{key}' has non-numeric dtype {value.dtype}")
            if len(name) > _MAX_FIELD_CHARS:
                raise ClientStateError(f"{path}: entry '{key[:40]}...' has a name of {len(name)} characters")
            if value.dtype.kind == "f" and not _all_finite(value):
                raise ClientStateError(f"{path}: entry '{key}' holds NaN or Inf; expected finite values")
            arrays[slot][name] = value
        elif key in (CURRENT + _ROUND_SUFFIX, PREVIOUS + _ROUND_SUFFIX):
            rounds[key[: -len(_ROUND_SUFFIX)]] = _parse_round(path, key, value)
        elif key in (CURRENT + _SESSION_SUFFIX, PREVIOUS + _SESSION_SUFFIX):
            sessions[key[: -len(_SESSION_SUFFIX)]] = _parse_session(path, key, value)
        else:
            raise ClientStateError(f"{path}: unknown entry '{key}'")
    for slot in _SLOTS:
        if arrays[slot] and slot not in rounds:
            raise ClientStateError(f"{path}: snapshot '{slot}' has vectors but no '{slot}{_ROUND_SUFFIX}' entry")
    if PREVIOUS in rounds and CURRENT not in rounds:
        raise ClientStateError(f"{path}: has a 'previous' snapshot but no 'current' one")
    if PREVIOUS in rounds and rounds[PREVIOUS] >= rounds[CURRENT]:
        raise ClientStateError(
            f"{path}: 'previous' round {rounds[PREVIOUS]} is not before 'current' round {rounds[CURRENT]}"
        )
    return {
        slot: StateSnapshot(rounds[slot], arrays[slot], sessions.get(slot, "")) for slot in _SLOTS if slot in rounds
    }


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """All entries of an ``.npz`` file, read by :func:`pollen.core.files.read_npz` (no pickle, every size
    checked against the file's bytes before it is allocated); ``ClientStateError`` otherwise."""
    try:
        return read_npz(path)
    except FileNotFoundError:
        raise
    except NpzError as err:
        raise ClientStateError(f"{path}: not a readable .npz file ({err.why})") from err
    except OSError as err:  # a folder, no permission: unusable like a damaged file
        raise ClientStateError(f"{path}: not a readable .npz file ({_reason(err)})") from err


def _parse_round(path: Path, key: str, value: np.ndarray) -> int:
    if value.shape != () or value.dtype.kind not in "iu" or int(value) < 0:
        raise ClientStateError(
            f"{path}: entry '{key}' must be a non-negative integer scalar, got dtype {value.dtype} shape {value.shape}"
            + (f" value {value!r}" if value.size == 1 else "")
        )
    return int(value)


def _parse_session(path: Path, key: str, value: np.ndarray) -> str:
    if value.ndim != 1 or value.dtype != np.uint8 or value.size > _MAX_SESSION_CHARS:
        raise ClientStateError(
            f"{path}: entry '{key}' must be at most {_MAX_SESSION_CHARS} ASCII bytes (uint8), got dtype "
            f"{value.dtype} shape {value.shape}"
        )
    text = bytes(value).decode("ascii", errors="replace")
    if not text.isascii() or "\ufffd" in text:
        raise ClientStateError(f"{path}: entry '{key}' is not ASCII")
    return text


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` (POSIX ``flock``; nothing where it is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no lock, one writer per client as documented
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _load_file(path: Path) -> dict[str, StateSnapshot]:
    """The file's snapshots; ``{}`` when there is no file or it is unusable (then it is moved aside)."""
    try:
        return read_state_file(path)
    except FileNotFoundError:
        return {}
    except ClientStateError as err:
        _quarantine(path, str(err))
        return {}


def _quarantine(path: Path, reason: str) -> None:
    """Log why ``path`` is unusable and rename it to ``<file>.corrupt`` (never delete it)."""
    target = _free_corrupt_name(path)
    try:
        os.replace(path, target)
        where = f"moved to {target}"
    except OSError as err:
        where = f"left in place, could not be moved aside: {_reason(err)}"
    log(WARNING, "pollen client state: unusable state file %s; starting from a fresh state (%s)", reason, where)


def _free_corrupt_name(path: Path) -> Path:
    target = path.with_name(path.name + ".corrupt")
    for i in range(1, _MAX_CORRUPT_COPIES):
        if not target.exists():
            break
        target = path.with_name(f"{path.name}.corrupt.{i}")
    return target


def _write_file(path: Path, snapshots: Mapping[str, StateSnapshot]) -> None:
    """Replace ``path`` atomically by an ``.npz`` of ``snapshots`` (see the module docstring)."""
    entries: dict[str, np.ndarray] = {}
    for slot, snapshot in snapshots.items():
        entries[slot + _ROUND_SUFFIX] = np.array(snapshot.round, dtype=np.int64)
        if snapshot.session:
            entries[slot + _SESSION_SUFFIX] = np.frombuffer(snapshot.session.encode("ascii"), dtype=np.uint8)
        for name, array in snapshot.arrays.items():
            entries[f"{slot}/{name}"] = array
    write_npz_atomic(path, entries)
