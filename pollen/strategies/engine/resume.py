"""A run's checkpoint: the global model, the strategy's full state and the results so far, per round.

:class:`RunCheckpoint` is what :meth:`pollen.strategies.engine.rounds.RoundLoop.start` writes after every round
and reads back to resume. The file (``<run dir>/checkpoint.npz``) is written atomically by
:mod:`pollen.core.checkpoint` (temporary file, fsync, rename), so a crash while writing leaves the previous
checkpoint usable, and it is read without pickle. A checkpoint is tied to what wrote it: the strategy
class and a fingerprint (the app passes its run-config); resuming with another strategy, model or
setting is refused with one line that says what differs.

A checkpoint file can be handed to a run by anyone (run-config ``resume`` names a directory), so:

- **its digest is recorded as written**: ``<run dir>/checkpoint.npz.sha256`` (``sha256sum`` format, so
  ``sha256sum -c`` checks it by hand) holds the sha256 of the checkpoint. It is written before the new
  checkpoint replaces the old one, listing both digests, and rewritten with the new one only after, so
  a crash at any point leaves a digest file that covers the checkpoint on disk. Resume refuses a
  checkpoint whose digest is not listed (or that has no digest file) with one line, unless the run
  trusts the file (``trust_file=True``, run-config ``resume-trust-file=true``: a file you edited or
  copied from elsewhere on purpose).
- **every field is checked before anything changes** (:mod:`pollen.core.state_fields`): the round
  within the run (a whole number in ``[1, num_rounds]``: the ``num_rounds`` the round driver resumes for,
  and the fingerprint's ``num-server-rounds`` when it has one; a trusted file too), the saved model equal to
  the strategy's (Flower's baselines, which hold it as Flower does, check it themselves), the
  results and the app's rows well-formed, and the strategy's own state through its ``load_state_dict``
  (names, dtypes, shapes against the model and the run-config, ranges and invariants). A refusal is a
  :class:`~pollen.core.state_fields.StateError` (a ``ValueError``) naming the file and the field; the
  strategy is then untouched.
- **a finished run is not resumed**: a checkpoint of round ``num_rounds`` (the run's last) is refused
  saying that the run already finished and that a larger ``num_rounds`` trains further, rather than
  loaded to run no round (the app refuses it the same way, naming run-config ``resume``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp.strategy import Result

from pollen.core import state_fields as fields
from pollen.core.checkpoint import CheckpointError, describe_difference, load_checkpoint, save_checkpoint
from pollen.core.files import sha256_of, write_bytes_atomically
from pollen.strategies.engine.model import saved_layout
from pollen.wire.records import arrays_to_record, record_to_arrays

CHECKPOINT_FILE = "checkpoint.npz"
#: The digest file beside the checkpoint (``sha256sum`` format).
DIGEST_FILE = CHECKPOINT_FILE + ".sha256"
_RESULT_FIELDS = ("train_metrics_clientapp", "evaluate_metrics_clientapp", "evaluate_metrics_serverapp")
_TREE_FIELDS = ("round", "strategy_class", "fingerprint", "arrays", "strategy", "result", "app", "driver")
_DIGEST_LINE = re.compile(r"([0-9a-f]{64})  " + re.escape(CHECKPOINT_FILE))
#: The largest run-config value a fingerprint may hold (a string) and the most rows the app may keep.
_MAX_TEXT, _MAX_ROWS = 4096, 10**7


@dataclass
class SavedRound:
    """What a checkpoint restores: the last complete round, its model and results, the app's own state."""

    server_round: int
    arrays: ArrayRecord
    result: Result
    app_state: dict[str, Any]
    #: The round driver's own state (empty for lock-step rounds; the asynchronous driver's jobs in flight).
    driver_state: dict[str, Any] = field(default_factory=dict)


