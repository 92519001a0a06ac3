"""The documentation's results figures, drawn from the tables on the results pages themselves.

Each results page (``docs/results/*.md``) shows its main finding as a figure; this script draws them
(``docs/figures/results-<page>.png``) from the numbers in the page's own Markdown tables, so a figure
says what its page says and is redrawn when a benchmark rewrites the page::

    python tools/results_plots.py            # every figure
    python tools/results_plots.py lazy hafed # some of them

A table is found by the words of its header (a page that loses the table fails with one line naming
the page and the columns). Styling is pollen's own (:mod:`pollen.app.plotstyle`): a title that states
the finding, a colour and marker per series, the legend beside the data.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pollen.app import plotstyle  # noqa: E402

RESULTS = ROOT / "docs" / "results"
FIGURES = ROOT / "docs" / "figures"
#: Pollen's own methods are drawn in the first colour, Flower's strategies in grey.
POLLEN, FLOWER = plotstyle.COLOURS[0], "#9a9a9a"
#: Figure width in inches: 790 pixels at 110 dpi, about the width of the site's text column, so a figure is
#: shown near its own size and its 8-10 point text stays readable.
WIDTH = 7.2

#: matplotlib settings of these figures, applied while each is drawn (:func:`_styled`), not process-wide.
STYLE = {
    "font.size": 9.5,
    "axes.titlesize": 10,
    "figure.titlesize": 11,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "figure.constrained_layout.use": True,
}


def _styled(draw: Callable[[], Path]) -> Callable[[], Path]:
    """``draw`` run under :data:`STYLE`."""

    @functools.wraps(draw)
    def styled() -> Path:
        with plt.rc_context(STYLE):
            return draw()

    return styled


# --------------------------------------------------------------------------- reading the pages' tables


@dataclass
class Table:
    """One Markdown pipe table: its header cells and its rows' cells (as written, trimmed)."""

    page: str
    header: list[str]
    rows: list[list[str]]

    def col(self, words: str) -> int:
        """Index of the first header cell that contains ``words``."""
        for i, cell in enumerate(self.header):
            if words in cell:
                return i
        raise LookupError(f"{self.page}: no column {words!r} in the table {' | '.join(self.header)}")

    def rows_where(self, column: str, text: str) -> list[list[str]]:
        """The rows whose cell in ``column`` contains ``text``."""
        i = self.col(column)
        return [row for row in self.rows if text in row[i]]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def tables(page: str) -> list[Table]:
    """Every pipe table of ``docs/results/<page>.md``, in order."""
    found: list[Table] = []
    current: Table | None = None
    for line in (RESULTS / f"{page}.md").read_text().splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = _cells(line)
        if current is None:
            current = Table(page, cells, [])
            found.append(current)
        elif not all(re.fullmatch(r":?-{3,}:?", cell) for cell in cells):
            current.rows.append(cells)
    return found


def table(page: str, *header_words: str, index: int = 0) -> Table:
    """The ``index``-th table of the page whose header holds every one of ``header_words``."""
    matches = [t for t in tables(page) if all(any(w in cell for cell in t.header) for w in header_words)]
    if len(matches) <= index:
        raise LookupError(f"docs/results/{page}.md has no table with the columns {', '.join(header_words)}")
    return matches[index]


def label(cell: str) -> str:
    """A cell as a plain label: no bold, italics or code spans."""
    return re.sub(r"[*`]", "", cell).strip()


def value(cell: str) -> float:
    """The first number in a cell (``**0.876**``, ``23,775,600``, ``11.7 MB``, ``5.3 / 14.0``)."""
    match = re.search(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", label(cell).replace(",", ""))
    if match is None:
        raise ValueError(f"no number in the cell {cell!r}")
    return float(match.group())


def mean_sd(cell: str) -> tuple[float, float]:
    """``0.892 ± 0.004`` as (0.892, 0.004); a cell without ``±`` has sd 0."""
    match = re.search(r"(-?\d+(?:\.\d+)?)\s*±\s*(\d+(?:\.\d+)?)", label(cell))
    return (float(match.group(1)), float(match.group(2))) if match else (value(cell), 0.0)


#: Scatter points drawn as outlines, so two methods at the same place both show.
_HOLLOW = {"linestyle": "none", "markerfacecolor": "none", "markeredgewidth": 1.6}


def _is_flower(name: str) -> bool:
    return "Flower's" in name


# --------------------------------------------------------------------------- drawing helpers


def _save(fig: plt.Figure, page: str) -> Path:
    """The figure as ``docs/figures/results-<page>.png``, in 256 colours (a third of the bytes, the same look)."""
    from PIL import Image

    FIGURES.mkdir(parents=True, exist_ok=True)
    path = plotstyle.save(fig, FIGURES / f"results-{page}.png")
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)
    return path


