"""Fuzz figures: the whole hostile-reply matrix and a seeded random fuzz, per method family.

The matrix is every case of :func:`pollen.testing.hostile_cases.cases_for` for every registered method
(the test ``tests/flower/test_guarantee_matrix.py`` runs a deterministic sample of it). The fuzz takes the
attacker's honest reply in the attacked round and mutates it at random, seeded: bit flips anywhere in an
array's bytes (its ``.npy`` header included), records deleted, renamed (also onto another record's name)
or swapped for another kind, metric values, junk records, codec meta values.

Each case ends in one verdict (:class:`pollen.testing.hostile_cases.Verdict`):

- **rejected**: the reply was refused with a counted reason and every state array is bit-identical to a
  run where that client stayed silent;
- **accepted variants**: ``harmless`` (state bit-identical to the honest run: the mutation meant the same)
  or ``accepted`` (a legal value that differs, e.g. a flipped low mantissa bit: finite state, no value
  more than 1e6 times its size in either reference run);
- **escaped**: ``crashed`` (the server raised), ``corrupted`` (a state array changed vs silent although
  the reply was refused, or changed vs both references, or became non-finite or blown up), ``stalled``
  (the round's server step did not happen with the honest replies), ``uncounted`` (dropped without a
  reason).

Usage::

    PYTHONPATH=. python benchmarks/fuzz_replies.py [--fuzz-per-method 100] [--seed 0] \\
        [--write docs/results/hostile-replies.md]
"""

from __future__ import annotations

import argparse
import collections
import logging
import math
import platform
import sys
import time
from collections import OrderedDict
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from pollen.app.methods import METHODS
from pollen.testing import hostile
from pollen.testing.hostile_cases import ESCAPES, Case, cases_for, judge, retype_record
from pollen.wire import protocol

ACCEPTED = ("harmless", "accepted")
NASTY_METRICS = (math.nan, math.inf, -math.inf, -1, 0, 1e12, 1e13, 2**63 - 1, -(2**63), 1e-300, [1.0], [])
MUTATIONS = ("bitflip", "bitflip", "bitflip", "delete", "rename", "retype", "metric", "junk", "meta")


# --------------------------------------------------------------------------- random mutations
def mutation(seed: int) -> hostile.Tamper:
    """A tamper that applies one random mutation (seeded: the same one on every reply it sees)."""

    def tamper(attack: hostile.Attack, msg: Message, honest: Message) -> list[Message]:
        rng = np.random.default_rng(seed)
        if honest.has_error():
            return [honest]
        records = dict(honest.content.items())
        mutate(rng, records)
        return [Message(content=RecordDict(records), reply_to=msg)]

    return tamper


def mutate(rng: np.random.Generator, records: dict[str, Any]) -> str:
    """Change ``records`` in place by one random mutation; return its name."""
    kind = str(rng.choice(MUTATIONS))
    names = sorted(records)
    array_records = [n for n in names if isinstance(records[n], ArrayRecord) and len(records[n])]
    if kind == "bitflip" and array_records:
        target = array_records[int(rng.integers(len(array_records)))]
        arrays = OrderedDict(records[target].items())
        key = list(arrays)[int(rng.integers(len(arrays)))]
        array = arrays[key]
        data = bytearray(array.data)
        for _ in range(int(rng.integers(1, 4))):
            if rng.random() < 0.9 and len(data) > 128:  # mostly the values, sometimes the header
                position = int(rng.integers(128, len(data)))
            else:
                position = int(rng.integers(len(data)))
            data[position] ^= 1 << int(rng.integers(8))
        arrays[key] = Array(dtype=array.dtype, shape=tuple(array.shape), stype=array.stype, data=bytes(data))
        records[target] = ArrayRecord(arrays)
    elif kind == "delete" and names:
        records.pop(names[int(rng.integers(len(names)))])
    elif kind == "rename" and names:
        old = names[int(rng.integers(len(names)))]
        new = names[int(rng.integers(len(names)))] if rng.random() < 0.3 else old + str(rng.integers(10))
        records[new] = records.pop(old)
    elif kind == "retype" and names:
        retype_record(names[int(rng.integers(len(names)))])(records, None)
    elif kind == "metric":
        key = protocol.NUM_EXAMPLES if rng.random() < 0.7 else "loss"
        value = NASTY_METRICS[int(rng.integers(len(NASTY_METRICS)))] if rng.random() < 0.8 else float(rng.normal())
        old = records.get(protocol.METRICS_RECORD)
        values = dict(old.items()) if isinstance(old, MetricRecord) else {}
        values[key] = value
        records[protocol.METRICS_RECORD] = MetricRecord(values)
    elif kind == "meta" and protocol.UPDATE_META_RECORD in records:
        old = records[protocol.UPDATE_META_RECORD]
        values = dict(old.items()) if isinstance(old, ConfigRecord) else {}
        key = str(rng.choice([protocol.META_CODEC, protocol.META_DIM, protocol.META_GRANULARITY, "k"]))
        values[key] = [0, -1, 2**40, "x", 1.5, True][int(rng.integers(6))]
        records[protocol.UPDATE_META_RECORD] = ConfigRecord(values)
    else:
        records[f"junk{int(rng.integers(100))}"] = ConfigRecord({"v": float(rng.normal())})
    return kind


