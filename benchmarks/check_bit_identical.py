"""Are the presets' results bit-identical between two checkouts? (issue 23)

Every preset and every ``[methods]`` row of it (the preset's own strategy where it has no rows) runs a short
version in-process (pollen's real ServerApp and ClientApps on the fake grid of ``run_inprocess``, one torch
thread, the preset's seed) and leaves a *fingerprint*: per run, every round's metrics row with exact floats,
the SHA-256 of the final global model (every parameter and buffer of ``final_model.npz``: name, dtype, shape,
bytes) and the SHA-256 of the arrays of the last checkpoint (the server's optimiser moments, VR tables, lazy copies).
Two fingerprints are then compared run by run.

Each checkout runs in a subprocess of its own with ``PYTHONPATH=<checkout>``, so ``import pollen`` is that
checkout's code; the child entry (:func:`child_main`) loads today's layout only (``pollen.testing.inprocess``
and ``pollen.app.preset``, since commit db84f5c; an older checkout is refused) and checks that ``pollen``
really came from the checkout. (The baseline fingerprint of f6969c5 was made before this; compare against
it with ``--compare``.) The runs of a checkout
share its process (the data are read once) and always come in the same order: presets sorted by name, methods
in the preset's order.

Usage::

    # fingerprint one checkout (default: the repository this script is in)
    python benchmarks/check_bit_identical.py --checkout /path/to/checkout --out new.json
    # compare two fingerprints: a table, exit status 1 on any difference
    python benchmarks/check_bit_identical.py --compare old.json new.json
    # fingerprint this checkout and compare it with the saved baseline, in one command
    python benchmarks/check_bit_identical.py --against benchmarks/reports/bit-identical-baseline-f6969c5.json
    # fingerprint an old commit (a temporary worktree of --old-ref, or an existing tree --old) and this checkout
    python benchmarks/check_bit_identical.py --baseline --old-ref 45f6ab5 [--save-old old.json --out new.json]

What a run is cut to (the same for both checkouts; the values are in the fingerprint, under ``overrides`` and
``data``): ``SMOKE`` for every preset: 3 rounds of 2 local steps on at most ``MAX_NODES`` SuperNodes (8 for
Fashion-MNIST, 4 for CIFAR-10; HA-Fed: two clusters of 8), half of them per round, so that every run brings
clients back and their state (error-feedback residuals, lazy references, local optimiser moments, VR table
rows) is used; the test set is read after rounds 0 and 3. The Fashion-MNIST presets read the real data cut to
its first 6,000 training and 1,000 test images. CIFAR-10 is not on a CPU machine, so its presets read a
synthetic CIFAR-10 (seeded random images in the CIFAR binary format, 5 x 24 training and 100 test images) and
take, on top, ``CIFAR_EXTRA`` (one local step of batch 4), so that ResNet-18 and ConvMixer fit the time.

The fingerprint's hashes and floats are those of this machine's CPU kernels and library versions (recorded
under ``versions``): compare fingerprints made on the same machine; ``--baseline`` makes both in one go.

The metric rows' wall-clock columns (``*_seconds``) and the process's memory (``*_rss_bytes``) are left out;
everything else in a row is compared as JSON text, whose floats are ``repr`` (exact: ``float(repr(x)) == x``
bit for bit, ``-0.0`` and ``nan`` kept).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FORMAT = "pollen-bit-identical/1"
HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: Every preset's run is cut to this (the keys a method row sets are overridden too: these values win).
SMOKE: dict[str, Any] = {
    "num-server-rounds": 3,
    "local-steps": 2,
    "eval-every": 3,  # the test set is read after rounds 0 and 3
    "eval-batch-size": 2000,
    "fraction-train": 0.5,  # half of the SuperNodes per round: 3 rounds always bring a client back
    "min-train-nodes": 2,
    "device": "cpu",  # never "auto": a GPU machine would train on its GPU
}
#: SuperNodes of a run, per dataset: the preset's, at most this many; a clustered preset (HA-Fed) gets two clusters.
MAX_NODES = {"fashion-mnist": 8, "cifar10": 4}
#: And the CIFAR-10 presets (ResNet-18, ConvMixer) also take this, to fit the time on one CPU thread.
CIFAR_EXTRA: dict[str, Any] = {"batch-size": 4, "local-steps": 1}
#: The data every run reads (its ``data-dir``, written by the child: ``write_fashion_mnist_cut`` and
#: ``write_synthetic_cifar10``).
DATA: dict[str, Any] = {
    "fashion-mnist": {
        "source": "/usr/share/datasets/fashion-mnist",
        "train": 6000,
        "test": 1000,
    },
    "cifar10": {"synthetic": True, "train_per_batch": 24, "test": 100, "seed": 20231},
}
#: Row columns that measure wall-clock time: never compared, never written.
TIME_COLUMNS_SUFFIX = "seconds"
#: The process's memory columns: what the process holds (its libraries, its earlier runs), not what a run computed.
MEMORY_COLUMNS_SUFFIX = "rss_bytes"


# ----------------------------------------------------------------------------------------------- fingerprints
def array_digest(name: str, array: Any) -> bytes:
    """SHA-256 over one array's name, dtype, shape and bytes (C order)."""
    import numpy as np

    array = np.ascontiguousarray(array)
    h = hashlib.sha256()
    h.update(json.dumps([name, array.dtype.str, list(array.shape)]).encode())
    h.update(array.tobytes())
    return h.digest()


