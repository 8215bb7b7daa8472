"""PNG plots of benchmark tables with matplotlib, an optional dependency (``pip install mpistrat[plot]``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["PlotUnavailable", "line_plot", "pyplot"]

INSTALL_HINT = "pip install 'mpistrat[plot]' (or: pip install matplotlib)"


class PlotUnavailable(RuntimeError):
    """``--plot`` was asked for but matplotlib cannot be imported."""


def pyplot() -> Any:
    """matplotlib's ``pyplot`` on the file-only Agg backend; :class:`PlotUnavailable` naming the fix if missing."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed ({exc}); {INSTALL_HINT}") from exc
    matplotlib.use("Agg")  # writes files; needs no display
    import matplotlib.pyplot as plt

    return plt


def line_plot(path: str, series: dict[str, tuple[Sequence[float], Sequence[float]]], *, title: str, xlabel: str,
              ylabel: str, logx: bool = False, logy: bool = False, xticks: Sequence[float] | None = None,
              xticklabels: Sequence[str] | None = None, dashed: Sequence[str] = ()) -> None:
    """Write one PNG with a line (and markers) per ``name: (xs, ys)`` of ``series``; ``dashed`` names guide lines."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    try:
        for name, (xs, ys) in series.items():
            style = {"linestyle": "--", "marker": None, "color": "0.5"} if name in dashed else {"marker": "o"}
            ax.plot(list(xs), list(ys), label=name, **style)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        if xticks is not None:
            ax.set_xticks(list(xticks))
            ax.set_xticklabels(list(xticklabels) if xticklabels is not None else [f"{x:g}" for x in xticks])
            ax.set_xticks([], minor=True)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