class RunCheckpoint:
    """Where a run checkpoints, and whether it resumes from there.

    Parameters
    ----------
    run_dir : str | Path
        Directory of the run; the checkpoint is ``run_dir/checkpoint.npz``.
    resume : bool (default: False)
        Continue from the checkpoint in ``run_dir`` (it must exist) instead of starting at round 1.
    fingerprint : mapping (default: empty)
        Settings that must be equal to resume (the app passes its run-config).
    ignore : iterable of str
        Fingerprint keys allowed to differ on resume (e.g. the number of rounds, the device).
    stop_after_round : int (default: 0)
        Stop the loop (``RunInterrupted``) after this round's checkpoint; 0 never stops. For tests and
        for splitting a long run into jobs.
    app_state : callable, optional
        Returns extra JSON-able/numpy state to keep with each checkpoint (the app's result rows).
    trust_file : bool (default: False)
        Resume from a checkpoint whose digest does not match the run directory's record (or that has
        none): for a file edited or copied in on purpose. Every field is still checked.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        resume: bool = False,
        fingerprint: Mapping[str, Any] | None = None,
        ignore: Iterable[str] = (),
        stop_after_round: int = 0,
        app_state: Callable[[], dict[str, Any]] | None = None,
        trust_file: bool = False,
    ) -> None:
        self.path = Path(run_dir) / CHECKPOINT_FILE
        self.digest_path = Path(run_dir) / DIGEST_FILE
        self.trust_file = trust_file
        self.resume = resume
        self.fingerprint = dict(fingerprint or {})
        self.ignore = tuple(ignore)
        self.stop_after_round = stop_after_round
        self.app_state = app_state
        self.last_bytes = 0
        self.last_seconds = 0.0

    # ------------------------------------------------------------------ write
    def save(
        self,
        server_round: int,
        arrays: ArrayRecord,
        strategy: Any,
        result: Result,
        driver_state: dict[str, Any] | None = None,
    ) -> None:
        """Write the checkpoint of a complete round (atomically); ``driver_state``: what the round driver keeps
        beyond the strategy (the asynchronous driver's jobs in flight), checked by the driver on load."""
        started = time.perf_counter()
        named = record_to_arrays(arrays)
        tree = {
            "round": int(server_round),
            "strategy_class": type(strategy).__name__,
            "fingerprint": self.fingerprint,
            "arrays": [[name, np.array(value)] for name, value in named.items()],
            "strategy": strategy.state_dict(),
            "result": {name: _metrics_to_tree(getattr(result, name)) for name in _RESULT_FIELDS},
            "app": self.app_state() if self.app_state is not None else {},
            "driver": dict(driver_state or {}),
        }
        listed, written = self._listed_digests(), []

        def record(digest: str) -> None:  # the new digest, and the old file's while it is still there
            self._write_digests([digest, *[old for old in listed[:1] if old != digest]])
            written.append(digest)

        self.last_bytes = save_checkpoint(self.path, tree, before_replace=record)
        self._write_digests(written)
        self.last_seconds = time.perf_counter() - started

    def _write_digests(self, digests: list[str]) -> None:
        text = "".join(f"{digest}  {CHECKPOINT_FILE}\n" for digest in digests)
        write_bytes_atomically(self.digest_path, text.encode("ascii"))

    def _listed_digests(self) -> list[str]:
        """The digests the run directory lists for its checkpoint (empty when the digest file is unusable)."""
        try:
            text = self.digest_path.read_bytes()[:1024].decode("ascii")
        except (OSError, UnicodeDecodeError):
            return []
        lines = text.splitlines()
        matches = [_DIGEST_LINE.fullmatch(line) for line in lines]
        if not lines or len(lines) > 2 or not all(matches):
            return []
        return [match.group(1) for match in matches]

    # ------------------------------------------------------------------ read
    def validate(self, strategy_class: str) -> int:
        """Check that the checkpoint exists and fits this run; return its round. ``CheckpointError`` if not."""
        return int(self._read(strategy_class)["round"])

    def read_app_state(self, strategy_class: str) -> dict[str, Any]:
        """The app's own state kept with the checkpoint (after the same checks as :meth:`load`)."""
        return dict(self._read(strategy_class)["app"])

    def load(self, strategy: Any, *, num_rounds: int | None = None) -> SavedRound:
        """Restore ``strategy`` from the checkpoint and return the round, model and results it holds.

        All or nothing: the file and every field are checked before the strategy changes, and a refusal
        (:class:`~pollen.core.state_fields.StateError`, one line naming the file and the field) leaves it
        as it was. ``num_rounds``: the rounds of the run that resumes (what the round driver was given);
        the saved round must be in ``[1, num_rounds - 1]`` (``num_rounds`` itself: the run already finished).
        """
        tree = self._read(type(strategy).__name__, num_rounds)
        server_round = int(tree["round"])
        if num_rounds is not None and server_round == num_rounds:
            raise fields.StateError(
                "round",
                f"is {server_round}: the run already finished its last round (num_rounds={num_rounds}); "
                f"resume it with num_rounds > {server_round} to train further",
                source=str(self.path),
            )
        named = self._checked_arrays(tree, strategy)
        try:
            strategy.load_state_dict(tree["strategy"], server_round=server_round)
        except fields.StateError as err:
            raise err.in_file(str(self.path)) from None
        arrays = arrays_to_record(named)
        result = Result(arrays=arrays)
        for name in _RESULT_FIELDS:
            setattr(result, name, _metrics_from_tree(tree["result"][name]))
        return SavedRound(server_round, arrays, result, dict(tree["app"]), dict(tree["driver"]))

    def _read(self, strategy_class: str, num_rounds: int | None = None) -> dict[str, Any]:
        if not self.path.is_file():
            raise CheckpointError(f"nothing to resume: {self.path} does not exist")
        self._check_digest()
        tree = load_checkpoint(self.path)
        if isinstance(tree, dict):
            tree.setdefault("driver", {})  # written before drivers kept state: lock-step rounds
        try:
            self._check_tree(tree, num_rounds)
        except fields.StateError as err:
            raise err.in_file(str(self.path)) from None
        if tree["strategy_class"] != strategy_class:
            raise CheckpointError(
                f"resume refused: the checkpoint was written by {tree['strategy_class']}, "
                f"this run uses {strategy_class}"
            )
        difference = describe_difference(tree["fingerprint"], self.fingerprint, ignore=self.ignore)
        if difference is not None:
            raise CheckpointError(f"resume refused: {difference}")
        return tree

    def _check_digest(self) -> None:
        """Refuse a checkpoint whose sha256 the run directory does not list (unless the file is trusted)."""
        if self.trust_file:
            return
        listed = self._listed_digests()
        override = "resume-trust-file=true loads it anyway (every field is still checked)"
        if not listed:
            raise CheckpointError(
                f"resume refused: {self.digest_path} is missing or unreadable, so {self.path} cannot be checked "
                f"against the digest written with it; {override}"
            )
        actual = sha256_of(self.path)
        if actual not in listed:
            raise CheckpointError(
                f"resume refused: {self.path} has sha256 {actual[:16]}..., not the {listed[0][:16]}... recorded "
                f"in {self.digest_path.name} when it was written (changed since); {override}"
            )

    def _check_tree(self, tree: dict[str, Any], num_rounds: int | None = None) -> None:
        """The checkpoint's own fields (the strategy checks its state itself)."""
        fields.mapping(tree, "", keys=_TREE_FIELDS)
        server_round = self._checked_round(tree["round"], num_rounds)
        fields.text(tree["strategy_class"], "strategy_class", most=200)
        for key, value in fields.mapping(tree["fingerprint"], "fingerprint").items():
            _scalar(value, fields.join("fingerprint", key))
        for name, array in fields.pairs(tree["arrays"], "arrays"):
            fields.numeric_array(array, fields.join("arrays", name))
        fields.mapping(tree["result"], "result", keys=_RESULT_FIELDS)
        for name in _RESULT_FIELDS:
            _check_metrics(tree["result"][name], fields.join("result", name), server_round)
        _check_app_state(tree["app"], server_round)
        fields.mapping(tree["strategy"], "strategy")
        fields.mapping(tree["driver"], "driver")

    def _checked_round(self, value: Any, num_rounds: int | None) -> int:
        """The saved round: a whole number from 1 to the run's rounds (the smaller of ``num_rounds`` and the
        fingerprint's ``num-server-rounds``, each where given), the bound named in a refusal."""
        bounds = [
            (rounds, f"{name}={rounds}{what}")
            for rounds, name, what in (
                (num_rounds, "num_rounds", ", the rounds of this run"),
                (self.fingerprint.get("num-server-rounds"), "num-server-rounds", " in the run-config"),
            )
            if isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1
        ]
        high, bound = min(bounds, key=lambda item: item[0]) if bounds else (fields.MAX_COUNT, "")
        try:
            return fields.whole(value, "round", low=1, high=high)
        except fields.StateError as err:
            raise fields.StateError(err.field, f"{err.why} ({bound})" if bound else err.why) from None

    def _checked_arrays(self, tree: dict[str, Any], strategy: Any) -> dict[str, np.ndarray]:
        """The saved model, which must be the strategy's own: for pollen's strategies the same names, shapes,
        dtypes and values as their flat model; a strategy that holds its model otherwise (Flower's baselines,
        in Flower's dtypes) checks it with its ``check_saved_arrays(named, state)``."""
        named = {name: np.asarray(value) for name, value in tree["arrays"]}
        state = tree["strategy"]
        try:
            if "params" in state:
                layout, key_order = saved_layout(state, "strategy")
                specs = {spec.name: spec for spec in layout.trainable + layout.buffers}
                _same_arrays(named, key_order, specs)
                flat = layout.flatten(named)
                if not np.array_equal(flat.view(np.uint32), np.asarray(state["params"]).view(np.uint32)):
                    raise fields.StateError("arrays", "differs from the strategy's model 'strategy/params'")
            elif callable(getattr(strategy, "check_saved_arrays", None)):
                strategy.check_saved_arrays(named, state)
        except fields.StateError as err:
            raise err.in_file(str(self.path)) from None
        return named


def _same_arrays(named: Mapping[str, np.ndarray], key_order: tuple[str, ...], specs: Mapping[str, Any]) -> None:
    if tuple(named) != key_order:
        raise fields.StateError("arrays", "names other arrays than the strategy's model ('strategy/key_order')")
    for name, array in named.items():
        spec = specs[name]
        if array.shape != spec.shape or array.dtype != spec.dtype:
            raise fields.StateError(
                fields.join("arrays", name),
                f"is {array.dtype} {array.shape}; expected {spec.dtype} {spec.shape} (the strategy's model)",
            )


def _scalar(value: Any, where: str) -> Any:
    """A run-config value: None, a bool, a number, or a str."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value
    return fields.text(value, where, most=_MAX_TEXT)


def _metric(value: Any, where: str) -> None:
    """A MetricRecord value: a finite number or a list of finite numbers."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            fields.finite_number(item, fields.join(where, i))
    else:
        fields.finite_number(value, where)


def _check_metrics(tree: Any, where: str, last_round: int) -> None:
    """Results per round (0 to ``last_round``), each a mapping of metric name -> number(s)."""
    for key, record in fields.mapping(tree, where).items():
        at = fields.join(where, key)
        if not (key.isascii() and key.isdigit()):
            raise fields.StateError(at, f"is keyed by a round that is not a whole number in [0, {last_round}]")
        fields.whole(int(key), at, high=last_round)
        for name, value in fields.mapping(record, at).items():
            _metric(value, fields.join(at, name))


def _check_app_state(app: Any, last_round: int) -> None:
    """The app's state: its result rows (mappings of plain values, rounds up to ``last_round``) and the
    elapsed seconds (finite, >= 0)."""
    app = fields.mapping(app, "app")
    if "elapsed" in app:
        fields.finite_number(app["elapsed"], "app/elapsed", low=0.0)
    for i, row in enumerate(fields.sequence(app.get("rows", []), "app/rows", most=_MAX_ROWS)):
        at = fields.join("app/rows", i)
        for key, value in fields.mapping(row, at).items():
            _row_value(value, fields.join(at, key), depth=0)
        if "round" in row:
            fields.whole(row["round"], fields.join(at, "round"), high=last_round)


_MAX_ROW_DEPTH = 4  # a row's value: a number or text, or mappings / lists of them (bytes by record, events)
_MAX_ROW_ITEMS = 100_000


def _row_value(value: Any, where: str, depth: int) -> None:
    """A result row's value: a plain value, or (a few levels deep) a mapping or list of plain values."""
    if isinstance(value, (list, dict)):
        if depth >= _MAX_ROW_DEPTH:
            raise fields.StateError(where, f"nests deeper than {_MAX_ROW_DEPTH} levels; expected plain values")
        items = (
            fields.mapping(value, where).items()
            if isinstance(value, dict)
            else enumerate(fields.sequence(value, where, most=_MAX_ROW_ITEMS))
        )
        for key, item in items:
            _row_value(item, fields.join(where, key), depth + 1)
        return
    if isinstance(value, float) and math.isinf(value):
        raise fields.StateError(where, f"is {value!r}; expected a finite number or NaN")
    _scalar(value, where)


def _metrics_to_tree(history: Mapping[int, MetricRecord]) -> dict[str, dict[str, Any]]:
    return {str(r): dict(record) for r, record in history.items()}


def _metrics_from_tree(tree: Mapping[str, Mapping[str, Any]]) -> dict[int, MetricRecord]:  # checked by _read
    return {int(r): MetricRecord(dict(values)) for r, values in tree.items()}