def _hbars(ax: plt.Axes, names: Sequence[str], values: Sequence[float], unit: str = "") -> None:
    """Horizontal bars from 0, first row on top, pollen's blue and Flower's grey, each value written at its end."""
    y = list(range(len(names)))
    ax.barh(y, values, color=[FLOWER if _is_flower(n) else POLLEN for n in names], height=0.65)
    ax.set_yticks(y, [_plain(n) for n in names])
    ax.invert_yaxis()
    ax.grid(False, axis="y")
    for i, v in enumerate(values):
        ax.annotate(f"{v:g}{unit}", (v, i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=7.5)
    ax.set_xlim(0, max(values) * 1.18)


def _dots(ax: plt.Axes, names: Sequence[str], stats: Sequence[tuple[float, float]]) -> None:
    """One point ± sd per row (first row on top; pollen's blue circles, Flower's grey squares), its mean written
    beside it: accuracies differ by points, which bars from 0 would hide."""
    for i, (name, (m, sd)) in enumerate(zip(names, stats)):
        flower = _is_flower(name)
        ax.errorbar(
            m, i, xerr=sd, color=FLOWER if flower else POLLEN, marker="s" if flower else "o", markersize=6,
            capsize=2.5, linestyle="none",
        )  # fmt: skip
        ax.annotate(f"{m:.3f}", (m + sd, i), xytext=(5, 0), textcoords="offset points", va="center", fontsize=7.5)
    ax.set_yticks(range(len(names)), [_plain(n) for n in names])
    ax.set_ylim(len(names) - 0.5, -0.5)


def _plain(name: str) -> str:
    """A method's name without the "(Flower's)" the colour already says."""
    return name.replace(" (Flower's)", "").replace("Flower's, ", "")


def _flower_legend(ax: plt.Axes) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=POLLEN, marker="o", linestyle="none", label="pollen"),
        Line2D([], [], color=FLOWER, marker="s", linestyle="none", label="Flower's own strategy"),
    ]
    ax.figure.legend(handles=handles, loc="outside lower center", ncol=2, frameon=False, fontsize=8.5)


# --------------------------------------------------------------------------- one function per page


@_styled
def fedcams() -> Path:
    t = table("fedcams", "partition", "uplink update bytes")
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 4.2), sharey=True)
    for ax, part in zip(axes, ("IID", "Dirichlet(0.5)")):
        for i, row in enumerate(t.rows_where("partition", part)):
            m, s = mean_sd(row[t.col("final accuracy")])
            ax.errorbar(
                value(row[t.col("uplink")]), m, yerr=s, capsize=3, markersize=7, label=label(row[t.col("method")]),
                **plotstyle.series_style(i) | _HOLLOW,
            )  # fmt: skip
        plotstyle.bytes_axis(ax.xaxis)
        ax.set_title(part)
        ax.set_xlabel("uplink update bytes, whole run (all clients)")
    axes[0].set_ylabel("final test accuracy (mean ± sd, 3 seeds)")
    plotstyle.legend_below(fig)
    fig.suptitle("FedCAMS: accuracy against uploaded bytes (Fashion-MNIST, 20 rounds)")
    return _save(fig, "fedcams")


@_styled
def fedadavr() -> Path:
    t = table("fedadavr", "Dirichlet(0.5) final", "pathological")
    size = table("fedadavr", "N clients", "int4")
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(WIDTH, 7.4), gridspec_kw={"height_ratios": [1.45, 1]})
    names = [label(r[0]) for r in t.rows]
    y = range(len(names))
    for j, (column, name) in enumerate((("Dirichlet(0.5) final", "Dirichlet(0.5)"), ("pathological", "pathological"))):
        ax.barh(
            [i + (j - 0.5) * 0.38 for i in y], [value(r[t.col(column)]) for r in t.rows], height=0.38,
            color=plotstyle.COLOURS[j], label=name,
        )  # fmt: skip
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.grid(False, axis="y")
    ax.set_xlim(0.4, 0.85)
    ax.set_xlabel("final test accuracy (round 30, seed 1)")
    ax.set_title("Accuracy with 5 of 100 clients per round")
    plotstyle.legend_outside(ax)
    clients = [value(r[0]) for r in size.rows if r[0][0].isdigit()]
    for i, precision in enumerate(("fp32", "fp16", "int8", "int4")):
        mb = [value(r[size.col(precision)]) * 1e6 for r in size.rows if r[0][0].isdigit()]
        ax2.plot(clients, mb, markersize=6, label=precision, **plotstyle.series_style(i))
    ax2.set_xscale("log")
    ax2.set_xticks(clients, [f"{int(c):,}" for c in clients])
    ax2.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    plotstyle.bytes_axis(ax2.yaxis)
    ax2.set_xlabel("clients in the table (N)")
    ax2.set_ylabel("table memory (LeNet-5)")
    ax2.set_title("The table's size by precision")
    plotstyle.legend_outside(ax2)
    fig.suptitle("FedAdaVR: ahead of FedAdam and FedVARP;\nan Int4 table is 1/8 of FP32 and as accurate")
    return _save(fig, "fedadavr")


