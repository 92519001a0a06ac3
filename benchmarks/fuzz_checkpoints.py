"""Resume every registered strategy from every altered checkpoint; print what happened (issue 24).

For each registered strategy: a real checkpoint after two rounds of a tiny model (pollen's ClientApp
in-process on the fake grid), then every field of it removed, renamed, of the wrong dtype or shape,
declaring a huge size, NaN or Inf, out of range, swapped with another strategy's; plus one file whose
first array declares 10**12 values in its header. Each file is resumed as the app does
(``resume-trust-file=true``, so the fields are what is judged; without it every one of them is refused
by the digest check, counted once per strategy below). Prints, per strategy family and in total: cases,
refused with one line (and how many name the altered field), loaded with the same state, loaded with
another valid state, escaped (another exception, a multi-line message, a non-finite state). Target: 0
escaped.

    PYTHONPATH=. python benchmarks/fuzz_checkpoints.py [--strategies fedams,fedadam] [--show 20]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from pollen.app.methods import METHODS
from pollen.core.checkpoint import CheckpointError
from pollen.testing import altered_files as corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="", help="comma-separated names (default: every registered one)")
    parser.add_argument("--show", type=int, default=0, help="print this many escaped / unnamed / loaded cases")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    names = [n for n in args.strategies.split(",") if n] or list(METHODS)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bases = {name: corpus.make_base(name, root / "runs") for name in names}
        totals: Counter = Counter()
        families: dict[str, Counter] = defaultdict(Counter)
        notes: list[str] = []
        loaded: list[str] = []
        for name, base in bases.items():
            family = METHODS[name].family
            reference = corpus.state_of(corpus.resume(base, base.run_dir, trust_file=False))
            donors = [other for other in bases.values() if other is not base][:3]
            cases = list(corpus.alterations(base, donors))
            target = root / "altered"
            for kind, path, tree in cases:
                run_dir = corpus.write_altered(base, tree, target)
                outcome = corpus.resume_outcome(base, run_dir, reference, corpus.field_name(path))
                count(totals, families[family], outcome)
                if outcome.kind == "loaded-other":
                    loaded.append(f"{name} {kind} {'/'.join(map(str, path))}")
                if outcome.kind == "escaped" or (outcome.kind == "refused" and not outcome.names_field):
                    notes.append(f"{name} {kind} {'/'.join(map(str, path))}: {outcome.kind}: {outcome.message}")
            # the file's own bytes: a member declaring 10**12 values, and the digest check without trust
            run_dir = corpus.write_altered(base, base.tree, target)
            member = corpus.huge_header(run_dir / corpus.CHECKPOINT_FILE)
            outcome = corpus.resume_outcome(base, run_dir, reference, member)
            count(totals, families[family], outcome)
            try:
                corpus.resume(base, run_dir, trust_file=False)
                totals["digest-missed"] += 1
            except CheckpointError as err:
                totals["digest-refused"] += "sha256" in str(err)
        seconds = time.perf_counter() - started
    print(f"strategies: {len(bases)} ({', '.join(bases)}); {seconds:.0f} s")
    header = f"{'family':<12} {'cases':>6} {'refused':>8} {'(names field)':>14} {'same':>6} {'other':>6} {'escaped':>8}"
    print(header)
    for family, c in sorted(families.items()):
        print(row(family, c))
    print(row("all", totals))
    print(f"digest check without resume-trust-file: {totals['digest-refused']} of {len(bases)} edited files refused")
    for note in notes[: args.show]:
        print("  ", note)
    kinds = Counter("/".join(line.split()[2].split("/")[:2]) for line in loaded)
    print("loaded with another valid state, by field (all strategies, all alterations):")
    for field, n in sorted(kinds.items(), key=lambda item: -item[1]):
        print(f"   {n:>5}  {field}")
    for line in loaded[: args.show]:
        print("   loaded:", line)


def count(total: Counter, family: Counter, outcome: corpus.Outcome) -> None:
    for c in (total, family):
        c["cases"] += 1
        c[outcome.kind] += 1
        c["named"] += outcome.kind == "refused" and outcome.names_field


def row(name: str, c: Counter) -> str:
    return (
        f"{name:<12} {c['cases']:>6} {c['refused']:>8} {c['named']:>14} {c['loaded-same']:>6} "
        f"{c['loaded-other']:>6} {c['escaped']:>8}"
    )


if __name__ == "__main__":
    main()
