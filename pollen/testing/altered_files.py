"""A corpus of altered checkpoints: real checkpoints of every registered strategy, each field changed.

:func:`make_base` runs a registered strategy for two rounds of a tiny model in-process (pollen's real
ClientApp on the fake grid) and keeps its run directory. :func:`alterations` lists, for every field of
that checkpoint, the altered trees: the field removed, renamed, of the wrong dtype or shape, declaring a
huge shape (10**12 elements), NaN or Inf, out of range, swapped with the same field of another strategy.
:func:`resume_outcome` resumes a strategy from an altered file the way the app does (validate, read the
app's state, load) and says what happened:

- ``refused``: a ``ValueError`` of one line (a clear refusal; ``names_field`` says whether it names the
  field that was altered);
- ``loaded-same``: the file loaded and the strategy's state equals the one loaded from the untouched
  file (the alteration did not change the meaning, e.g. a list spelled as a tuple);
- ``loaded-other``: loaded with a different but valid state (every array finite, the run steps again);
- ``escaped``: anything else (another exception, a multi-line message, a non-finite state).

Used by ``tests/flower/test_altered_checkpoints.py`` (a sample) and ``benchmarks/fuzz_checkpoints.py``
(everything).
"""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, RecordDict

from pollen.app.config import RESUME_MAY_DIFFER, AppConfig, defaults_from_pyproject
from pollen.app.registry import build_strategy
from pollen.core.checkpoint import load_checkpoint, save_checkpoint
from pollen.strategies.engine.resume import CHECKPOINT_FILE, RunCheckpoint
from pollen.testing.fakes import FakeGrid

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
NODES = 4
#: A tiny run: the MLP on a sliver of Fashion-MNIST (100 partitions of which 4 nodes use theirs).
SMALL = {
    "model": "mlp",
    "batch-size": 16,
    "partitioner": "iid",
    "local-steps": 2,
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "eval-every": 100,
    "num-server-rounds": 3,
    "min-train-nodes": 2,
}
KINDS = ("removed", "renamed", "dtype", "shape", "huge-shape", "nan", "inf", "range", "swapped")
HUGE = 10**12


@dataclass
class Base:
    """One strategy's real checkpoint after two rounds."""

    name: str
    cfg: AppConfig
    run_dir: Path
    tree: dict[str, Any]


def config_for(name: str, results: Path) -> AppConfig:
    """The validated run-config of the tiny run of strategy ``name`` (clusters of 2 where it needs them)."""
    run_config = {**defaults_from_pyproject(str(PYPROJECT)), **SMALL, "strategy": name}
    run_config.update({"results-dir": str(results), "run-name": name})
    given = {*SMALL, "strategy"}
    if name == "hafed" or "stratified" in name:
        run_config["cluster-size"] = 2
        given.add("cluster-size")
    return AppConfig.from_run_config(run_config, given=given)