@_styled
def fedlamb() -> Path:
    t = table("fedlamb", "acc @ 2", "grad evals")
    rounds = [int(value(c)) for c in t.header if c.startswith("acc @")]
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 4.4), sharey=True)
    for ax, data in zip(axes, ("IID", "non-IID")):
        for i, row in enumerate(r for r in t.rows if r[0] == data):
            points = [mean_sd(row[t.col(f"acc @ {r}")]) for r in rounds]
            ax.errorbar(
                rounds, [p[0] for p in points], yerr=[p[1] for p in points], capsize=2, markersize=5,
                label=label(row[t.col("method")]), **plotstyle.series_style(i),
            )  # fmt: skip
        ax.set_xticks(rounds)
        ax.set_title(f"{data} (Fashion-MNIST, 50 clients)")
        ax.set_xlabel("round")
    axes[0].set_ylabel("test accuracy (mean ± sd, 3 seeds)")
    plotstyle.legend_below(fig)
    fig.suptitle("Fed-LAMB family: LAMB leads on IID data;\non non-IID Fed-SGD and Adp-Fed end ahead")
    return _save(fig, "fedlamb")


@_styled
def fedlamb_round1() -> Path:
    t = table("fedlamb-round1", "reading", "acc @ 20")
    key = {(r[0], r[1], label(r[2])): r for r in t.rows}
    configs = list(dict.fromkeys((method, reading) for _, method, reading in key))
    fig, ax = plt.subplots(figsize=(WIDTH, 4.2))
    for j, data in enumerate(("IID", "non-IID")):
        stats = [mean_sd(key[(data, method, reading)][t.col("acc @ 20")]) for method, reading in configs]
        xs = [i + (j - 0.5) * 0.38 for i in range(len(configs))]
        ax.bar(
            xs, [s[0] for s in stats], yerr=[s[1] for s in stats], width=0.38, capsize=3,
            color=plotstyle.COLOURS[j], label=data,
        )  # fmt: skip
    names = [
        f"{method}\n" + reading.replace(" (Mime's default now)", "\n(Mime's default)") for method, reading in configs
    ]
    ax.set_xticks(range(len(configs)), names, fontsize=8)
    ax.grid(False, axis="x")
    ax.set_ylim(0, 1)
    ax.set_ylabel("test accuracy at round 20 (mean ± sd, 3 seeds)")
    plotstyle.legend_below(fig, ncol=2)
    ax.set_title("Fed-AMS and Mime: the authors' round 1 (local-v)\nand, for Mime, a bias-corrected server v")
    return _save(fig, "fedlamb-round1")


@_styled
def hafed() -> Path:
    from matplotlib.lines import Line2D

    t = table("hafed", "tau", "train loss (last round)")
    methods = list(dict.fromkeys(label(r[1]) for r in t.rows))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(WIDTH, 4.8))
    losses = (("train loss", "training loss, last round", "-", "o"), ("final test loss", "test loss", "--", "s"))
    for i, method in enumerate(methods):
        colour = plotstyle.COLOURS[i]
        rows = [r for r in t.rows if label(r[1]) == method]
        taus = [value(r[0]) for r in rows]
        acc = [mean_sd(r[t.col("final accuracy")]) for r in rows]
        ax.errorbar(
            taus, [a[0] for a in acc], yerr=[a[1] for a in acc], capsize=3, markersize=6, color=colour, marker="D",
        )  # fmt: skip
        for column, _, linestyle, marker in losses:
            ax2.plot(
                taus, [mean_sd(r[t.col(column)])[0] for r in rows], color=colour, linestyle=linestyle, marker=marker,
            )  # fmt: skip
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(taus, [f"{int(v)}" for v in taus])
        a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        a.set_xlabel("local steps per round (tau)")
    ax.set_ylabel("final test accuracy (mean ± sd, 3 seeds)")
    ax.set_title("Accuracy")
    ax2.set_ylabel("loss (mean of 3 seeds)")
    ax2.set_title("FedAMSGrad fits its clients, not the task")
    handles = [Line2D([], [], color=plotstyle.COLOURS[i], linewidth=3, label=m) for i, m in enumerate(methods)]
    handles += [
        Line2D([], [], color="black", linestyle=ls, marker=mk, label=f"{name} (right)") for _, name, ls, mk in losses
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=8.5, frameon=False)
    fig.suptitle("HA-Fed: ahead of FedAMSGrad at every tau,\nthe gap widening with more local steps")
    return _save(fig, "hafed")