def fuzz_cases(method: str, count: int, seed: int) -> list[Case]:
    base = [seed, sum(method.encode())]
    return [
        Case("fuzz", "reply", str(i), mutation(int(np.random.default_rng([*base, i]).integers(2**32))), "plausible")
        for i in range(count)
    ]


# --------------------------------------------------------------------------- figures
def tally(results: list[tuple[str, str, Case, Any]]) -> dict[str, collections.Counter]:
    per_family: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for family, _, _, verdict in results:
        row = per_family[family]
        row["cases"] += 1
        row["rejected"] += verdict.outcome == "rejected"
        row["accepted variants"] += verdict.outcome in ACCEPTED
        row["escaped"] += verdict.escaped
        if verdict.escaped:
            row[verdict.outcome] += 1
    return per_family


def table(per_family: dict[str, collections.Counter]) -> list[str]:
    lines = [
        "| family | cases | rejected | accepted variants | escaped | crashed | corrupted | stalled | uncounted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    total: collections.Counter = collections.Counter()
    for family in sorted(per_family):
        row = per_family[family]
        total.update(row)
        lines.append(_row(family, row))
    lines.append(_row("**all**", total))
    return lines


def _row(name: str, row: collections.Counter) -> str:
    cells = [row["cases"], row["rejected"], row["accepted variants"], row["escaped"], *(row[e] for e in ESCAPES)]
    return f"| {name} | " + " | ".join(str(c) for c in cells) + " |"


def escapes(results: list[tuple[str, str, Case, Any]]) -> list[str]:
    """The escaped cases, one line per case id and outcome, with the methods it escaped in and one detail."""
    groups: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    details: dict[tuple[str, str], str] = {}
    for _, method, case, verdict in results:
        if verdict.escaped:
            fuzzed = case.kind == "fuzz"
            key = (f"fuzz: {verdict.detail[:70]}" if fuzzed else case.id, verdict.outcome)
            groups[key].append(f"{method} #{case.value}" if fuzzed else method)
            details.setdefault(key, verdict.detail[:140])
    return [
        f"- `{cid}` ({outcome}) in {', '.join(methods)}: {details[(cid, outcome)]}"
        for (cid, outcome), methods in sorted(groups.items())
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz-per-method", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default="", help="comma-separated method names (default: every registered one)")
    parser.add_argument("--write", default="", help="also write the figures as Markdown to this file")
    parser.add_argument(
        "--driver", choices=hostile.DRIVERS, default="sync", help="round driver (async: the methods that take it)"
    )
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.CRITICAL)
    every = hostile.method_names() if args.driver == "sync" else hostile.async_method_names()
    methods = [m for m in args.methods.split(",") if m] or every
    started = time.perf_counter()
    matrix, fuzz = [], []
    for method in methods:
        family = METHODS[method].family
        t0 = time.perf_counter()
        for case in cases_for(method):
            matrix.append((family, method, case, judge(method, case, args.driver)))
        for case in fuzz_cases(method, args.fuzz_per_method, args.seed):
            fuzz.append((family, method, case, judge(method, case, args.driver)))
        print(f"{method}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - started
    command = "PYTHONPATH=. python benchmarks/fuzz_replies.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"Command: `{command.strip()}`",
        "",
        f"{len(methods)} methods on the {args.driver} driver, {len(matrix)} matrix cases and {len(fuzz)} fuzz "
        f"cases (seed {args.seed}) "
        f"in {seconds:.0f} s on one core ({platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}).",
        "",
        "### The matrix (every method x every declared record x hostile values)",
        "",
        *table(tally(matrix)),
        "",
        "Escaped in the matrix:",
        "",
        *(escapes(matrix) or ["- none"]),
        "",
        "### Random fuzz (seeded mutations of valid replies)",
        "",
        *table(tally(fuzz)),
        "",
        "Escaped in the fuzz:",
        "",
        *(escapes(fuzz) or ["- none"]),
        "",
        "Mutation kinds in the fuzz: "
        + ", ".join(f"{k} {v}" for k, v in sorted(collections.Counter(_kinds(fuzz)).items())),
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        _write(args.write, text)
    return 0


def _kinds(fuzz: list[tuple[str, str, Case, Any]]) -> list[str]:
    """The mutation each fuzz case drew (re-drawn from its seed on a copy of nothing but names)."""
    return [_kind_of(case) for _, _, case, _ in fuzz]


def _kind_of(case: Case) -> str:
    closure = case.tamper.__closure__ or ()
    seed = next(cell.cell_contents for cell in closure if isinstance(cell.cell_contents, int))
    return str(np.random.default_rng(seed).choice(MUTATIONS))


def _write(path: str, figures: str) -> None:
    from pathlib import Path

    header = Path(path).read_text().split("<!-- figures -->")[0] if Path(path).exists() else ""
    Path(path).write_text(header + "<!-- figures -->\n\n" + figures + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