def make_base(name: str, root: Path) -> Base:
    """Run strategy ``name`` for two rounds and return its checkpoint (the run directory is ``root/name``)."""
    import pollen.client_app as client_module
    from pollen.app.experiment import build_model

    cfg = config_for(name, root)
    run_config = cfg.as_dict()
    contexts = {
        node: Context(
            run_id=1,
            node_id=node,
            node_config={"partition-id": node - 1, "num-partitions": 100},
            state=RecordDict(),
            run_config=run_config,
        )
        for node in range(1, NODES + 1)
    }
    grid = FakeGrid(
        list(contexts),
        lambda msg: client_module.app(msg, contexts[msg.metadata.dst_node_id]),
        client_ids={node: f"partition-{node - 1}" for node in contexts},
        cluster_ids={node: str((node - 1) // 2) for node in contexts},
    )
    run_dir = root / name
    checkpoint = RunCheckpoint(run_dir, fingerprint=run_config, app_state=lambda: {"rows": [], "elapsed": 1.0})
    strategy = build_strategy(cfg)
    strategy.start(
        grid=grid, initial_arrays=ArrayRecord(build_model(cfg).state_dict()), num_rounds=2, checkpoint=checkpoint
    )
    return Base(name, cfg, run_dir, load_checkpoint(run_dir / CHECKPOINT_FILE))


# ----------------------------------------------------------------------------------------- fields
def leaves(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """``(path, value)`` of every leaf (arrays, numbers, strings, None, empty containers) of a tree."""
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            yield from leaves(value, (*path, key))
    elif isinstance(tree, list) and tree:
        for i, value in enumerate(tree):
            yield from leaves(value, (*path, i))
    else:
        yield path, tree


def sampled_leaves(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """:func:`leaves`, but of a long list only its first two and last items (a generator's 625 words,
    a history's norms: every item is checked by the same code, so three stand for all)."""
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            yield from sampled_leaves(value, (*path, key))
    elif isinstance(tree, list) and tree:
        picks = range(len(tree)) if len(tree) <= 4 else (0, 1, len(tree) - 1)
        for i in picks:
            yield from sampled_leaves(tree[i], (*path, i))
    else:
        yield path, tree


def get(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def field_name(path: tuple) -> str:
    """The name an error should show: the last str key of the path (the array's name in a pair list)."""
    keys = [key for key in path if isinstance(key, str)]
    return keys[-1] if keys else "round"


def _copy_along(tree: Any, path: tuple) -> tuple[Any, Any]:
    """``(copy of tree, the copy's container at path)``: only the containers on ``path`` are copied.

    An altered tree shares every other branch (arrays included) with ``tree``; nothing here or in
    :func:`write_altered` changes a value in place, so the original stays as it was, and a copy of the
    whole checkpoint per alteration (most of the corpus's time) is not needed.
    """
    out = copy.copy(tree)
    node = out
    for key in path:
        child = copy.copy(node[key])
        node[key] = child
        node = child
    return out, node


def _set(tree: Any, path: tuple, value: Any) -> Any:
    out, parent = _copy_along(tree, path[:-1])
    parent[path[-1]] = value
    return out


def _remove(tree: Any, path: tuple) -> Any:
    out, parent = _copy_along(tree, path[:-1])
    del parent[path[-1]]
    return out


def _rename(tree: Any, path: tuple) -> Any | None:
    out, parent = _copy_along(tree, path[:-1])
    key = path[-1]
    if isinstance(parent, dict):
        items = [(k + "_renamed" if k == key else k, v) for k, v in parent.items()]
        parent.clear()
        parent.update(items)
        return out
    if isinstance(parent, list) and len(parent) == 2 and isinstance(parent[0], str) and key == 1:  # a [name, x] pair
        parent[0] = parent[0] + "_renamed"
        return out
    return None


def _wrong_dtype(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            return value.astype(np.float64 if value.dtype != np.float64 else np.float32)
        if value.dtype.kind in "iub":
            return value.astype(np.float32)
        return np.zeros(value.shape, dtype=np.int64)
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return 7
    if value is None:
        return 1.5
    return "x"


def _wrong_shape(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return np.concatenate([value.reshape(-1), value.reshape(-1)[:1] if value.size else np.zeros(1, value.dtype)])
    if isinstance(value, (list, dict)):
        return [value, value]
    return [value]


def _huge(value: Any) -> Any:
    """A declared size of 10**12: for a number, 10**12 itself (a shape, a dim, a count); an array keeps
    its bytes (a huge header is :func:`huge_header`'s job)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return HUGE
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        return np.full(value.shape, HUGE, dtype=np.int64)
    return None


def _non_finite(value: Any, number: float) -> Any:
    if isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.size:
        out = value.copy()
        out.reshape(-1)[min(3, value.size - 1)] = number
        return out
    if isinstance(value, float):
        return number
    return None


def _out_of_range(path: tuple, value: Any) -> Any:
    name = field_name(path)
    if isinstance(value, np.ndarray) and value.size and value.dtype.kind in "fiu":
        out = value.astype(np.int64 if value.dtype.kind == "u" else value.dtype)
        flat = out.reshape(-1)
        if value.dtype.kind == "f":
            flat[min(3, value.size - 1)] = -1.0 if name in ("v", "v_hat", "z", "v_t", "weights", "absmax") else 1e30
        else:
            flat[0] = -1
        return out
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return -1 if value >= 0 else 2**70
    if isinstance(value, float):
        return -1.0 if value >= 0 else 1e300
    return None


def alterations(base: Base, donors: list[Base]) -> Iterator[tuple[str, tuple, Any]]:
    """``(kind, path, altered tree)`` for every leaf of ``base`` and every kind that applies to it."""
    for path, value in sampled_leaves(base.tree):
        if not path:
            continue
        yield "removed", path, _remove(base.tree, path)
        renamed = _rename(base.tree, path)
        if renamed is not None:
            yield "renamed", path, renamed
        yield "dtype", path, _set(base.tree, path, _wrong_dtype(value))
        yield "shape", path, _set(base.tree, path, _wrong_shape(value))
        huge = _huge(value)
        if huge is not None:
            yield "huge-shape", path, _set(base.tree, path, huge)
        for kind, number in (("nan", math.nan), ("inf", math.inf)):
            changed = _non_finite(value, number)
            if changed is not None:
                yield kind, path, _set(base.tree, path, changed)
        ranged = _out_of_range(path, value)
        if ranged is not None:
            yield "range", path, _set(base.tree, path, ranged)
        for donor in donors:
            try:
                other = get(donor.tree, path)
            except (KeyError, IndexError, TypeError):
                continue
            if not _same(other, value):
                yield "swapped", path, _set(base.tree, path, copy.deepcopy(other))
                break


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError):
        return False


def huge_header(path: Path) -> str:
    """Rewrite the first array member's ``.npy`` header of ``path`` to declare 10**12 float32 values
    (the bytes stay); return the member's name."""
    import zipfile

    with zipfile.ZipFile(path) as zf:
        members = {info.filename: zf.read(info) for info in zf.infolist()}
    name = next(n for n in members if n != "__meta__.npy")
    data = members[name]
    header_len = int.from_bytes(data[8:10], "little")
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000,), }"
    header = header + " " * (header_len - len(header) - 1) + "\n"
    members[name] = data[:10] + header.encode("latin1") + data[10 + header_len :]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for member, payload in members.items():
            zf.writestr(member, payload)
    return name[: -len(".npy")]


# ----------------------------------------------------------------------------------------- outcome
@dataclass
class Outcome:
    kind: str  # refused | loaded-same | loaded-other | escaped
    message: str = ""
    names_field: bool = False


def write_altered(base: Base, tree: dict[str, Any], where: Path) -> Path:
    """A copy of ``base``'s run directory holding ``tree`` as its checkpoint."""
    if where.exists():
        shutil.rmtree(where)
    shutil.copytree(base.run_dir, where)
    save_checkpoint(where / CHECKPOINT_FILE, tree)
    return where


def resume(base: Base, run_dir: Path, *, trust_file: bool = True) -> tuple[Any, RunCheckpoint]:
    """A fresh strategy of ``base``'s run and the checkpoint of ``run_dir``, loaded as the app does."""
    cfg = base.cfg
    strategy = build_strategy(cfg)
    checkpoint = RunCheckpoint(
        run_dir,
        resume=True,
        fingerprint=cfg.as_dict(),
        ignore=(*RESUME_MAY_DIFFER, "run-name"),
        trust_file=trust_file,
    )
    checkpoint.validate(type(strategy).__name__)
    checkpoint.read_app_state(type(strategy).__name__)
    saved = checkpoint.load(strategy)
    return strategy, saved


def state_of(loaded: tuple[Any, Any]) -> list[tuple[tuple, Any]]:
    """Everything a resume restores: the strategy's state, the round, the model, the results, the app's."""
    strategy, saved = loaded
    result = {
        name: {str(r): dict(record) for r, record in getattr(saved.result, name).items()}
        for name in ("train_metrics_clientapp", "evaluate_metrics_clientapp", "evaluate_metrics_serverapp")
    }
    arrays = {name: array.numpy() for name, array in saved.arrays.items()}
    whole = {"strategy": strategy.state_dict(), "round": saved.server_round, "arrays": arrays, "result": result}
    return list(leaves({**whole, "app": saved.app_state}))


def same_state(a: list[tuple[tuple, Any]], b: list[tuple[tuple, Any]]) -> bool:
    return len(a) == len(b) and all(pa == pb and _same_loose(va, vb) for (pa, va), (pb, vb) in zip(a, b))


def _same_loose(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _same(np.asarray(a), np.asarray(b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return _same(a, b)


def all_finite(state: list[tuple[tuple, Any]]) -> bool:
    for _, value in state:
        if isinstance(value, np.ndarray) and value.dtype.kind == "f" and not np.isfinite(value).all():
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
    return True


def resume_outcome(base: Base, run_dir: Path, reference: list[tuple[tuple, Any]], name: str) -> Outcome:
    """What resuming ``base``'s strategy from ``run_dir`` does (see the module docstring)."""
    try:
        loaded = resume(base, run_dir)
    except ValueError as err:
        message = str(err)
        if "\n" in message or not message:
            return Outcome("escaped", f"{type(err).__name__} of {message.count(chr(10)) + 1} lines: {message[:200]}")
        return Outcome("refused", message, f"'{name}" in message or f"/{name}" in message or f" {name}" in message)
    except Exception as err:  # noqa: BLE001 - what the corpus measures
        return Outcome("escaped", f"{type(err).__name__}: {err}"[:300])
    state = state_of(loaded)
    if same_state(state, reference):
        return Outcome("loaded-same")
    if not all_finite(state):
        return Outcome("escaped", "loaded a non-finite state")
    return Outcome("loaded-other")


def directory_listing(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (to check a refused resume changed nothing)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