@_styled
def lazy() -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 5.6), sharey=True)
    for ax, (model, header) in zip(axes, (("MLP", "method"), ("CNN", "method (CNN)"))):
        t = next(t for t in tables("lazy") if t.header[0] == header and "total MB" in t.header)
        rows = []
        for row in t.rows:
            if row[0].startswith("*"):  # "the app's defaults" rows follow: the same methods at other thresholds
                break
            rows.append(row)
        for i, row in enumerate(rows):
            m, s = mean_sd(row[t.col("final accuracy")])
            ax.errorbar(
                value(row[t.col("total MB")]) * 1e6, m, yerr=s, capsize=2, markersize=7,
                label=label(row[0]).replace("both ways: ", ""), **plotstyle.series_style(i) | _HOLLOW,
            )  # fmt: skip
        plotstyle.bytes_axis(ax.xaxis)
        ax.set_title(f"{model}, 100 clients, 20 rounds")
        ax.set_xlabel("total bytes, both directions, whole run")
    axes[0].set_ylabel("final test accuracy (mean ± sd, 3 seeds)")
    plotstyle.legend_below(fig, ncol=2, fontsize=8)
    fig.suptitle("Lazy family: the compressed downlink is where the bytes are saved")
    return _save(fig, "lazy")


@_styled
def presets() -> Path:
    sections = ("HA-Fed", "FedAMS / FedCAMS", "FedAdaVR", "Lazy and bidirectional", "Fed-LAMB")
    found = [t for t in tables("presets") if t.header[:2] == ["method", "final accuracy"]]
    if len(found) != len(sections):
        raise LookupError(f"docs/results/presets.md: {len(found)} sweep tables, expected {len(sections)}")
    fig, axes = plt.subplots(
        len(found), 1, figsize=(WIDTH, 0.25 * sum(len(t.rows) for t in found) + 0.7 * len(found) + 0.6), sharex=True,
        gridspec_kw={"height_ratios": [len(t.rows) + 1 for t in found]},
    )  # fmt: skip
    for ax, t, section in zip(axes, found, sections):
        _dots(ax, [label(r[0]) for r in t.rows], [mean_sd(r[1]) for r in t.rows])
        ax.set_title(f"{section} (pollen-sweep, 3 seeds)", loc="left")
        ax.tick_params(axis="y", labelsize=8)
    axes[-1].set_xlim(0.15, 0.95)
    axes[-1].set_xlabel("final test accuracy (mean ± sd over 3 seeds)")
    _flower_legend(axes[0])
    fig.suptitle("The presets, one sweep each: every CPU preset through flwr run")
    return _save(fig, "presets")


