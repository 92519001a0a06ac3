"""The files of FedAdaVR's memory-mapped table are covered like its checkpoint (issue 43).

A table on disk (run-config ``table-path``) is not copied into the checkpoint: resume re-attaches the
file. Before this, the file's rows were trusted as found (the journal beside it checked only the table's
id and round), so one flipped byte in a row loaded silently and changed the model. Now the checkpoint
records each row's CRC-32 and resume reads every row of the file against it: a changed byte is refused
with one line naming the file, the row, its client and the checksum expected, and nothing is loaded (the
strategy stays as it was, the files stay as they were). Bytes past the table's rows (capacity not yet
given to a client) are never read and are overwritten whole when a client takes the row.

The run is the altered-checkpoint corpus's FedAdaVR run (pollen's ClientApp in-process, two rounds of
the MLP), with its table in a file.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from pollen.app.config import AppConfig, defaults_from_pyproject
from pollen.app.registry import build_strategy
from pollen.core.state_fields import StateError
from pollen.strategies.engine.resume import RunCheckpoint
from pollen.testing import altered_files as corpus
from pollen.vr.row_codec import RowCodec


def _config_with_table(table: Path):  # noqa: ANN202
    def config_for(name: str, results: Path) -> AppConfig:
        run_config = {**defaults_from_pyproject(str(corpus.PYPROJECT)), **corpus.SMALL, "strategy": name}
        run_config.update({"results-dir": str(results), "run-name": name, "table-path": str(table)})
        return AppConfig.from_run_config(run_config, given={*corpus.SMALL, "strategy", "table-path"})

    return config_for


@pytest.fixture(scope="module")
def base(tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("table-file")
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(corpus, "config_for", _config_with_table(root / "fedadavr.table"))
            return corpus.make_base("fedadavr", root / "runs")
    finally:
        logger.setLevel(level)


def _row_bytes(base: corpus.Base) -> int:
    table = base.tree["strategy"]["store"]["table"]
    codec = RowCodec(int(table["dim"]), [int(s) for s in table["segments"]], str(table["precision"]))
    return codec.width * codec.dtype.itemsize


def _resume_fresh(base: corpus.Base):  # noqa: ANN202
    """A fresh strategy, the state it holds before loading, and the refusal (or None) of loading the run."""
    strategy = build_strategy(base.cfg)
    before = strategy.state_dict()
    checkpoint = RunCheckpoint(base.run_dir, resume=True, fingerprint=base.cfg.as_dict(), ignore=("run-name",))
    try:
        checkpoint.load(strategy)
    except StateError as err:
        return strategy, before, err
    return strategy, before, None


def test_the_checkpoint_records_a_checksum_per_row_of_the_file(base):
    store = base.tree["strategy"]["store"]
    assert "data" not in store["table"] and store["table"]["row_crc32"].shape == (len(store["table"]["keys"]),)
    table = Path(base.cfg["table-path"])
    assert table.is_file() and Path(f"{table}.journal.json").is_file()


def test_a_flipped_byte_in_any_row_of_the_table_file_is_refused_and_nothing_is_loaded(base):
    table = Path(base.cfg["table-path"])
    keys = [str(k) for k in base.tree["strategy"]["store"]["table"]["keys"]]
    width = _row_bytes(base)
    original = table.read_bytes()
    reference = corpus.state_of(corpus.resume(base, base.run_dir, trust_file=False))
    run_files = corpus.directory_listing(base.run_dir)
    try:
        for row, key in enumerate(keys):
            for offset in (0, width // 2 + row, width - 1):
                flipped = bytearray(original)
                flipped[row * width + offset] ^= 0x10
                table.write_bytes(bytes(flipped))
                strategy, before, refused = _resume_fresh(base)
                assert refused is not None, f"row {row} byte {offset}: loaded"
                expected = base.tree["strategy"]["store"]["table"]["row_crc32"]
                message = str(refused)
                assert "\n" not in message and str(table) in message, message
                assert f"row {row} (client {key!r})" in message and f"{int(expected[row]):#010x}" in message, message
                assert refused.field.endswith("store/table/row_crc32")
                assert corpus.same_state(list(corpus.leaves(strategy.state_dict())), list(corpus.leaves(before)))
                assert strategy.table is None
                assert table.read_bytes() == bytes(flipped), "a refused resume wrote to the table file"
                assert corpus.directory_listing(base.run_dir) == run_files
    finally:
        table.write_bytes(original)
    assert corpus.same_state(corpus.state_of(corpus.resume(base, base.run_dir, trust_file=False)), reference)


def test_bytes_past_the_rows_are_not_read(base):
    table = Path(base.cfg["table-path"])
    rows = len(base.tree["strategy"]["store"]["table"]["keys"])
    width = _row_bytes(base)
    original = table.read_bytes()
    assert len(original) > rows * width  # capacity not yet given to a client
    reference = corpus.state_of(corpus.resume(base, base.run_dir, trust_file=False))
    try:
        flipped = bytearray(original)
        flipped[rows * width] ^= 0xFF
        table.write_bytes(bytes(flipped))
        assert corpus.same_state(corpus.state_of(corpus.resume(base, base.run_dir, trust_file=False)), reference)
    finally:
        table.write_bytes(original)


def test_a_flipped_byte_in_the_journal_is_refused(base):
    journal = Path(f"{base.cfg['table-path']}.journal.json")
    original = journal.read_bytes()
    try:
        for at in sorted({0, 1, len(original) // 3, len(original) // 2, 2 * len(original) // 3, len(original) - 2}):
            flipped = bytearray(original)
            flipped[at] ^= 0x01
            journal.write_bytes(bytes(flipped))
            strategy, _, refused = _resume_fresh(base)
            assert refused is not None, f"journal byte {at}: loaded"
            assert "\n" not in str(refused) and "journal" in str(refused), str(refused)
            assert strategy.table is None
    finally:
        journal.write_bytes(original)


def test_a_row_checksum_removed_from_the_checkpoint_is_refused(base, tmp_path):
    tree = corpus._set(base.tree, ("strategy", "store", "table"), dict(base.tree["strategy"]["store"]["table"]))
    del tree["strategy"]["store"]["table"]["row_crc32"]
    run_dir = corpus.write_altered(base, tree, tmp_path / "no-crc")
    with pytest.raises(StateError, match="row_crc32' is missing"):
        corpus.resume(base, run_dir)
    changed = np.array(base.tree["strategy"]["store"]["table"]["row_crc32"], copy=True)
    changed[0] ^= 1
    run_dir = corpus.write_altered(
        base, corpus._set(base.tree, ("strategy", "store", "table", "row_crc32"), changed), tmp_path / "other-crc"
    )
    with pytest.raises(StateError, match=r"row 0 \(client .*\) has CRC-32 0x[0-9a-f]{8}; expected"):
        corpus.resume(base, run_dir)  # trusted: the checkpoint's own digest would refuse it first
