"""One look for every plot pollen draws: a title, series told apart, the legend beside the data, readable ticks.

The run's own plots and ``pollen-compare``'s (:func:`pollen.app.results.plot_runs`) and the documentation's
results figures (``tools/results_plots.py``) use it. matplotlib is imported inside the functions that need
it, so importing this module costs nothing at a run's start.

Series are told apart by colour *and* marker: :data:`COLOURS` has twelve colours that differ in hue or
lightness, :data:`MARKERS` twelve shapes, and a series past the twelfth gets the next line style, so
thirty-six series stay distinct (and a plot printed in grey still has its markers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "COLOURS",
    "DPI",
    "MARKERS",
    "bytes_axis",
    "integer_axis",
    "legend_below",
    "legend_outside",
    "save",
    "series_style",
]

#: Twelve colours, distinct on screen: matplotlib's tab10 and two it lacks (black, a dark teal).
COLOURS = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#000000",
    "#005f5f",
)
#: Twelve marker shapes, one per colour.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
_LINESTYLES = ("-", "--", ":", "-.")
#: Resolution of the PNGs (a 8 x 4.5 inch figure is 880 x 495 pixels).
DPI = 110


def series_style(index: int) -> dict[str, Any]:
    """Colour, marker and line style of the ``index``-th series (keyword arguments of ``Axes.plot``)."""
    if index < 0:
        raise ValueError(f"series index {index} is negative; allowed: 0, 1, 2, ...")
    n = len(COLOURS)
    return {
        "color": COLOURS[index % n],
        "marker": MARKERS[index % n],
        "linestyle": _LINESTYLES[(index // n) % len(_LINESTYLES)],
    }


def legend_outside(ax: Any, *, title: str | None = None, fontsize: float = 8) -> Any:
    """The legend to the right of the axes, never over the data (``save`` keeps it in the image)."""
    return ax.legend(
        loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=fontsize, title=title, frameon=False
    )


def legend_below(fig: Any, ax: Any = None, *, ncol: int = 3, fontsize: float = 8.5, title: str | None = None) -> Any:
    """One legend for the figure, under its axes (the figure needs ``layout="constrained"``), from ``ax``'s series
    (default: the first axes'): for figures of several panels, or too narrow for a legend at the side."""
    handles, labels = (ax or fig.axes[0]).get_legend_handles_labels()
    return fig.legend(
        handles, labels, loc="outside lower center", ncol=ncol, fontsize=fontsize, frameon=False, title=title
    )


def _bytes_label(value: float, _position: Any = None) -> str:
    """``1.5 MB``-style tick labels (decimal units, as the results tables write bytes)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.3g} {unit}"
        value /= 1000
    return f"{value:.3g} TB"


def bytes_axis(axis: Any) -> None:
    """A log-scaled byte axis (``ax.xaxis`` or ``ax.yaxis``) labelled in kB / MB / GB.

    Call it after the data are drawn: the ticks are at 1, 2 and 5 of each decade, or 1 and 3, or one a
    decade, whichever is the densest that leaves each label room (about 0.7 inch on an x axis).
    """
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax = axis.axes
    box = ax.get_position()
    if axis is ax.xaxis:
        ax.set_xscale("log")
        low, high = ax.get_xlim()
        room = box.width * ax.figure.get_figwidth() / 0.7
    else:
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        room = box.height * ax.figure.get_figheight() / 0.3
    decades = max(math.log10(high / low), 1.0) if low > 0 and high > low else 3.0
    subs = next((s for s in ((1.0, 2.0, 5.0), (1.0, 3.0)) if decades * len(s) <= room), (1.0,))
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(_bytes_label))
    axis.set_minor_formatter(NullFormatter())


def integer_axis(axis: Any) -> None:
    """Whole-number ticks only (rounds, counts): no "2.5" rounds."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def save(fig: Any, path: str | Path, *, dpi: int = DPI) -> Path:
    """Write ``fig`` as a PNG with everything drawn outside the axes (a legend) inside the image, and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path