@_styled
def performance() -> Path:
    server = table("performance", "aggregate_train", "now (ms)")
    message = table("performance", "message", "pollen / bare+state")
    deployed = table("performance", "s / round (median)", "2026-11-29 run")
    fig, (ax, ax_msg, ax2) = plt.subplots(3, 1, figsize=(WIDTH, 8.2), gridspec_kw={"height_ratios": [2, 1.7, 1.1]})
    names = [label(r[0]).replace("pollen ", "") for r in server.rows]
    ms = [value(r[2]) for r in server.rows]
    _hbars(ax, names, ms, " ms")
    flower = next(m for n, m in zip(names, ms) if _is_flower(n))
    ax.axvline(flower, color=FLOWER, linestyle="--", linewidth=1)
    ax.set_xlabel("ms per aggregate_train, 10 replies, d = 11.2 M")
    ax.set_title("The server round at ResNet-18 size")
    rows = [r for r in message.rows if label(r[0]).startswith("ResNet-18")]
    bars, seconds = [], []
    for r in rows:  # columns: model, message, MB, round trip pollen, bare, bare+state, ...
        bars += [f"{label(r[1])}: pollen", f"{label(r[1])}: Flower's bare app, same state"]
        seconds += [value(r[3]), value(r[5])]
    _hbars(ax_msg, bars, seconds, " s")
    ax_msg.set_xlabel("seconds per train message through Flower's simulation, no local training")
    ax_msg.set_title("A message at ResNet-18 size: pollen's ClientApp against Flower's bare one")
    apps = [label(r[0]).replace("anchor (plain Flower)", "plain Flower app (Flower's)") for r in deployed.rows]
    _hbars(ax2, [a.replace(", ", "\n") for a in apps], [value(r[1]) for r in deployed.rows], " s")
    ax2.set_xlabel("seconds per deployed round (median, 2 SuperNodes, one run each, 2026-11-29)")
    ax2.set_title("A deployed round against a plain Flower app")
    _flower_legend(ax2)
    fig.suptitle("Performance: pollen's rounds and messages against Flower's own")
    return _save(fig, "performance")


@_styled
def scale_out() -> Path:
    alone = table("scale-out", "connected clients (N)", "server s / round")
    population = table("scale-out", "clients", "SuperNodes", "s / round (median, rounds 2-50)")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(WIDTH, 4.8))
    methods = list(dict.fromkeys(label(r[0]) for r in alone.rows))
    for i, method in enumerate(methods):
        rows = [r for r in alone.rows if label(r[0]) == method]
        ax.plot([value(r[1]) for r in rows], [value(r[2]) for r in rows], label=method, **plotstyle.series_style(i))
    ax.set_xscale("log")
    ax.set_xticks([1e3, 1e4, 1e5], ["1,000", "10,000", "100,000"])
    ax.set_xlabel("connected clients (N), 100 per round")
    ax.set_ylabel("server seconds per round")
    ax.set_title("The server alone, in-process")
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    runs: dict[str, list[tuple[float, float]]] = {}
    for row in population.rows:
        nodes = "one SuperNode per client" if "one each" in row[2] else "100 SuperNodes (population)"
        runs.setdefault(f"{label(row[0]).split(' (')[0]}, {nodes}", []).append((value(row[1]), value(row[3])))
    for name, points in runs.items():
        # The same colour and marker as the method's line on the left; one SuperNode per client drawn hollow.
        index = next(i for i, m in enumerate(methods) if m.split(" (")[0] == name.split(",")[0])
        hollow = {"markerfacecolor": "none", "markeredgewidth": 1.6} if "per client" in name else {}
        ax2.plot(*zip(*points), markersize=7, label=name, **plotstyle.series_style(index) | hollow)
    ax2.set_xscale("log")
    ax2.set_xticks([1e3, 1e4], ["1,000", "10,000"])
    ax2.set_xlim(700, 14000)
    ax2.set_ylim(0, None)
    ax2.set_xlabel("clients")
    ax2.set_ylabel("seconds per round (median)")
    ax2.set_title("flwr run simulation, 100 clients a round")
    ax2.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    for a in (ax, ax2):
        a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.suptitle("Scale-out: FedAdaVR's round stays flat from 1,000 to 10,000 clients,\nFedBNLACA's grows by a fifth")
    return _save(fig, "scale-out")


@_styled
def redesign() -> Path:
    t = table("redesign", "before (f6969c5)", "after")
    measures = (
        ("AdaptiveStrategy: lines", 0, r"(\d[\d,]*) lines"),
        ("AdaptiveStrategy: code lines", 1, r"(\d[\d,]*)"),
        ("AdaptiveStrategy: methods", 0, r"(\d+) methods"),
        ("AdaptiveStrategy: attributes", 0, r"(\d+) attributes"),
        ("loose modules at pollen/", 4, r"(\d+)"),
    )
    counts = []
    for _, row, pattern in measures:
        pair = []
        for side in ("before (f6969c5)", "after"):
            match = re.search(pattern, t.rows[row][t.col(side)])
            if match is None:
                raise LookupError(f"docs/results/redesign.md: no {pattern!r} in {t.rows[row][t.col(side)]!r}")
            pair.append(float(match.group(1).replace(",", "")))
        counts.append(pair)
    fig, ax = plt.subplots(figsize=(WIDTH, 3.2))
    y = list(range(len(measures)))
    ax.barh(y, [100] * len(y), height=0.7, color="#d9d9d9", label="before (f6969c5) = 100%")
    shares = [100 * after / before for before, after in counts]
    ax.barh(y, shares, height=0.4, color=POLLEN, label="after")
    for i, (before, after) in enumerate(counts):
        ax.annotate(
            f"{before:.0f} → {after:.0f}", (100, i), xytext=(5, 0), textcoords="offset points", va="center", fontsize=8
        )
    ax.set_yticks(y, [m[0] for m in measures])
    ax.invert_yaxis()
    ax.grid(False, axis="y")
    ax.set_xlim(0, 125)
    ax.set_xticks([0, 25, 50, 75, 100], ["0%", "25%", "50%", "75%", "100%"])
    ax.set_xlabel("after, as a share of before")
    plotstyle.legend_below(fig, ncol=2)
    ax.set_title("The redesign: a smaller base class, 2 loose modules instead of 15")
    return _save(fig, "redesign")