def model_sha256(path: Path) -> tuple[str, int]:
    """Hash of ``final_model.npz``: every tensor (parameters and buffers) in its file order, name included.

    The file's own bytes are not hashed: ``np.savez`` stamps the zip members with the time of writing.
    """
    import numpy as np

    h = hashlib.sha256()
    with np.load(path, allow_pickle=False) as npz:
        for name in npz.files:
            h.update(array_digest(name, npz[name]))
        return h.hexdigest(), len(npz.files)


def state_sha256(path: Path) -> str | None:
    """Hash of the arrays of the run's last checkpoint (the server's array state), ``None`` if there is none.

    Arrays only: the JSON part holds the run-config (results-dir differs) and the elapsed time. Each array is
    hashed with its dtype and shape; the digests are sorted, so a renumbering of the members does not count.
    """
    import numpy as np

    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as npz:
        digests = sorted(array_digest("", npz[name]) for name in npz.files if name != "__meta__")
    return hashlib.sha256(b"".join(digests)).hexdigest()


def clean_row(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without its wall-clock and process-memory columns and without the columns a round did not
    report ("")."""
    return {
        k: v
        for k, v in row.items()
        if not k.endswith(TIME_COLUMNS_SUFFIX) and not k.endswith(MEMORY_COLUMNS_SUFFIX) and v != ""
    }


def write_fashion_mnist_cut(root: Path, source: Path) -> str:
    """The real Fashion-MNIST cut to its first ``DATA["fashion-mnist"]`` train and test images; their SHA-256.

    Fewer images keep a run short where its cost follows the data: the centralised evaluation and the
    full-batch gradient of Mime / Mime-LAMB. The images and their order are the real ones.
    """
    import gzip

    spec = DATA["fashion-mnist"]
    root.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    for split, prefix in (("train", "train"), ("test", "t10k")):
        for stem in (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"):
            data = gzip.decompress((source / f"{stem}.gz").read_bytes())
            ndim = data[3]
            header = 4 + 4 * ndim
            dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
            count = min(spec[split], dims[0])
            item = 1
            for d in dims[1:]:
                item *= d
            cut = data[:4] + count.to_bytes(4, "big") + data[8:header] + data[header : header + count * item]
            (root / stem).write_bytes(cut)
            h.update(cut)
    return h.hexdigest()


def write_synthetic_cifar10(root: Path) -> str:
    """Seeded random CIFAR-10 in the binary format (``data_batch_1..5.bin``, ``test_batch.bin``); its SHA-256."""
    import numpy as np

    spec = DATA["cifar10"]
    rng = np.random.default_rng(spec["seed"])
    root.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    names = [(f"data_batch_{i}.bin", spec["train_per_batch"]) for i in range(1, 6)]
    for name, count in [*names, ("test_batch.bin", spec["test"])]:
        labels = rng.integers(0, 10, size=(count, 1), dtype=np.uint8)
        pixels = rng.integers(0, 256, size=(count, 3072), dtype=np.uint8)
        data = np.concatenate([labels, pixels], axis=1).tobytes()
        (root / name).write_bytes(data)
        h.update(data)
    return h.hexdigest()


def num_nodes(preset: Any) -> int:
    """SuperNodes of a run: the preset's, at most ``MAX_NODES``; two clusters' worth for a clustered preset."""
    cluster = int(preset.config.get("cluster-size", 0) or 0)
    return min(preset.supernodes, 2 * cluster if cluster else MAX_NODES[preset.needs])


def plan(preset: Any) -> list[tuple[str, dict[str, Any]]]:
    """``(method label, method's run-config)`` for each run of a preset: its rows, or its own strategy."""
    if preset.methods:
        return [(label, dict(values)) for label, values in preset.methods.items()]
    return [(str(preset.config.get("strategy", "")), {})]


# ------------------------------------------------------------------------------------------------ child entry
def child_main(checkout: Path, out: Path, only: list[str]) -> int:
    """Run in a subprocess with ``PYTHONPATH=<checkout>``: fingerprint every preset x method; write ``out``."""
    # Nothing of the checkout this script lives in may be importable here (its benchmarks/ folder is
    # sys.path[0] when the script is run by path): only PYTHONPATH=<checkout> provides code.
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != HERE]

    # today's layout (since db84f5c): the in-process runner and the presets; an older checkout is refused
    if not (checkout / "pollen" / "testing" / "inprocess.py").is_file():
        print(
            f"{checkout}: no pollen/testing/inprocess.py (a checkout before db84f5c); allowed: db84f5c or later",
            file=sys.stderr,
        )
        return 2
    layout = "pollen.testing.inprocess + pollen.app.preset"
    import numpy as np
    import torch

    import pollen
    from pollen.app.preset import load_preset, preset_names
    from pollen.testing.inprocess import run_inprocess

    where = Path(pollen.__file__).resolve()
    if checkout.resolve() not in where.parents:
        print(
            f"pollen was imported from {where}, not from {checkout}: check PYTHONPATH",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)

    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    # results and checkpoints on a RAM disk where there is one: a ResNet-18 checkpoint is written (and fsync-ed)
    # every round
    ram = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="bitcheck-", dir=ram) as scratch:
        data_dirs = {
            "fashion-mnist": Path(scratch) / "fashion-mnist-cut",
            "cifar10": Path(scratch) / "synthetic-cifar10",
        }
        data_sha = {
            "fashion-mnist": write_fashion_mnist_cut(data_dirs["fashion-mnist"], Path(DATA["fashion-mnist"]["source"])),
            "cifar10": write_synthetic_cifar10(data_dirs["cifar10"]),
        }
        results = Path(scratch) / "results"
        for name in preset_names():
            preset = load_preset(name)
            for method, values in plan(preset):
                if not selected({"preset": name, "method": method}, only):
                    continue
                overrides = {"preset": name, **values, **SMOKE}
                if preset.needs not in data_dirs:
                    raise SystemExit(f"preset {name} needs {preset.needs}: this script has no data for it (DATA)")
                if preset.needs == "cifar10":
                    overrides.update(CIFAR_EXTRA)
                overrides["data-dir"] = str(data_dirs[preset.needs])
                run_name = f"{name}--{method}"
                overrides.update({"results-dir": str(results), "run-name": run_name})
                nodes = num_nodes(preset)
                record: dict[str, Any] = {
                    "preset": name,
                    "method": method,
                    "num_nodes": nodes,
                }
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    rows = run_inprocess(overrides, nodes, threads=1)
                # a failing run is recorded, not fatal; the comparison counts it as not identical
                except Exception as err:  # noqa: BLE001
                    record["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                    rows = []
                record["seconds"] = round(time.perf_counter() - t0, 2)
                record["cpu_seconds"] = round(time.process_time() - c0, 2)
                record["rows"] = [clean_row(row) for row in rows]
                run_dir = results / run_name
                model = run_dir / "final_model.npz"
                record["model_sha256"], record["model_tensors"] = model_sha256(model) if model.is_file() else (None, 0)
                record["state_sha256"] = state_sha256(run_dir / "checkpoint.npz")
                runs.append(record)
                error = "  ERROR " + record["error"] if "error" in record else ""
                print(
                    f"[bitcheck] {name} / {method}: {len(rows)} rows, model {str(record['model_sha256'])[:12]}, "
                    f"{record['seconds']:.1f} s ({record['cpu_seconds']:.1f} s CPU){error}",
                    file=sys.stderr,
                    flush=True,
                )
    fingerprint = {
        "format": FORMAT,
        "checkout": describe_checkout(checkout) | {"layout": layout},
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "numpy": np.__version__,
            "flwr": _version("flwr"),
            "cpu": _cpu_name(),
        },
        "overrides": {"all": SMOKE, "cifar10": CIFAR_EXTRA, "max_nodes": MAX_NODES},
        "data": {name: DATA[name] | {"sha256": data_sha[name]} for name in DATA},
        "left_out_columns": f"*{TIME_COLUMNS_SUFFIX} (wall-clock); *{MEMORY_COLUMNS_SUFFIX} (the process's memory); "
        "columns a round did not report ('')",
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time(), 1),
        "runs": runs,
    }
    write_fingerprint(fingerprint, out)
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def _cpu_name() -> str:
    """The CPU model (float kernels, and so the last bits, may differ between CPUs)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{platform.machine()} {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}".strip()


def describe_checkout(checkout: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(checkout), *args],
            check=False,
            capture_output=True,
            text=True,
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def write_fingerprint(fingerprint: dict[str, Any], out: Path) -> None:
    """JSON with one run per block and one row per line (small, and diffs well)."""
    head = {k: v for k, v in fingerprint.items() if k != "runs"}
    lines = [json.dumps(head, sort_keys=True)[:-1] + ', "runs": [']
    for i, run in enumerate(fingerprint["runs"]):
        meta = {k: v for k, v in run.items() if k != "rows"}
        rows = ",\n    ".join(json.dumps(row, sort_keys=True) for row in run["rows"])
        comma = "," if i < len(fingerprint["runs"]) - 1 else ""
        lines.append(f'  {json.dumps(meta, sort_keys=True)[:-1]}, "rows": [\n    {rows}]}}{comma}')
    lines.append("]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    json.loads(out.read_text())  # it must read back


# ------------------------------------------------------------------------------------------------ parent side
def fingerprint_checkout(checkout: Path, out: Path, only: list[str], python: str) -> float:
    """Fingerprint ``checkout`` in a subprocess of its own; the seconds it took."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(checkout.resolve()),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",  # no hub probes: the data are the machine's or the synthetic ones
        MPLBACKEND="Agg",
    )
    command = [
        python,
        str(Path(__file__).resolve()),
        "--child",
        "--checkout",
        str(checkout.resolve()),
        "--out",
        str(out.resolve()),
    ]
    for item in only:
        command += ["--only", item]
    print(f"fingerprinting {checkout} -> {out}", flush=True)
    t0 = time.perf_counter()
    tail: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bitcheck-cwd-") as cwd:
        # the child's log (Flower's and pollen's) is read here: its "[bitcheck]" lines are shown, the rest kept
        # only as the tail printed on failure
        child = subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("[bitcheck]"):
                print("  " + line.rstrip(), flush=True)
            tail = [*tail[-40:], line.rstrip()]
        returncode = child.wait()
    seconds = time.perf_counter() - t0
    if returncode != 0:
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"fingerprinting {checkout} failed (exit status {returncode})")
    print(f"  {seconds:.0f} s", flush=True)
    return seconds


