"""Compare finished runs: one table and overlaid plots for several result folders.

    pollen-compare results/fedams-* results/fedcams-* --out results/compare
    python -m pollen.compare results/a results/b
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pollen.results import human_bytes, load_rows, plot_runs


def summarise(run_dir: Path) -> dict:
    rows = load_rows(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    last = rows[-1] if rows else {}
    accuracies = [r["accuracy"] for r in rows if isinstance(r.get("accuracy"), (int, float))]
    return {
        "run": run_dir.name,
        "strategy": config.get("strategy", "?"),
        "compressor": config.get("compressor", "") if config.get("strategy") == "fedcams" else "-",
        "rounds": last.get("round", 0),
        "final_accuracy": accuracies[-1] if accuracies else float("nan"),
        "best_accuracy": max(accuracies) if accuracies else float("nan"),
        "uplink_bytes": last.get("cum_uplink_bytes", 0) or 0,
        "downlink_bytes": last.get("cum_downlink_bytes", 0) or 0,
        "seconds": last.get("elapsed_seconds", 0.0) or 0.0,
    }


def format_table(summaries: list[dict]) -> str:
    header = "| run | strategy | uplink codec | rounds | final acc | best acc | uplink | downlink | seconds |"
    lines = [header, "|" + "---|" * 9]
    for s in summaries:
        lines.append(
            f"| {s['run']} | {s['strategy']} | {s['compressor']} | {s['rounds']} | {s['final_accuracy']:.4f} | "
            f"{s['best_accuracy']:.4f} | {human_bytes(s['uplink_bytes'])} | {human_bytes(s['downlink_bytes'])} | "
            f"{s['seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="result folders (each holds metrics.json)")
    parser.add_argument("--out", type=Path, default=Path("results/compare"), help="where the table and plots go")
    args = parser.parse_args(argv)
    missing = [str(run) for run in args.runs if not (run / "metrics.json").is_file()]
    if missing:
        print(f"pollen-compare: no metrics.json in {', '.join(missing)}", file=sys.stderr)
        return 2
    summaries = [summarise(run) for run in args.runs]
    table = format_table(summaries)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comparison.md").write_text(table + "\n")
    (args.out / "comparison.json").write_text(json.dumps(summaries, indent=2) + "\n")
    plot_runs({run.name: load_rows(run) for run in args.runs}, args.out)
    print(table)
    print(f"\nwritten: {args.out / 'comparison.md'} and the accuracy plots (vs round, uplink, downlink and total bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