@_styled
def robust_aggregation() -> Path:
    t = table("robust-aggregation", "aggregator", "20% scaled by -3")
    scenarios = t.header[1:]
    fig, ax = plt.subplots(figsize=(WIDTH, 4.4))
    width = 0.8 / len(t.rows)
    for i, row in enumerate(t.rows):
        stats = [mean_sd(c) for c in row[1:]]
        xs = [k + (i - (len(t.rows) - 1) / 2) * width for k in range(len(scenarios))]
        ax.bar(
            xs, [s[0] for s in stats], yerr=[s[1] for s in stats], width=width, capsize=2,
            color=plotstyle.COLOURS[i], label=label(row[0]), hatch=("", "//", "..", "xx", "\\\\")[i % 5],
            edgecolor="white", linewidth=0.5,
        )  # fmt: skip
    ax.set_xticks(range(len(scenarios)), ["no attackers" if s == "none" else s for s in scenarios])
    ax.grid(False, axis="x")
    ax.set_ylim(0, 0.9)
    ax.set_ylabel("final test accuracy (mean ± sd, 2 seeds)")
    plotstyle.legend_below(fig, ncol=3)
    ax.set_title("Robust aggregation: median, trimmed mean and majority vote\nhold where the mean falls")
    return _save(fig, "robust-aggregation")


@_styled
def hostile_replies() -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.9), sharey=True)
    parts = ("rejected", "accepted variants", "escaped")
    colours = (plotstyle.COLOURS[0], plotstyle.COLOURS[2], plotstyle.COLOURS[1])
    for ax, index, name in zip(axes, (0, 1), ("The matrix", "Random fuzz")):
        t = table("hostile-replies", "family", "escaped", index=index)
        rows = [r for r in t.rows if "all" not in r[0]]
        families = [label(r[0]) for r in rows]
        left = [0.0] * len(rows)
        for part, colour in zip(parts, colours):
            counts = [value(r[t.col(part)]) for r in rows]
            ax.barh(families, counts, left=left, color=colour, label=part, height=0.65)
            left = [a + b for a, b in zip(left, counts)]
        total = next(r for r in t.rows if "all" in r[0])
        ax.set_title(f"{name}: {value(total[t.col('escaped')]):.0f} of {value(total[t.col('cases')]):,.0f} escaped")
        ax.set_xlabel("cases")
        ax.grid(False, axis="y")
    axes[0].invert_yaxis()
    plotstyle.legend_below(fig)
    fig.suptitle("Hostile replies: every case refused with a reason or harmless")
    return _save(fig, "hostile-replies")


