"""Compare finished runs: one table and overlaid plots for several result folders.

    pollen-compare results/fedams-* results/fedcams-* --out results/compare [--target 0.8]
    python -m pollen.app.compare results/a results/b

:func:`write_report` is the engine of both this command and ``pollen-sweep``: runs are grouped (a method
over several seeds; here each run is its own group) and each group gets final and best accuracy (mean +-
sd), rounds to a target accuracy, uplink / downlink / total bytes and wall time, next to the accuracy plots
vs round and vs cumulative uplink, downlink and total bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from pollen.app.registry import codecs_of
from pollen.app.results import human_bytes, load_rows, plot_runs


def _codecs(config: dict) -> str:
    """The run's codecs in words, as its method reads its config: ``-`` (dense), ``sign``, ``topk / down topk``."""
    return codecs_of(config)


def summarise(run_dir: Path) -> dict:
    rows = load_rows(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    last = rows[-1] if rows else {}
    accuracies = [r["accuracy"] for r in rows if isinstance(r.get("accuracy"), (int, float))]
    return {
        "run": run_dir.name,
        "strategy": config.get("strategy", "?"),
        "compressor": _codecs(config),
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


def rounds_to(rows: list[dict], target: float) -> int | None:
    """The first round whose accuracy reaches ``target`` (``None`` if none does)."""
    for row in rows:
        value = row.get("accuracy")
        if isinstance(value, (int, float)) and value >= target:
            return int(row["round"])
    return None


def _mean_sd(values: list[float], digits: int = 4) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def summarise_group(label: str, run_dirs: Sequence[Path], target: float | None = None) -> dict:
    """Mean and spread over a group's runs (e.g. one method's seeds)."""
    runs = [summarise(run) for run in run_dirs]
    reached = [rounds_to(load_rows(run), target) for run in run_dirs] if target is not None else []
    hits = [r for r in reached if r is not None]
    return {
        "group": label,
        "runs": [s["run"] for s in runs],
        "final_accuracy": [s["final_accuracy"] for s in runs],
        "best_accuracy": [s["best_accuracy"] for s in runs],
        "rounds_to_target": reached,
        "target": target,
        "uplink_bytes": statistics.mean(s["uplink_bytes"] for s in runs),
        "downlink_bytes": statistics.mean(s["downlink_bytes"] for s in runs),
        "seconds": statistics.mean(s["seconds"] for s in runs),
        "rounds_text": (
            f"{statistics.mean(hits):.1f} ({len(hits)}/{len(reached)} reached)"
            if hits
            else f"not reached (0/{len(reached)})"
        )
        if target is not None
        else "-",
    }


def format_group_table(groups: list[dict]) -> str:
    target = next((g["target"] for g in groups if g["target"] is not None), None)
    to_target = f"rounds to {target:g}" if target is not None else "rounds to target"
    lines = [
        f"| method | runs | final accuracy | best accuracy | {to_target} | uplink | downlink | total | wall s (mean) |",
        "|" + "---|" * 9,
    ]
    for g in groups:
        lines.append(
            f"| {g['group']} | {len(g['runs'])} | {_mean_sd(g['final_accuracy'])} | {_mean_sd(g['best_accuracy'])} | "
            f"{g['rounds_text']} | "
            f"{human_bytes(g['uplink_bytes'])} | {human_bytes(g['downlink_bytes'])} | "
            f"{human_bytes(g['uplink_bytes'] + g['downlink_bytes'])} | "
            f"{g['seconds']:.0f} |"
        )
    return "\n".join(lines)


def write_report(
    groups: Mapping[str, Sequence[Path]],
    out: Path,
    *,
    title: str = "",
    commands: Sequence[str] = (),
    target: float | None = None,
) -> str:
    """``report.md`` / ``report.json`` (one row per group), the plots (first run of each group), ``commands.sh``."""
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarise_group(label, runs, target) for label, runs in groups.items() if runs]
    table = format_group_table(summaries)
    plots = plot_runs({label: load_rows(runs[0]) for label, runs in groups.items() if runs}, out, title=title)
    parts = [
        f"# {title}" if title else "# Comparison",
        "",
        table,
        "",
        "Plots (the first run of each row): " + ", ".join(f"[{p.name}]({p.name})" for p in plots),
    ]
    if commands:
        parts += ["", "Commands:", "", "```bash", *commands, "```"]
        (out / "commands.sh").write_text("#!/usr/bin/env bash\nset -e\n" + "\n".join(commands) + "\n")
    (out / "report.md").write_text("\n".join(parts) + "\n")
    (out / "report.json").write_text(json.dumps(summaries, indent=2) + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="result folders (each holds metrics.json)")
    parser.add_argument("--out", type=Path, default=Path("results/compare"), help="where the table and plots go")
    parser.add_argument("--target", type=float, default=None, help="accuracy for the rounds-to-target column")
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
    write_report({run.name: [run] for run in args.runs}, args.out, target=args.target)
    print(table)
    print(
        f"\nwritten: {args.out / 'comparison.md'}, report.md and the accuracy plots "
        "(vs round, uplink, downlink and total bytes)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