#: Result columns that were renamed, not changed: the method counters HA-Fed and the lazy family wrote into
#: fixed columns became ``method.<name>`` columns (``RoundStats.method``, issue 23), which a run only has once
#: its method wrote them. A counter column with nothing in it (0, empty) equals an absent one.
RENAMED = {name: f"method.{name}" for name in ("relayed_bytes", "peer_bytes", "lazy_events", "lazy_rel")}


def _renamed(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the old counter columns under their new names; empty ones dropped."""
    out = {}
    for key, value in row.items():
        key = RENAMED.get(key, key)
        if key.startswith("method.") and value in (0, {}, [], None, ""):
            continue  # a counter with nothing in it: written as 0 by one version, not at all by the other
        out[key] = value
    return out


def first_difference(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> str:
    """``""`` when the rows are equal bit for bit (counters under their new names), else where they first differ."""
    for i in range(max(len(old), len(new))):
        if i >= len(old) or i >= len(new):
            return f"row {i}: only in {'new' if i >= len(old) else 'old'}"
        a, b = _renamed(old[i]), _renamed(new[i])
        for key in sorted(set(a) | set(b)):
            ja, jb = (
                json.dumps(a.get(key, "<absent>"), sort_keys=True),
                json.dumps(b.get(key, "<absent>"), sort_keys=True),
            )
            if ja != jb:
                return f"round {a.get('round', i)} {key}: {ja[:40]} -> {jb[:40]}"
    return ""


def selected(run: dict[str, Any], only: list[str]) -> bool:
    return not only or run["preset"] in only or f"{run['preset']}:{run['method']}" in only


def compare(old_path: Path, new_path: Path, only: list[str] = ()) -> int:
    """Print the table; 0 when every run is identical (metrics, model and state), 1 otherwise.

    With ``only`` (``PRESET`` or ``PRESET:METHOD``) just those runs are compared.
    """
    old, new = (json.loads(Path(p).read_text()) for p in (old_path, new_path))
    for side, data in (("old", old), ("new", new)):
        if data.get("format") != FORMAT:
            raise SystemExit(f"{side} file is not a {FORMAT} fingerprint")
        data["runs"] = [run for run in data["runs"] if selected(run, list(only))]
    if (old["overrides"], old["data"]) != (new["overrides"], new["data"]):
        print("the two fingerprints were made with different overrides or data; the runs are not comparable")
        return 1
    print(
        f"old: {old_path}  commit {old['checkout']['commit'][:10]}{' (dirty)' if old['checkout']['dirty'] else ''}  "
        f"{old['checkout']['layout']}  {old['seconds']} s"
    )
    print(
        f"new: {new_path}  commit {new['checkout']['commit'][:10]}{' (dirty)' if new['checkout']['dirty'] else ''}  "
        f"{new['checkout']['layout']}  {new['seconds']} s"
    )
    if old.get("versions") != new.get("versions"):
        print(
            f"note: other software or CPU (old {old.get('versions')}, new {new.get('versions')}): "
            "a difference in the last bits need not be the code's; fingerprint both sides here (--baseline)"
        )

    def key(run: dict[str, Any]) -> tuple[str, str]:
        return (run["preset"], run["method"])

    old_runs, new_runs = (
        {key(r): r for r in old["runs"]},
        {key(r): r for r in new["runs"]},
    )
    order = list(old_runs) + [k for k in new_runs if k not in old_runs]
    header = (
        "preset",
        "method",
        "rounds",
        "identical",
        "first difference",
        "model equal",
        "state equal",
    )
    table = []
    differ = errors = 0
    for k in order:
        a, b = old_runs.get(k), new_runs.get(k)
        if a is None:  # a preset row added since the baseline: nothing to compare it with
            table.append((*k, "-", "new", "run only in new (no baseline)", "-", "-"))
            continue
        if b is None:  # a run the baseline had is gone: that is a difference
            table.append((*k, "-", "NO", "run only in old", "-", "-"))
            differ += 1
            continue
        diff = first_difference([clean_row(r) for r in a["rows"]], [clean_row(r) for r in b["rows"]])
        if not diff and a.get("error") != b.get("error"):
            diff = f"error: {a.get('error')} -> {b.get('error')}"
        model_eq = a["model_sha256"] == b["model_sha256"] and a["model_sha256"] is not None
        state_eq = a["state_sha256"] == b["state_sha256"]
        same = not diff and model_eq and state_eq
        if a.get("error") and a.get("error") == b.get("error"):
            errors += 1
            diff = f"same error on both: {a['error'][:60]}"
        differ += not same
        last = [str(r["rows"][-1].get("round", "?")) if r["rows"] else "-" for r in (a, b)]
        rounds = last[0] if last[0] == last[1] else "/".join(last)
        table.append(
            (
                *k,
                rounds,
                "yes" if same else "NO",
                diff or "-",
                "yes" if model_eq else "NO",
                "yes" if state_eq else "NO",
            )
        )
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *table]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
    new_only = sum(1 for row in table if row[3] == "new")
    print(
        f"{len(table)} runs: {len(table) - differ - new_only} identical, {differ} different"
        + (f", {new_only} new (no baseline)" if new_only else "")
        + (f", {errors} that failed the same way on both (not covered)" if errors else "")
    )
    return 1 if differ else 0


def make_worktree(ref: str, scratch: Path) -> Path:
    path = scratch / f"old-{ref}"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref],
        check=True,
        capture_output=True,
    )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkout",
        type=Path,
        default=REPO,
        help="the tree to fingerprint (default: this repository)",
    )
    parser.add_argument("--out", type=Path, help="where the fingerprint JSON goes")
    parser.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("OLD.json", "NEW.json"),
        help="compare two fingerprints",
    )
    parser.add_argument(
        "--against",
        type=Path,
        metavar="BASELINE.json",
        help="fingerprint --checkout and compare with this",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="fingerprint --old / --old-ref and --checkout, and compare",
    )
    parser.add_argument("--old", type=Path, help="(--baseline) an existing tree of the old commit")
    parser.add_argument(
        "--old-ref",
        default="45f6ab5",
        help="(--baseline) else a temporary worktree of this ref (default 45f6ab5, before issue 37)",
    )
    parser.add_argument("--save-old", type=Path, help="(--baseline) keep the old fingerprint here")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PRESET[:METHOD]",
        help="fingerprint only these (repeatable)",
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter of the child processes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        return child_main(args.checkout.resolve(), args.out, args.only)
    if args.compare:
        return compare(*args.compare, args.only)
    with tempfile.TemporaryDirectory(prefix="bitcheck-") as scratch_name:
        scratch = Path(scratch_name)
        new_out = args.out or scratch / "new.json"
        if args.against:
            fingerprint_checkout(args.checkout, new_out, args.only, args.python)
            return compare(args.against, new_out, args.only)
        if args.baseline:
            old_tree = args.old or make_worktree(args.old_ref, scratch)
            try:
                old_out = args.save_old or scratch / "old.json"
                fingerprint_checkout(old_tree, old_out, args.only, args.python)
                fingerprint_checkout(args.checkout, new_out, args.only, args.python)
                return compare(old_out, new_out, args.only)
            finally:
                if args.old is None:
                    subprocess.run(
                        [
                            "git",
                            "-C",
                            str(REPO),
                            "worktree",
                            "remove",
                            "--force",
                            str(old_tree),
                        ],
                        check=False,
                        capture_output=True,
                    )
        if args.out is None:
            parser.error("give --out (fingerprint), --compare, --against or --baseline")
        fingerprint_checkout(args.checkout, args.out, args.only, args.python)
        return 0


if __name__ == "__main__":
    sys.exit(main())