@_styled
def altered_files() -> Path:
    text = (RESULTS / "altered-files.md").read_text()
    lines = text[text.index("family        cases") :].splitlines()
    header = lines[0].split()
    rows = []
    for line in lines[1:]:
        cells = line.split()
        if len(cells) != len(header) - 1:  # "(names field)" is two words of the header, one column
            break
        rows.append(cells)
    if not rows:
        raise LookupError("docs/results/altered-files.md: no rows under the corpus table's header")
    column = {"refused": 2, "same": 4, "other": 5, "escaped": 6}
    body = [r for r in rows if r[0] != "all"]
    total = next(r for r in rows if r[0] == "all")
    fig, ax = plt.subplots(figsize=(WIDTH, 3.8))
    left = [0.0] * len(body)
    names = {"refused": "refused (one line)", "same": "loaded the same state", "other": "loaded another valid state"}
    for k, part in enumerate(("refused", "same", "other", "escaped")):
        counts = [float(r[column[part]]) for r in body]
        colour = plotstyle.COLOURS[1] if part == "escaped" else plotstyle.COLOURS[(0, 2, 3)[k]]
        ax.barh([r[0] for r in body], counts, left=left, color=colour, label=names.get(part, part), height=0.65)
        left = [a + b for a, b in zip(left, counts)]
    ax.invert_yaxis()
    ax.grid(False, axis="y")
    ax.set_xlabel("altered checkpoints resumed")
    plotstyle.legend_below(fig, ncol=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_title(
        f"Altered checkpoints: {int(total[column['escaped']])} of {int(total[1]):,} escaped, "
        f"{int(total[column['refused']]):,} refused"
    )
    return _save(fig, "altered-files")


@_styled
def dropin() -> Path:
    t = table("dropin", "project", "strategy", "gap at 20")
    projects = list(dict.fromkeys(label(r[t.col("project")]) for r in t.rows))
    rows = {p: [r for r in t.rows if label(r[t.col("project")]) == p] for p in projects}
    fig, axes = plt.subplots(1, len(projects), figsize=(WIDTH, 0.27 * max(map(len, rows.values())) + 1.6), sharey=True)
    for ax, project in zip(axes, projects):
        names = [label(r[t.col("strategy")]) for r in rows[project]]
        for i, row in enumerate(rows[project]):
            for column, marker, shade in (("gap at 5", "o", 0.45), ("gap at 20", "s", 1.0)):
                if "nan" in label(row[t.col(column)]):  # a seed diverged: the mean has no value to draw
                    continue
                flower = names[i] in ("FedAvg()", "FedAdam()")
                ax.plot(
                    value(row[t.col(column)]), i, marker=marker, linestyle="none", markersize=5.5, alpha=shade,
                    color=FLOWER if flower else POLLEN,
                )  # fmt: skip
        ax.axvspan(-0.05, 0.05, color="#2ca02c", alpha=0.08, lw=0)
        ax.axvline(0, color="#555555", lw=0.8)
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_xlim(-0.4, 0.15)
        ax.set_title(project)
        ax.set_xlabel("accuracy - FedAvg's")
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=POLLEN, marker="o", alpha=0.45, linestyle="none", label="after round 5"),
        Line2D([], [], color=POLLEN, marker="s", linestyle="none", label="after round 20"),
        Line2D([], [], color="#2ca02c", alpha=0.3, lw=6, label="within 5 points of FedAvg"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, frameon=False, fontsize=8.5)
    fig.suptitle("Drop-in defaults in three of Flower's examples: gap to FedAvg (mean of 3 seeds)")
    return _save(fig, "dropin")


@_styled
def async_stragglers() -> Path:
    t = table("async", "method", "stragglers", "virtual time to it")
    fractions = list(dict.fromkeys(label(r[t.col("stragglers")]) for r in t.rows))
    fig, axes = plt.subplots(1, len(fractions), figsize=(WIDTH, 2.9), sharey=True)
    for ax, fraction in zip(axes, fractions):
        rows = [r for r in t.rows if label(r[t.col("stragglers")]) == fraction]
        names = [label(r[t.col("method")]) for r in rows]
        stats = [mean_sd(r[t.col("virtual time to it")]) for r in rows]
        colours = [FLOWER if name.endswith("-sync") else POLLEN for name in names]
        y = list(range(len(names)))
        ax.barh(y, [m for m, _ in stats], xerr=[sd for _, sd in stats], color=colours, height=0.65, capsize=2)
        for i, (m, sd) in enumerate(stats):
            ax.annotate(f"{m:.0f}", (m + sd, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7.5)
        ax.set_yticks(y, names)
        ax.invert_yaxis()
        ax.grid(False, axis="y")
        ax.set_xlim(0, max(m + sd for m, sd in stats) * 1.25)
        ax.set_title(f"{fraction} stragglers")
        ax.set_xlabel("virtual time to 65%")
    from matplotlib.patches import Patch

    handles = [Patch(color=FLOWER, label="synchronous driver"), Patch(color=POLLEN, label="asynchronous driver")]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, frameon=False, fontsize=8.5)
    fig.suptitle("Time to 65% on Fashion-MNIST, 100 clients, stragglers 5-10x slower (mean ± sd, 3 seeds)")
    return _save(fig, "async")


@_styled
def privacy() -> Path:
    t = table("privacy", "method", "no DP", "eps 1")
    columns = [c for c in t.header if c.startswith("eps ")]
    epsilons = [value(c.split("(")[0]) for c in columns]
    fig, ax = plt.subplots(figsize=(WIDTH, 3.6))
    for index, row in enumerate(t.rows):
        style = plotstyle.series_style(index)
        name = label(row[t.col("method")])
        cells = [row[t.header.index(c)] for c in columns]
        means = [value(c) for c in cells]
        spans = [re.findall(r"\d+\.\d+", label(c))[1:3] for c in cells]
        low = [m - float(lo) for m, (lo, _) in zip(means, spans)]
        high = [float(hi) - m for m, (_, hi) in zip(means, spans)]
        ax.errorbar(
            epsilons,
            means,
            yerr=[low, high],
            capsize=3,
            label=f"{name}, central DP",
            color=style["color"],
            marker=style["marker"],
        )
        ax.axhline(
            value(row[t.col("no DP")]), color=style["color"], linestyle="--", linewidth=1, label=f"{name}, no DP"
        )
    ax.set_xscale("log")
    ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
    ax.minorticks_off()
    ax.set_xlabel("epsilon after 20 rounds (delta 1e-5)")
    ax.set_ylabel("final test accuracy")
    ax.set_ylim(0, 0.8)
    fig.legend(loc="outside lower center", ncol=3, frameon=False, fontsize=8.5)
    fig.suptitle("Central DP on Fashion-MNIST, 20 of 100 clients a round: accuracy against epsilon (3 seeds)")
    return _save(fig, "privacy")


@_styled
def secure_aggregation() -> Path:
    sizes = table("secure-aggregation", "size", "upload", "x float32")
    resnet = [r for r in sizes.rows if label(r[sizes.col("size")]).startswith("ResNet-18")]
    quality = table("secure-aggregation", "strategy", "plain", "secagg 8 bits")
    fig, (left, right) = plt.subplots(1, 2, figsize=(WIDTH, 3.2), gridspec_kw={"width_ratios": [1, 1.15]})
    names = [label(r[sizes.col("upload")]).replace("pollen, ", "pollen ") for r in resnet]
    ratios = [value(r[sizes.col("x float32")]) for r in resnet]
    _hbars(left, names, ratios, "x")
    left.set_xlabel("bytes up per client, x float32 (ResNet-18)")
    columns = [c for c in quality.header if c != "strategy"]
    for index, row in enumerate(quality.rows):
        style = plotstyle.series_style(index)
        cells = [row[quality.header.index(c)] for c in columns]
        means = [value(c) for c in cells]
        spans = [re.findall(r"\d+\.\d+", label(c))[1:3] for c in cells]
        low = [m - float(lo) for m, (lo, _) in zip(means, spans)]
        high = [float(hi) - m for m, (_, hi) in zip(means, spans)]
        x = [i + 0.08 * (index - 0.5) for i in range(len(columns))]
        right.errorbar(
            x, means, yerr=[low, high], capsize=3, linestyle="none", label=label(row[quality.col("strategy")]),
            color=style["color"], marker=style["marker"],
        )  # fmt: skip
    right.set_xticks(range(len(columns)), [c.replace("secagg ", "secagg\n") for c in columns])
    right.set_ylabel("final test accuracy")
    fig.legend(loc="outside lower center", ncol=2, frameon=False, fontsize=8.5)
    fig.suptitle("Secure aggregation: upload size and accuracy (Fashion-MNIST, 3 seeds)")
    return _save(fig, "secure-aggregation")


#: Page name (``docs/results/<page>.md``) -> the function that draws its figure.
FIGURES_OF: dict[str, Callable[[], Path]] = {
    "fedcams": fedcams,
    "fedadavr": fedadavr,
    "fedlamb": fedlamb,
    "fedlamb-round1": fedlamb_round1,
    "hafed": hafed,
    "lazy": lazy,
    "presets": presets,
    "performance": performance,
    "scale-out": scale_out,
    "redesign": redesign,
    "robust-aggregation": robust_aggregation,
    "hostile-replies": hostile_replies,
    "altered-files": altered_files,
    "dropin": dropin,
    "async": async_stragglers,
    "privacy": privacy,
    "secure-aggregation": secure_aggregation,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pages", nargs="*", help=f"pages to draw (default: all): {', '.join(FIGURES_OF)}")
    args = parser.parse_args(argv)
    unknown = [p for p in args.pages if p not in FIGURES_OF]
    if unknown:
        print(f"results_plots: unknown page {', '.join(unknown)}; known: {', '.join(FIGURES_OF)}", file=sys.stderr)
        return 2
    for page in args.pages or list(FIGURES_OF):
        path = FIGURES_OF[page]()
        print(f"{path.relative_to(ROOT)}  {path.stat().st_size / 1000:.0f} kB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
